"""Fixtures and helpers for the engine tests: tiny checkpoints, engines, drivers, invariant checks.

Checkpoints are tiny random Llama models saved with transformers (through
``conftest.save_tiny_checkpoint``, whose O(1) weights give peaked, far-from-tied
logits). Two families:

- ``tiny_models``: vocabulary 4096 with the shipped BPE tokenizer, a target and
  four drafts: the target itself (every greedy draft is right when the
  draft's window covers the context), a perturbed copy of the target (partial
  acceptance), an unrelated model (mostly rejected) and a "wide" one whose
  embeddings are padded past the target's vocabulary and often proposes the
  ids only it has.
- ``tiny_vocab_models``: vocabulary 5 with a word-level tokenizer, a target
  and an unrelated draft, small enough to enumerate every output sequence;
  plus the same target under a 7-word tokenizer paired with a draft of
  vocabulary 7, which proposes ids the target's embeddings lack.

Test modules import the fixtures they use from here by name.
"""

from __future__ import annotations

import copy
import json
import shutil
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from conftest import SHIPPED_TARGET, save_tiny_checkpoint
from dspark_ray.engine import Engine, EngineConfig, SamplingParams
from dspark_ray.engine.local import build_local_engine
from dspark_ray.engine.outputs import SpecSummary

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
EOS_ID = 0  # "<|endoftext|>" in the shipped tokenizer, "<eos>" in the word-level one
TINY_VOCAB = ("<eos>", "a", "b", "c", "d")
# The tiny models' max_position_embeddings: at least EngineConfig's default max_context, which start-up
# refuses to exceed (dspark_ray.model.rope.check_max_context). Default RoPE does not depend on it.
MAX_POSITIONS = 1024


def copy_shipped_tokenizer(folder: Path) -> None:
    for name in TOKENIZER_FILES:
        shutil.copy(SHIPPED_TARGET / name, folder / name)


def write_word_tokenizer(folder: Path, words: Iterable[str] = TINY_VOCAB) -> None:
    """A word-level tokenizer over ``words`` (the first is the EOS special token)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = list(words)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tok.add_special_tokens([words[0]])
    tok.save(str(folder / "tokenizer.json"))
    config = {"eos_token": words[0], "bos_token": None, "add_bos_token": False, "add_eos_token": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def save_model(folder: Path, hf_model) -> None:
    hf_model.save_pretrained(folder)


def perturbed_copy(hf_model, seed: int, scale: float):
    """A copy of ``hf_model`` with every weight moved by ``scale`` times its own spread."""
    other = copy.deepcopy(hf_model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(scale * p.std() * torch.randn(p.shape, generator=gen))
    return other


def wide_copy(hf_model, extra_from: int, boost: float = 3.0):
    """``hf_model`` with the output rows of ids ``extra_from..`` (padding ids) boosted, so they get sampled."""
    with torch.no_grad():
        hf_model.lm_head.weight[extra_from:] *= boost
    return hf_model


@dataclass
class TinyModels:
    target: Path
    drafts: dict[str, Path]  # "same" | "near" | "other" | "wide"
    hf_target: object  # the transformers model saved at ``target`` (float32, eval)
    padded_target: Path  # vocabulary 4160 > the tokenizer's 4096, the padding rows boosted
    hf_padded_target: object


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> TinyModels:
    root = tmp_path_factory.mktemp("engine_models")
    ids = dict(vocab_size=4096, eos_token_id=EOS_ID, bos_token_id=EOS_ID, pad_token_id=EOS_ID,
               max_position_embeddings=MAX_POSITIONS)
    hf_target = save_tiny_checkpoint(root / "target", seed=0, **ids)
    padded = save_tiny_checkpoint(root / "padded", seed=4, **{**ids, "vocab_size": 4160})
    save_model(root / "padded", wide_copy(padded, extra_from=4096))
    save_model(root / "near", perturbed_copy(hf_target, seed=1, scale=0.05))
    save_tiny_checkpoint(root / "other", seed=2, num_hidden_layers=1, **ids)
    save_model(root / "wide", wide_copy(save_tiny_checkpoint(root / "wide", seed=3, **{**ids, "vocab_size": 4160}),
                                        extra_from=4096))
    for name in ("target", "near", "other", "wide", "padded"):
        copy_shipped_tokenizer(root / name)
    drafts = {"same": root / "target", "near": root / "near", "other": root / "other", "wide": root / "wide"}
    return TinyModels(root / "target", drafts, hf_target, root / "padded", padded)


@dataclass
class TinyVocabModels:
    target: Path
    draft: Path
    wide_target: Path  # ``target``'s weights (vocabulary 5) under a 7-word tokenizer
    wide_draft: Path  # vocabulary 7, same tokenizer: ids 5 and 6 exist only in the draft
    vocab: int


@pytest.fixture(scope="session")
def tiny_vocab_models(tmp_path_factory) -> TinyVocabModels:
    root = tmp_path_factory.mktemp("engine_tiny_vocab")
    ids = dict(vocab_size=len(TINY_VOCAB), eos_token_id=EOS_ID, bos_token_id=EOS_ID, pad_token_id=EOS_ID,
               max_position_embeddings=64, hidden_size=32, intermediate_size=48)
    save_tiny_checkpoint(root / "target", seed=10, **ids)
    save_tiny_checkpoint(root / "draft", seed=11, num_hidden_layers=1, **ids)
    save_tiny_checkpoint(root / "wide", seed=12, num_hidden_layers=1, **{**ids, "vocab_size": 7})
    for name in ("target", "draft"):
        write_word_tokenizer(root / name)
    (root / "wide_target").mkdir()
    for f in (root / "target").iterdir():
        if f.name not in TOKENIZER_FILES:
            (root / "wide_target" / f.name).symlink_to(f)
    for name in ("wide", "wide_target"):
        write_word_tokenizer(root / name, TINY_VOCAB + ("e", "f"))
    return TinyVocabModels(root / "target", root / "draft", root / "wide_target", root / "wide", len(TINY_VOCAB))


def make_engine(target: Path, draft: Path | None = None, **config) -> Engine:
    """An in-process engine; ``config`` are EngineConfig fields (float32 on CPU).

    Adaptive speculation is off unless asked for: its k follows measured step times, so the
    speculation statistics these tests compare would follow the machine's load
    (tests/test_engine_adaptive.py tests it, with output compared token for token). The draft is
    float32 unless asked otherwise: the default ("auto") is bfloat16 only on CPUs with native
    bfloat16, and these tests' drafts, acceptance and schedules must be the same on every machine
    (test_engine_greedy.py tests the other dtypes, "auto" included)."""
    config.setdefault("capacity", 8)
    config.setdefault("adaptive_speculation", False)
    config.setdefault("draft_dtype", "float32")
    config.setdefault("max_context", 128)
    return build_local_engine(EngineConfig(model=str(target), draft=str(draft) if draft else None, **config))


class ProposalLog:
    """The real draft service, with every proposed token id kept (to show what a test exercised)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.token_ids: list[int] = []

    def propose(self, rows):
        proposal = self.inner.propose(rows)
        for drafts in proposal.draft_token_ids:
            self.token_ids += drafts
        return proposal


class ThreadedService:
    """A real in-process service whose ``propose_async``/``step_async`` run on a thread of its own.

    It gives an in-process engine what the Ray facades give it (a call sent now
    and collected later), so the pipelined engine runs, really overlapped,
    without a cluster. Every call's (name, start, end) is kept in ``calls``;
    ``fail_on`` maps a method name to the call numbers (1-based) that raise.
    """

    def __init__(self, inner, fail_on: dict[str, set[int]] | None = None) -> None:
        self.inner = inner
        self.calls: list[tuple[str, float, float]] = []
        self.fail_on = fail_on or {}
        self._counts: dict[str, int] = {}
        self._pool = ThreadPoolExecutor(max_workers=1)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _run(self, name: str, *args):
        self._counts[name] = self._counts.get(name, 0) + 1
        start = time.perf_counter()
        try:
            if self._counts[name] in self.fail_on.get(name, ()):
                raise RuntimeError(f"injected failure of {name} call {self._counts[name]}")
            return getattr(self.inner, name)(*args)
        finally:
            self.calls.append((name, start, time.perf_counter()))

    def propose_async(self, rows):
        return self._pool.submit(self._run, "propose", rows)

    def step_async(self, batch):
        return self._pool.submit(self._run, "step", batch)


def make_pipelined_engine(target: Path, draft: Path, fail_on: dict[str, set[int]] | None = None,
                          **config) -> Engine:
    """``make_engine`` with its draft and target behind ``ThreadedService``: the engine pipelines."""
    plain = make_engine(target, draft, **config)
    engine = Engine(plain.config, plain.tokenizer, plain.slots, ThreadedService(plain.target, fail_on),
                    ThreadedService(plain.draft, fail_on))
    assert engine.pipelined
    return engine


# -- driving an engine -------------------------------------------------------------------------


@dataclass
class Collected:
    """Everything an engine reported for one request, streamed deltas concatenated."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    error_code: str | None = None
    spec: SpecSummary | None = None
    outputs: int = 0  # RequestOutputs received
    logprobs: list = field(default_factory=list)  # TokenLogprobs, when the request asked for them
    prompt_logprobs: list | None = None

    def take(self, out) -> None:
        assert not self.finished, f"{out.req_id}: output after it finished"
        self.outputs += 1
        self.token_ids += out.new_token_ids
        self.text += out.new_text
        self.logprobs += out.logprobs or []
        if out.prompt_logprobs is not None:
            assert self.prompt_logprobs is None, f"{out.req_id}: prompt log-probabilities sent twice"
            self.prompt_logprobs = out.prompt_logprobs
        assert out.num_output_tokens == len(self.token_ids), "num_output_tokens disagrees with the deltas"
        if out.finished:
            self.finished = True
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
            self.error, self.error_code, self.spec = out.error, out.error_code, out.spec


def collect(engine: Engine, results: dict[str, Collected], outputs) -> None:
    for out in outputs:
        results.setdefault(out.req_id, Collected()).take(out)


def run_all(engine: Engine, max_steps: int = 10_000, after_step: Callable[[Engine], None] | None = None,
            results: dict[str, Collected] | None = None) -> dict[str, Collected]:
    """Step ``engine`` until it has no work; every request's collected output (added to ``results``)."""
    results = {} if results is None else results
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        collect(engine, results, engine.step())
        if after_step is not None:
            after_step(engine)
    else:
        raise AssertionError(f"the engine did not finish in {max_steps} steps")
    collect(engine, results, engine.step())  # outputs produced between steps (aborts)
    return results


def generate(engine: Engine, prompts: list, params: SamplingParams | list[SamplingParams]) -> list[Collected]:
    """Add every prompt, run to the end, results in prompt order."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    results = run_all(engine)
    return [results[i] for i in ids]


def solo(target: Path, draft: Path | None, prompt, params: SamplingParams, **config) -> Collected:
    """``prompt`` run alone in a fresh engine."""
    return generate(make_engine(target, draft, **config), [prompt], params)[0]


# -- invariants ------------------------------------------------------------------------------


def engine_state(engine: Engine) -> tuple:
    """What a rejected request must not change."""
    snap = engine.slots.snapshot()
    return (
        sorted(engine.requests),
        [r.req_id for r in engine.scheduler.waiting],
        [r.req_id for r in engine.scheduler.running],
        [(live.lease.req_id, live.lease.slot, live.lease.epoch) for live in snap.live],
        snap.counters,
        engine.target.kv_free(),
        len(engine._pending),
    )


def assert_drained(engine: Engine, requests_added: int | None = None) -> None:
    """Invariant 5: nothing left in flight, every slot and KV token free, counters balanced."""
    assert not engine.has_unfinished()
    assert engine.requests == {}
    assert not engine.scheduler.waiting and not engine.scheduler.running
    snap = engine.slots.snapshot()
    assert snap.live == () and snap.free == snap.capacity, f"slots still held: {snap.live}"
    c = snap.counters
    assert c.allocations + c.restored - c.releases == 0, f"slot counters do not balance: {c}"
    assert c.stale_releases == 0, f"the engine released a slot it did not hold: {c}"
    assert engine.target.kv_free() == engine.target.kv_capacity(), "target KV tokens leaked"
    assert int(engine.target.table.lengths.sum()) == 0, "a slot still holds target KV positions"
    if requests_added is not None:
        assert sum(engine.counters.finished.values()) == requests_added


# -- tensor parallel 2 in two processes ---------------------------------------------------------------


def spawn_tp2(rank_fn: Callable, *args) -> None:
    """Run ``rank_fn(rank, *args)`` in two processes joined in one gloo group (tensor parallel 2 on
    this machine), each with one torch thread; the group is torn down when ``rank_fn`` returns.
    ``rank_fn`` must be a module-level function (it is pickled by reference)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_gloo_rank, args=(port, rank_fn, args), nprocs=2)


def _gloo_rank(rank: int, port: int, rank_fn: Callable, args: tuple) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))
    try:
        rank_fn(rank, *args)
    finally:
        dist.destroy_process_group()


def tp_speculative_engine(target: str, draft: str, rank: int, max_context: int) -> Engine:
    """On a rank of ``spawn_tp2``: a speculative (fixed k=4) engine over this rank's target shard,
    the draft whole, as each replica's rank runs it."""
    from dspark_ray.engine.local import make_draft_proposer, make_target_runner
    from dspark_ray.model.parallel import TensorParallel
    from dspark_ray.slots import SlotRegistry
    from dspark_ray.tokenizer import Tokenizer

    config = EngineConfig(model=target, draft=draft, num_speculative_tokens=4, draft_window=max_context, capacity=8,
                          max_context=max_context, adaptive_speculation=False, draft_dtype="float32")
    tokenizer = Tokenizer.from_path(target)
    return Engine(config, tokenizer, SlotRegistry(config.capacity),
                  make_target_runner(config, tokenizer.vocab_size, TensorParallel(rank, 2)),
                  make_draft_proposer(config, tokenizer.vocab_size))

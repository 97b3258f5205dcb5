"""Greedy decoding: with speculation == without == transformers' generate, token for token.

Invariant 4. The reference is ``transformers``' ``generate(do_sample=False)``
on the same checkpoint, one prompt at a time; the engine runs all prompts in
one batch. Drafts cover the whole acceptance range: the target itself (every
draft right), a perturbed copy (partial acceptance) and an unrelated model
(almost every draft wrong). A separate test checks the draft proposer itself:
every proposal equals the draft model's own windowed greedy continuation, so
its ring cache (rollback, catch-up, slot reuse, preemption) keeps the right
history.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from conftest import SHIPPED_DRAFT, SHIPPED_DSPARK, SHIPPED_TARGET, shipped
from dspark_ray import LLM, SamplingParams
from dspark_ray.engine.interfaces import Proposal, ProposeRow
from dspark_ray.engine.dtypes import native_bf16_cpu
from dspark_ray.model.llama import CausalAttention
from engine_fixtures import (  # noqa: F401 - fixtures
    EOS_ID,
    ProposalLog,
    TinyModels,
    assert_drained,
    collect,
    generate,
    make_engine,
    run_all,
    tiny_models,
)

MAX_CONTEXT = 96
TEXT_PROMPTS = ["ROMEO:", "JULIET: what light through yonder window", "Now is the winter of", "A"]


def prompt_set(seed: int = 0) -> list[list[int]]:
    """Token-id prompts of lengths 1..40 (long ones exceed the draft's window and ring)."""
    rng = random.Random(seed)
    lengths = [1, 2, 3, 5, 8, 13, 21, 40]
    return [[rng.randrange(1, 4096) for _ in range(n)] for n in lengths]


MAX_TOKENS = [1, 2, 7, 16, 24, 33, 40, 50]


def hf_greedy(hf_model, prompt: list[int], max_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens,
                            eos_token_id=EOS_ID, pad_token_id=EOS_ID)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def reference(tiny_models: TinyModels) -> dict[tuple, list[int]]:
    """transformers' greedy tokens for every (prompt, max_tokens) used below."""
    ref = {}
    for prompt, n in zip(prompt_set(), MAX_TOKENS):
        ref[tuple(prompt), n] = hf_greedy(tiny_models.hf_target, prompt, n)
    return ref


def test_reference_is_not_trivial(reference):
    """The comparison only means something if greedy runs are long and varied."""
    outputs = list(reference.values())
    assert sum(len(o) for o in outputs) > 120
    assert len({t for o in outputs for t in o}) > 30


@pytest.mark.parametrize("draft, window", [(None, 1), ("same", MAX_CONTEXT), ("near", MAX_CONTEXT), ("near", 8),
                                           ("other", MAX_CONTEXT)])
def test_greedy_equals_transformers(tiny_models: TinyModels, reference, draft, window):
    engine = make_engine(tiny_models.target, tiny_models.drafts.get(draft), num_speculative_tokens=4,
                         draft_window=window, capacity=8, max_context=MAX_CONTEXT)
    prompts = prompt_set()
    params = [SamplingParams(max_tokens=n) for n in MAX_TOKENS]
    results = generate(engine, prompts, params)
    for prompt, n, res in zip(prompts, MAX_TOKENS, results):
        expected = reference[tuple(prompt), n]
        assert res.token_ids == expected, f"prompt of {len(prompt)} tokens, max_tokens {n}"
        assert res.finish_reason == ("stop" if expected[-1] == EOS_ID else "length")
        assert res.stop_reason == (EOS_ID if res.finish_reason == "stop" else None)
    spec = [r.spec for r in results]
    if draft is None:
        assert all(s.drafts == 0 for s in spec)
    else:
        assert sum(s.draft_tokens for s in spec) > 50
        rate = sum(s.accepted_tokens for s in spec) / sum(s.draft_tokens for s in spec)
        if window == MAX_CONTEXT:  # the acceptance range each draft was built for
            low, high = {"same": (1.0, 1.0), "near": (0.1, 0.9), "other": (0.0, 0.05)}[draft]
            assert low <= rate <= high, rate
    assert_drained(engine, len(prompts))


@pytest.mark.parametrize("draft_dtype", ["bfloat16", "float16", "auto"])
def test_a_draft_in_another_dtype_changes_no_token(tiny_models: TinyModels, reference, draft_dtype):
    """draft_dtype: the draft runs in bfloat16 or float16 beside the float32 target ("auto": bfloat16
    on a CPU with native bfloat16, float32 elsewhere); output is still the target's own greedy output
    (every token is verified) and the draft is still right often ("same" is the target's weights: in
    another dtype it is nearly always right, not always)."""
    engine = make_engine(tiny_models.target, tiny_models.drafts["same"], num_speculative_tokens=4,
                         draft_window=MAX_CONTEXT, capacity=8, max_context=MAX_CONTEXT, draft_dtype=draft_dtype)
    expected = draft_dtype if draft_dtype != "auto" else "bfloat16" if native_bf16_cpu() else "float32"
    assert next(engine.draft.model.parameters()).dtype == getattr(torch, expected)
    assert next(engine.target.model.parameters()).dtype == torch.float32
    prompts = prompt_set()
    results = generate(engine, prompts, [SamplingParams(max_tokens=n) for n in MAX_TOKENS])
    for prompt, n, res in zip(prompts, MAX_TOKENS, results):
        assert res.token_ids == reference[tuple(prompt), n], f"prompt of {len(prompt)} tokens, max_tokens {n}"
    spec = [r.spec for r in results]
    assert sum(s.accepted_tokens for s in spec) / sum(s.draft_tokens for s in spec) > 0.8
    assert_drained(engine, len(prompts))


def test_padded_key_length_and_pinned_attention_backend(tiny_models: TinyModels, reference):
    """The target's CUDA settings, run on CPU: key lengths rounded up to 64 (capped at the
    context), masked padding keys and SDPA pinned to CUDA_ATTENTION_BACKENDS change no token."""
    from dspark_ray.engine import target_runner

    engine = make_engine(tiny_models.target, tiny_models.drafts["near"], num_speculative_tokens=4,
                         draft_window=MAX_CONTEXT, capacity=8, max_context=MAX_CONTEXT)
    assert engine.target.key_bucket == 1 and engine.target.attention_backends is None  # CPU defaults
    engine.target.key_bucket = 64  # < MAX_CONTEXT (96): rounds to 64, then caps at 96
    engine.target.attention_backends = target_runner.CUDA_ATTENTION_BACKENDS
    prompts = prompt_set()
    results = generate(engine, prompts, [SamplingParams(max_tokens=n) for n in MAX_TOKENS])
    for prompt, n, res in zip(prompts, MAX_TOKENS, results):
        assert res.token_ids == reference[tuple(prompt), n], f"prompt of {len(prompt)} tokens, max_tokens {n}"
    assert_drained(engine, len(prompts))


def test_draft_with_a_wider_vocabulary(tiny_models: TinyModels, reference):
    """A draft whose embeddings are padded past the target's (and the tokenizer's) vocabulary.

    Its q is wider than the target's p, and its padding rows are boosted: it
    must still never propose an id the tokenizer lacks, and output is exact.
    """
    engine = make_engine(tiny_models.target, tiny_models.drafts["wide"], num_speculative_tokens=3,
                         draft_window=MAX_CONTEXT, max_context=MAX_CONTEXT)
    engine.draft = log = ProposalLog(engine.draft)
    prompts = prompt_set()
    params = [SamplingParams(max_tokens=n) for n in MAX_TOKENS]
    sampled = [SamplingParams(max_tokens=n, temperature=1.0, seed=i) for i, n in enumerate(MAX_TOKENS)]
    results = generate(engine, prompts + prompts, params + sampled)
    for prompt, n, res in zip(prompts, MAX_TOKENS, results):
        assert res.token_ids == reference[tuple(prompt), n]
    for n, res in zip(MAX_TOKENS, results[len(prompts):]):
        assert res.error is None and all(t < 4096 for t in res.token_ids)
        assert len(res.token_ids) == n or res.finish_reason == "stop"
    assert len(log.token_ids) > 100 and max(log.token_ids) < 4096
    assert_drained(engine, 2 * len(prompts))


def test_target_padded_past_the_tokenizer(tiny_models: TinyModels):
    """A target with embedding rows no tokenizer id names never emits them (its greedy run would)."""
    hf = tiny_models.hf_padded_target
    prompt = prompt_set()[4]
    unmasked = hf_greedy(hf, prompt, 30)
    assert max(unmasked) >= 4096, "the padding rows are not boosted enough to matter"
    ids = torch.tensor([prompt])
    masked = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=30,
                         eos_token_id=EOS_ID, pad_token_id=EOS_ID, suppress_tokens=list(range(4096, 4160)))
    for draft in (None, tiny_models.drafts["wide"]):
        engine = make_engine(tiny_models.padded_target, draft, num_speculative_tokens=3,
                             draft_window=MAX_CONTEXT, max_context=MAX_CONTEXT)
        greedy, sampled = generate(engine, [prompt, prompt], [SamplingParams(max_tokens=30),
                                                               SamplingParams(max_tokens=30, temperature=1.5, seed=0)])
        assert greedy.token_ids == masked[0, len(prompt):].tolist()
        assert sampled.error is None and len(sampled.token_ids) == 30 and max(sampled.token_ids) < 4096
        assert sampled.text == engine.tokenizer.decode(sampled.token_ids)
        assert_drained(engine, 2)


def test_identical_draft_with_full_window_accepts_everything(tiny_models: TinyModels, reference):
    """The target as its own draft, attending to the whole context: every greedy draft is right."""
    engine = make_engine(tiny_models.target, tiny_models.drafts["same"], num_speculative_tokens=3,
                         draft_window=MAX_CONTEXT, max_context=MAX_CONTEXT)
    prompts = prompt_set()
    results = generate(engine, prompts, [SamplingParams(max_tokens=n) for n in MAX_TOKENS])
    for prompt, n, res in zip(prompts, MAX_TOKENS, results):
        assert res.token_ids == reference[tuple(prompt), n]
        s = res.spec
        assert s.accepted_tokens == s.draft_tokens, f"max_tokens {n}: {s}"
        # k shrinks near max_tokens (it never drafts past it), so a run needs ceil(n / (k+1)) steps at best.
        assert s.drafts <= -(-len(res.token_ids) // 4) + 1 or len(res.token_ids) == 1


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_greedy_every_k(tiny_models: TinyModels, reference, k):
    engine = make_engine(tiny_models.target, tiny_models.drafts["near"], num_speculative_tokens=k,
                         draft_window=MAX_CONTEXT, max_context=MAX_CONTEXT)
    prompts = prompt_set()
    results = generate(engine, prompts, [SamplingParams(max_tokens=n) for n in MAX_TOKENS])
    for prompt, n, res in zip(prompts, MAX_TOKENS, results):
        assert res.token_ids == reference[tuple(prompt), n]
        assert len(res.spec.accepted_per_position) <= k
        assert res.spec.draft_tokens <= k * res.spec.drafts
    assert sum(r.spec.accepted_tokens for r in results) > 0
    assert_drained(engine, len(prompts))


def test_per_request_k_and_speculation_off(tiny_models: TinyModels, reference):
    """One batch mixing k = 0..4, speculation off, and k above the engine's maximum."""
    engine = make_engine(tiny_models.target, tiny_models.drafts["near"], num_speculative_tokens=3,
                         draft_window=MAX_CONTEXT, max_context=MAX_CONTEXT)
    prompts = prompt_set()
    variants = [dict(num_speculative_tokens=0), dict(num_speculative_tokens=1), dict(num_speculative_tokens=2),
                dict(speculative=False), dict(num_speculative_tokens=9), dict(), dict(speculative=False),
                dict(num_speculative_tokens=1)]
    params = [SamplingParams(max_tokens=n, **v) for n, v in zip(MAX_TOKENS, variants)]
    results = generate(engine, prompts, params)
    for prompt, n, v, res in zip(prompts, MAX_TOKENS, variants, results):
        assert res.token_ids == reference[tuple(prompt), n], v
        k = 0 if v.get("speculative") is False else min(3, v.get("num_speculative_tokens", 3))
        s = res.spec
        if k == 0:
            assert (s.drafts, s.draft_tokens, s.accepted_per_position) == (0, 0, []), v
            assert s.mean_acceptance_length == 1.0
        else:
            assert len(s.accepted_per_position) <= k and s.draft_tokens <= k * s.drafts, (v, s)
            if n > k + 1:
                assert len(s.accepted_per_position) == k, (v, s)
    assert_drained(engine, len(prompts))


def test_tight_budgets(tiny_models: TinyModels, reference):
    """Two slots, two rows, a 12-token step budget (a longer prompt runs alone): same tokens."""
    engine = make_engine(tiny_models.target, tiny_models.drafts["near"], num_speculative_tokens=3,
                         draft_window=MAX_CONTEXT, max_context=MAX_CONTEXT, capacity=2, max_num_seqs=2,
                         max_num_batched_tokens=12)
    prompts = prompt_set()
    results = generate(engine, prompts, [SamplingParams(max_tokens=n) for n in MAX_TOKENS])
    for prompt, n, res in zip(prompts, MAX_TOKENS, results):
        assert res.token_ids == reference[tuple(prompt), n]
    assert_drained(engine, len(prompts))


@pytest.mark.parametrize("budget", [1, 7, 24, 64])
@pytest.mark.parametrize("draft", [None, "near"])
def test_chunked_prefill_equals_transformers(tiny_models: TinyModels, reference, budget, draft):
    """Prompts longer than the step's token budget are fed in chunks of at most ``budget`` tokens
    (1: one token per step); greedy output is transformers', with and without speculation. An
    80-token prompt joins the set so that 64 chunks too."""
    engine = make_engine(tiny_models.target, tiny_models.drafts[draft] if draft else None, num_speculative_tokens=3,
                         draft_window=8, max_context=MAX_CONTEXT, capacity=4, max_num_seqs=4,
                         max_num_batched_tokens=budget)
    chunked = []
    real_step = engine.target.step

    def step(batch):  # what the target was really fed
        chunked.extend(r.chunk for r in batch.rows if r.chunk)
        fed = sum(r.chunk or len(r.token_ids) + len(r.draft_token_ids) for r in batch.rows)
        assert fed <= max(budget, 4) or len(batch.rows) == 1
        return real_step(batch)

    engine.target.step = step
    long_prompt = prompt_set(2)[-1] * 2  # 80 tokens
    prompts = prompt_set() + [long_prompt]
    max_tokens = MAX_TOKENS + [8]
    results = generate(engine, prompts, [SamplingParams(max_tokens=n) for n in max_tokens])
    for prompt, n, res in zip(prompts, max_tokens, results):
        want = reference.get((tuple(prompt), n)) or hf_greedy(tiny_models.hf_target, prompt, n)
        assert res.token_ids == want, (len(prompt), n)
    assert chunked and max(chunked) <= budget and engine.counters.prefill_chunks == len(chunked)
    assert_drained(engine, len(prompts))


def test_decode_keeps_going_while_a_long_prompt_is_prefilled(tiny_models: TinyModels):
    """A running stream gets tokens in every step while a prompt much longer than the budget is
    chunked in beside it (the prefill takes only what the decode rows leave)."""
    engine = make_engine(tiny_models.target, tiny_models.drafts["near"], num_speculative_tokens=3,
                         draft_window=8, max_context=MAX_CONTEXT, capacity=4, max_num_batched_tokens=10,
                         kv_pool_tokens=4 * MAX_CONTEXT)
    short = engine.add_request([5, 6, 7], SamplingParams(max_tokens=MAX_CONTEXT - 3, ignore_eos=True))
    results = {}
    for _ in range(3):
        collect(engine, results, engine.step())
    long_prompt = prompt_set(1)[-1] * 2  # 80 tokens: eight steps' worth of budget or more
    engine.add_request(long_prompt, SamplingParams(max_tokens=4))
    steps_prefilling = 0
    while engine.requests and any(r.num_tokens - r.target_len > 1 or r.prefill_chunk
                                  for r in engine.requests.values() if r.req_id != short):
        step = engine.step()
        collect(engine, results, step)
        outs = {o.req_id: o for o in step}
        assert outs[short].new_token_ids, "the decode stream got nothing in a step with a prefill chunk"
        assert not outs[short].finished, "the stream ended before the prefill did: make it longer"
        steps_prefilling += 1
    assert steps_prefilling >= 8 and engine.counters.prefill_chunks >= 7
    run_all(engine, results=results)
    assert_drained(engine, 2)


def test_offline_api_text_prompts(tiny_models: TinyModels):
    """``LLM.generate`` on strings: spec == no spec == transformers, and text == decode(token ids)."""
    llm_spec = LLM(tiny_models.target, tiny_models.drafts["near"], num_speculative_tokens=3, draft_window=MAX_CONTEXT,
                   capacity=4, max_context=MAX_CONTEXT)
    llm_plain = LLM(tiny_models.target, None, capacity=4, max_context=MAX_CONTEXT)
    params = SamplingParams(max_tokens=30)
    spec, plain = llm_spec.generate(TEXT_PROMPTS, params), llm_plain.generate(TEXT_PROMPTS, params)
    tok = llm_spec.tokenizer
    for prompt, a, b in zip(TEXT_PROMPTS, spec, plain):
        ids = tok.encode(prompt)
        assert a.prompt_token_ids == ids
        assert a.token_ids == b.token_ids == hf_greedy(tiny_models.hf_target, ids, 30)
        assert a.text == b.text == tok.decode(a.token_ids)
        assert a.finish_reason == b.finish_reason
        assert a.spec.drafts > 0 and b.spec.drafts == 0
    assert llm_spec.generate([], params) == []
    single = llm_spec.generate(TEXT_PROMPTS[0], params)
    assert len(single) == 1 and single[0].token_ids == spec[0].token_ids
    by_ids = llm_spec.generate([tok.encode(TEXT_PROMPTS[1])], params)
    assert by_ids[0].token_ids == spec[1].token_ids
    assert_drained(llm_spec.engine)


class RecordingDraft:
    """The real draft proposer, with every greedy proposal recorded against the draft's own history."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.history: dict[tuple[int, int], list[int]] = {}  # (slot, epoch) -> tokens at draft positions
        self.checked: list[tuple[list[int], list[int]]] = []  # (context, drafts)

    def propose(self, rows: list[ProposeRow]) -> Proposal:
        proposal = self.inner.propose(rows)
        for row, drafts in zip(rows, proposal.draft_token_ids):
            key = (row.slot, row.epoch)
            seen = self.history.get(key, [])
            assert row.start <= len(seen), "the engine asked the draft to start past what it fed"
            context = seen[: row.start] + list(row.token_ids)
            self.checked.append((context, list(drafts)))
            # The last draft is never fed to the draft model: the target verifies it.
            self.history[key] = context + list(drafts[:-1])
        return proposal


def windowed_greedy(model, context: list[int], n: int, window: int) -> list[int]:
    """The draft model's own greedy continuation: full forwards with a sliding window."""
    ids = list(context)
    out = []
    with torch.inference_mode():
        for _ in range(n):
            logits = model(torch.tensor([ids]), attention=CausalAttention(window))[0, -1]
            out.append(int(logits.argmax()))
            ids.append(out[-1])
    return out


@pytest.mark.parametrize("window", [5, 12])
def test_draft_proposals_equal_windowed_reference(tiny_models: TinyModels, window):
    """Every proposal is the draft model's greedy continuation over its last ``window`` tokens.

    Run under slot reuse (capacity 3 < 8 requests) and preemption (a KV pool of
    one full request), with prompts longer than the ring, so rollback, long
    catch-ups, slot epochs and resumed caches all feed this check.
    """
    engine = make_engine(tiny_models.target, tiny_models.drafts["near"], num_speculative_tokens=4,
                         draft_window=window, capacity=3, max_context=64, kv_pool_tokens=68)
    recorder = RecordingDraft(engine.draft)
    engine.draft = recorder
    prompts = prompt_set(seed=1)
    params = [SamplingParams(max_tokens=min(n, 64 - len(p)), num_speculative_tokens=1 + i % 4)
              for i, (p, n) in enumerate(zip(prompts, MAX_TOKENS))]
    for p, sp in zip(prompts, params):
        engine.add_request(p, sp)
    preempted = []
    run_all(engine, after_step=lambda e: preempted.append(e.counters.preemptions))
    assert preempted[-1] > 0, "the KV pool was never short: preemption went untested"
    assert engine.slots.counters().allocations > 3
    model = recorder.inner.model
    assert len(recorder.checked) > 40
    for context, drafts in recorder.checked:
        assert drafts == windowed_greedy(model, context, len(drafts), window), f"context of {len(context)}"
    assert_drained(engine, len(prompts))


SHIPPED_PROMPTS = ["ROMEO:\n", "JULIET:\nO Romeo, Romeo", "First Citizen:\nBefore we proceed any further,",
                   "KING HENRY V:\nOnce more unto the breach", "HAMLET:\nTo be, or not to be"]


def shipped_reference(target: Path, prompts: list[str], max_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    from dspark_ray.tokenizer import Tokenizer

    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    tok = Tokenizer.from_path(target)
    eos = sorted(tok.eos_token_ids)
    out = []
    for prompt in prompts:
        ids = torch.tensor([tok.encode(prompt)])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens,
                          eos_token_id=eos, pad_token_id=eos[0])
        out.append(ref[0, ids.shape[1]:].tolist())
    return out


def test_shipped_target_greedy_equals_transformers():
    """The trained target, alone and as its own draft (every draft right), against transformers."""
    target = shipped(SHIPPED_TARGET, "model.safetensors")
    params = SamplingParams(max_tokens=48)
    expected = shipped_reference(target, SHIPPED_PROMPTS, 48)
    plain = LLM(target, None, capacity=8, max_context=256).generate(SHIPPED_PROMPTS, params)
    self_spec = LLM(target, target, num_speculative_tokens=4, draft_window=256, capacity=8, max_context=256,
                    draft_dtype=None).generate(SHIPPED_PROMPTS, params)  # the draft in the target's own dtype
    for a, b, ref in zip(plain, self_spec, expected):
        assert a.token_ids == b.token_ids == ref
        assert b.spec.accepted_tokens == b.spec.draft_tokens > 0


def test_shipped_pair_greedy_equals_transformers():
    target = shipped(SHIPPED_TARGET, "model.safetensors")
    draft = shipped(SHIPPED_DRAFT, "model.safetensors")
    params = SamplingParams(max_tokens=48)
    expected = shipped_reference(target, SHIPPED_PROMPTS, 48)
    spec = LLM(target, draft, num_speculative_tokens=4, capacity=8, max_context=256).generate(SHIPPED_PROMPTS, params)
    base = LLM(target, None, capacity=8, max_context=256).generate(SHIPPED_PROMPTS, params)
    for a, b, ref in zip(spec, base, expected):
        assert a.token_ids == b.token_ids == ref
    accepted = sum(a.spec.accepted_tokens for a in spec) / sum(a.spec.draft_tokens for a in spec)
    assert accepted > 0.1, f"the trained draft agrees with the trained target on only {accepted:.0%} of drafts"


@pytest.mark.parametrize("k", [4, 5, 7])
def test_shipped_dspark_draft_greedy_equals_transformers(k):
    """The shipped DSpark block draft (models/shakespeare-dspark): the target's greedy tokens for
    every k; a k past its block of 5 drafts the block; and it drafts well, which it can only do
    with the target's hidden states reaching it (its block sees nothing else of the context)."""
    target = shipped(SHIPPED_TARGET, "model.safetensors")
    draft = shipped(SHIPPED_DSPARK, "model.safetensors")
    params = SamplingParams(max_tokens=48)
    expected = shipped_reference(target, SHIPPED_PROMPTS, 48)
    spec = LLM(target, draft, num_speculative_tokens=k, capacity=8, max_context=256,
               adaptive_speculation=False).generate(SHIPPED_PROMPTS, params)
    for a, ref in zip(spec, expected):
        assert a.token_ids == ref
    steps, drafted = sum(a.spec.drafts for a in spec), sum(a.spec.draft_tokens for a in spec)
    # every step drafts min(k, the block), but a request's last steps draft no further than max_tokens
    assert (min(k, 5) - 1) * steps < drafted <= min(k, 5) * steps
    per_step = sum(a.spec.accepted_tokens for a in spec) / steps
    assert per_step > 1.5, f"the DSpark draft keeps only {per_step:.2f} of its drafts per step"


@pytest.mark.parametrize("draft", [False, True])
def test_sliding_window_target_past_its_window_equals_transformers(tmp_path, draft):
    """A Mistral checkpoint with ``sliding_window`` 6, run well past it through the target's paged
    KV (the served path): every greedy token equals transformers' full-forward greedy token."""
    from conftest import save_tiny_checkpoint
    from engine_fixtures import copy_shipped_tokenizer

    window, prompt_len, max_tokens = 6, 10, 24
    hf = save_tiny_checkpoint(tmp_path, "MistralForCausalLM", sliding_window=window, vocab_size=4096,
                              eos_token_id=EOS_ID, bos_token_id=EOS_ID, pad_token_id=EOS_ID,
                              max_position_embeddings=MAX_CONTEXT)
    copy_shipped_tokenizer(tmp_path)
    prompt = [(7 * i) % 4000 + 1 for i in range(prompt_len)]

    def hf_full_greedy() -> list[int]:  # no cache: each token from a full forward of the sequence
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(max_tokens):
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[prompt_len:]

    expected = hf_full_greedy()
    hf.config.sliding_window = None
    assert hf_full_greedy() != expected, "the window changes nothing here: the test would prove nothing"
    engine = make_engine(tmp_path, tmp_path if draft else None, num_speculative_tokens=3, capacity=4,
                         max_context=MAX_CONTEXT)
    (got,) = generate(engine, [prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    assert got.token_ids == expected
    assert_drained(engine, 1)

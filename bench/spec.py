"""Speculation vs none, in one process, side by side; plus transformers' assisted generation.

    .venv/bin/python bench/spec.py                 # shipped target: no draft, its draft, its DSpark draft
    .venv/bin/python bench/spec.py --batches 1 --max-tokens 128
    .venv/bin/python bench/spec.py --rounds 5       # each row the median of 5 interleaved rounds
    python bench/spec.py --device cuda --no-transformers      # on a GPU box
    python bench/spec.py --device cuda --no-transformers --paged-attention  # the Triton paged kernel
    python bench/spec.py --device cuda --no-transformers --eager-draft      # + the draft without its CUDA graphs

Every configuration generates a fixed number of tokens (ignore_eos) from
held-out prompts, greedily. Batch 1 runs several prompts one after another;
larger batches run that many prompts at once. The ratio column compares each
row with dspark_ray without speculation at the same batch size. Two drafters
for the same target: the independent draft model (models/shakespeare-draft, k
sequential passes per step) and the DSpark block draft (models/shakespeare-dspark,
one pass per step over the target's hidden states); "draft ms / step" is the
wall time spent in the draft service per engine step that drafted. When the
DSpark draft has a confidence head (and k is adaptive), it runs twice: with
blocks cut by the head's estimates (the default) and without.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from common import DRAFT, DSPARK_DRAFT, TARGET, Row, Timer, load_prompts, machine, save, table
from dspark_ray import LLM, SamplingParams
from dspark_ray.runtime.timeline import StepTimeline, per_step_ms


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


def run_dspark(llm: LLM, batch: int, repeats: int, max_tokens: int, label: str) -> Row:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    llm.generate(load_prompts(batch), params)  # warm-up
    clock = DraftClock(llm) if llm.engine.draft is not None else None
    steps = StepClock(llm)
    tokens, seconds, acc = 0, 0.0, []
    prompts = load_prompts(batch * repeats)
    try:
        for i in range(repeats):
            with Timer() as t:
                outs = llm.generate(prompts[i * batch:(i + 1) * batch], params)
            seconds += t.seconds
            tokens += sum(len(o.token_ids) for o in outs)
            acc += [o.spec.mean_acceptance_length for o in outs if o.spec and o.spec.drafts]
    finally:
        if clock is not None:
            clock.draft.propose = clock.propose
        phases = steps.close()
    cost = 1000 * clock.seconds / clock.calls if clock is not None and clock.calls else None
    return Row(label, batch, tokens, seconds, sum(acc) / len(acc) if acc else None, cost, phases)


def run_transformers(prompts: list[str], max_tokens: int, k: int) -> list[Row]:
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(TARGET)
    target = LlamaForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    draft = LlamaForCausalLM.from_pretrained(DRAFT, dtype=torch.float32).eval()
    draft.generation_config.num_assistant_tokens = k
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    rows = []
    for label, extra in (("transformers generate", {}), ("transformers assisted (k=%d)" % k, {"assistant_model": draft})):
        tokens, seconds = 0, 0.0
        for i, p in enumerate([prompts[0]] + prompts):
            ids = tok(p, return_tensors="pt").input_ids
            with torch.inference_mode(), Timer() as t:
                out = target.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                                      pad_token_id=tok.eos_token_id, **extra)
            if i > 0:  # the first is a warm-up
                tokens += out.shape[1] - ids.shape[1]
                seconds += t.seconds
        rows.append(Row(label, 1, tokens, seconds))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats-at-1", type=int, default=8, help="prompts run one after another at batch 1")
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=1, help="runs of every system, interleaved; the median is shown")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dspark-draft", default=str(DSPARK_DRAFT),
                    help="the DSpark block draft to compare (a path; '' to leave it out)")
    ap.add_argument("--no-independent", action="store_true", help="leave out the independent draft model")
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
    torch.set_num_threads(args.threads)
    if args.paged_attention:
        from dspark_ray.engine import target_runner

        target_runner.PAGED_KERNEL = True

    common = dict(max_context=512, capacity=64, max_num_seqs=64, device=args.device, dtype=args.dtype,
                  adaptive_speculation=not args.fixed_k)
    k_label = f"k={args.k}" if args.fixed_k else f"adaptive k<={args.k}"
    base = LLM(str(TARGET), None, **common)
    specs = []  # (label, engine)
    if not args.no_independent:
        specs.append((f"dspark_ray, independent draft, {k_label}",
                      LLM(str(TARGET), str(DRAFT), num_speculative_tokens=args.k, **common)))
    if args.dspark_draft and Path(args.dspark_draft).is_dir():
        specs.append((f"dspark_ray, DSpark block draft, {k_label}",
                      LLM(str(TARGET), args.dspark_draft, num_speculative_tokens=args.k, **common)))
        head = json.loads((Path(args.dspark_draft) / "config.json").read_text()).get("enable_confidence_head")
        if head and not args.fixed_k:  # the row above cuts blocks by confidence; this one does not
            specs.append((f"dspark_ray, DSpark block draft, {k_label}, no confidence cut",
                          LLM(str(TARGET), args.dspark_draft, num_speculative_tokens=args.k,
                              confidence_verification=False, **common)))
    eager = None
    if args.eager_draft and args.device != "cpu" and not args.no_independent:
        eager = LLM(str(TARGET), str(DRAFT), num_speculative_tokens=args.k, cuda_graphs=False, **common)
    rows, baseline = [], {}
    systems = [("dspark_ray, no speculation", base)] + specs
    for b in args.batches:
        repeats = args.repeats_at_1 if b == 1 else 1
        # Rounds interleave the systems (the machine's speed drifts); each row is its median round.
        runs = [[run_dspark(llm, b, repeats, args.max_tokens, label) for label, llm in systems]
                for _ in range(args.rounds)]
        added = [sorted(column, key=lambda r: r.tokens_per_s)[len(column) // 2] for column in zip(*runs)]
        baseline[b] = added[0]
        if eager is not None:
            added.append(run_dspark(eager, b, repeats, args.max_tokens,
                                    f"dspark_ray, independent draft, {k_label}, no draft CUDA graphs"))
        rows += added
        print(table(added, baseline).split("\n", 2)[2], flush=True)
    if 1 in args.batches and not args.no_transformers and args.device == "cpu":
        rows += run_transformers(load_prompts(args.repeats_at_1), args.max_tokens, args.k)
    attention = "the paged kernel" if args.paged_attention and args.device != "cpu" else "gather + SDPA"
    md = (f"Machine: {machine(args.device)}, dtype {args.dtype}, target attention: {attention}; "
          f"{args.max_tokens} greedy tokens per request from held-out prompts.\n\n" + table(rows, baseline)
          + "\n\nWhere an engine step's time went (ms per step that ran rows; the engine's own phase timings; "
          "propose is the draft, verify the target's pass and acceptance):\n\n" + phase_table(rows))
    print("\n" + md)
    name = "spec-cuda" + ("-paged" if args.paged_attention else "") if args.device != "cpu" else "spec"
    save(name, rows, md, args.device)


if __name__ == "__main__":
    main()

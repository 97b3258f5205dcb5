"""What speculation can buy on this machine: draft pass, verify pass and acceptance, measured, and the formula.

    .venv/bin/python bench/spec_costs.py                     # shipped pair, batches 1 8 32, 1 torch thread
    .venv/bin/python bench/spec_costs.py --batches 1 --rounds 3 --threads 2

For each batch size, one in-process engine per static k (0 .. --max-k; adaptive
speculation off, unpipelined, so a step is the draft's proposal and then one
target pass) decodes the same held-out prompts greedily; the k's runs are
interleaved round by round, best round counted. From the engine's step timings
it takes, per k, the draft's proposal time D_k, the target pass V_k (k + 1
tokens per row; V_0 is the plain one-token decode step) and the engine's own
time O_k (scheduling and commit), and from the requests' speculation summaries
the acceptance by position (P(the first i drafts of a step all accepted), i = 1..k).
Batch 1 decodes --min-requests prompts one after another. Then, for a step of b rows:

    E_k = 1 + sum_{i=1..k} P(the first i drafts of a step all accepted)   tokens per row per step
    tok/s_k = b * E_k / (D_k + V_k + O_k)          speed-up_k = tok/s_k / tok/s_0

The table prints the measured tok/s beside the formula's (they agree when the
timings explain the run) and, for the best k, what the draft would have to cost
per token it drafts (at the measured acceptance), or how many tokens per step
it would have to get accepted (at the measured cost), for speculation to buy
--goal (issue 18: 1.8x at batch 1).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field

import torch

from common import DRAFT, OUT_DIR, TARGET, load_prompts, machine
from dspark_ray.engine import EngineConfig, SamplingParams
from dspark_ray.engine.local import build_local_engine


@dataclass
class Run:
    k: int
    tokens: int = 0
    seconds: float = 0.0
    draft: list[float] = field(default_factory=list)  # per steady step, seconds
    verify: list[float] = field(default_factory=list)
    own: list[float] = field(default_factory=list)  # schedule + commit
    proposed: int = 0  # steps that drafted (per row)
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds

    @staticmethod
    def median(xs: list[float]) -> float:
        return statistics.median(xs) if xs else 0.0

    @property
    def expected(self) -> float:
        """E_k: tokens per row per step, from the acceptance by position."""
        if not self.k or not self.proposed:
            return 1.0
        return 1.0 + sum(a / self.proposed for a in self.accepted_per_position[:self.k])


def decode(engine, batches: list[list[str]], max_tokens: int, k: int) -> Run:
    """Each batch decoded to the end, one after another; the steady steps' timings (every row past
    its prompt)."""
    run = Run(k)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    outputs = {}
    for prompts in batches:
        for p in prompts:
            engine.add_request(p, params)
        start = time.perf_counter()
        first = True
        while engine.has_unfinished():
            for o in engine.step():
                outputs[o.req_id] = o
            t = engine.timings
            if not first and t.rows == len(prompts):
                run.draft.append(t.propose)
                run.verify.append(t.verify)
                run.own.append(t.schedule + t.commit)
            first = False
        run.seconds += time.perf_counter() - start
    for o in outputs.values():
        run.tokens += o.num_output_tokens
        if o.spec is not None and o.spec.drafts:
            run.proposed += o.spec.drafts
            pos = o.spec.accepted_per_position
            if len(run.accepted_per_position) < len(pos):
                run.accepted_per_position += [0] * (len(pos) - len(run.accepted_per_position))
            for i, a in enumerate(pos):
                run.accepted_per_position[i] += a
    return run


def engine_for(k: int):
    cfg = EngineConfig(model=str(TARGET), draft=str(DRAFT) if k else None, num_speculative_tokens=max(k, 1),
                       adaptive_speculation=False, pipeline=False, max_context=512, enable_prefix_caching=False)
    return build_local_engine(cfg)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--max-k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds; the best counts")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a served worker has 1)")
    ap.add_argument("--min-requests", type=int, default=8,
                    help="requests per measurement: a smaller batch runs several batches in turn (default 8)")
    ap.add_argument("--goal", type=float, default=1.8, help="the speed-up asked for at batch 1")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ks = list(range(args.max_k + 1))
    engines = {k: engine_for(k) for k in ks}
    lines = [f"# Speculation's costs ({machine()}; shipped pair, greedy, "
             f"{args.max_tokens} tokens, best of {args.rounds} interleaved rounds)", ""]
    for b in args.batches:
        n = max(1, args.min_requests // b)  # batch 1: several prompts, one after another
        prompts = load_prompts(b * n)
        batches = [prompts[i * b:(i + 1) * b] for i in range(n)]
        for k in ks:
            decode(engines[k], batches[:1], 8, k)  # warm-up
        best: dict[int, Run] = {}
        for _ in range(args.rounds):
            for k in ks:
                r = decode(engines[k], batches, args.max_tokens, k)
                if k not in best or r.tok_s > best[k].tok_s:
                    best[k] = r
        base = best[0]
        v0 = base.median(base.verify) + base.median(base.draft)
        lines += [f"## batch {b}", "",
                  "| k | D_k draft ms | V_k target ms | V_k / V_0 | O_k engine ms | P(first i accepted), i = 1..k "
                  "| E_k tokens/step | tok/s measured | tok/s formula | speed-up measured | speed-up formula |",
                  "|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
        for k in ks:
            r = best[k]
            d, v, o = r.median(r.draft), r.median(r.verify), r.median(r.own)
            formula = b * r.expected / (d + v + o)
            rates = " / ".join(f"{a / r.proposed:.2f}" for a in r.accepted_per_position[:k]) if r.proposed else "-"
            lines.append(f"| {k} | {d * 1e3:.2f} | {v * 1e3:.2f} | {v / v0:.2f} | {o * 1e3:.2f} | {rates} "
                         f"| {r.expected:.2f} | {r.tok_s:.1f} | {formula:.1f} | {r.tok_s / base.tok_s:.2f}x "
                         f"| {formula / (b * 1.0 / (v0 + base.median(base.own))):.2f}x |")
        k_best = max(ks[1:], key=lambda k: best[k].tok_s) if len(ks) > 1 else 0
        if k_best and b == 1:
            r = best[k_best]
            d, v, o = r.median(r.draft), r.median(r.verify), r.median(r.own)
            step0 = v0 + base.median(base.own)
            # goal = E * step0 / (D + V + O): the draft budget at this acceptance, the acceptance at this cost
            budget = r.expected * step0 / args.goal - v - o
            needed = args.goal * (d + v + o) / step0
            lines += ["", f"For {args.goal}x at batch 1 with k = {k_best}: at the measured acceptance "
                      f"(E = {r.expected:.2f}) the draft may cost {max(budget, 0) * 1e3:.2f} ms per proposal "
                      f"({max(budget, 0) / k_best * 1e3:.2f} ms per drafted token; it costs {d * 1e3:.2f} ms, "
                      f"{d / k_best * 1e3:.2f} per token); at the measured cost it would need E = {needed:.2f} "
                      f"tokens per step (at most {k_best + 1})."]
        lines.append("")
    text = "\n".join(lines)
    print(text)
    OUT_DIR.mkdir(exist_ok=True)
    (OUT_DIR / "spec_costs.md").write_text(text)


if __name__ == "__main__":
    main()

"""What structured outputs cost: JSON-schema-constrained requests against unconstrained ones, side by side.

    .venv/bin/python bench/structured.py                  # batch 1 and 8, speculation on and off
    .venv/bin/python bench/structured.py --batches 1 8 32 --rounds 3

The in-process engine (the shipped pair, k=4, one torch thread unless
--threads) runs, at each batch size b, b requests at once, --rounds times,
for each of four cases, interleaved round by round so that the machine's
drift hits every case alike:

    free / spec       unconstrained, greedy, exactly --max-tokens tokens (ignore_eos), speculation on
    free / nospec     the same without speculation
    json / spec       a JSON schema (nested object, enums, a bounded array, required fields), greedy;
                      the request ends when the grammar is complete
    json / nospec     the same without speculation

Figures per case: output tokens/s, engine steps, mean acceptance length, and
for the constrained cases what the grammar cost per engine step: the
engine's masks (walking each row's drafts, ``Engine._grammar_masks``) and the
draft proposer's (sync to the committed output, a mask before each draft
token, ``DraftProposer._sync_grammars``/``_mask``/``_advance``), in ms per
step and as a share of the step. Ratios: json / free at the same batch and
speculation setting. The mask runs on the engine's thread before the target
call (and on the draft worker's before each draft pass); llguidance's masks
take tens of microseconds per row on this vocabulary, so the share stays
small. Results go to bench/out/structured.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import BENCH_DIR, DRAFT, TARGET, load_prompts, machine  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "speaker": {"type": "object",
                    "properties": {"role": {"enum": ["king", "fool", "queen", "ghost"]},
                                   "name": {"type": "string", "maxLength": 16},
                                   "lines": {"type": "integer", "minimum": 0, "maximum": 999}},
                    "required": ["role", "name", "lines"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"enum": ["comedy", "tragedy", "history"]}, "minItems": 1,
                 "maxItems": 3},
        "quote": {"type": "string", "maxLength": 48},
    },
    "required": ["speaker", "tags", "quote"], "additionalProperties": False,
}
CASES = [("free", True), ("free", False), ("json", True), ("json", False)]


class Timer:
    """Wraps a method of an object and adds up the seconds spent in it."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, obj, name: str) -> None:
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t

        setattr(obj, name, timed)


@dataclass
class Row:
    case: str
    spec: bool
    batch: int
    requests: int
    output_tokens: int
    seconds: float
    steps: int
    tok_s: float
    acceptance_length: float | None
    engine_mask_ms_per_step: float | None
    draft_mask_ms_per_step: float | None
    mask_share: float | None  # (engine + draft mask time) / step time
    valid: int  # constrained outputs that parsed (all, or the benchmark is broken)


def build(args, spec: bool):
    from dspark_ray.engine.config import EngineConfig
    from dspark_ray.engine.local import build_local_engine

    cfg = EngineConfig(model=str(args.model), draft=str(args.draft) if spec else None, num_speculative_tokens=args.k,
                       capacity=max(64, *args.batches), max_num_seqs=max(64, *args.batches), max_context=512)
    engine = build_local_engine(cfg)
    engine_timer, draft_timer = Timer(), Timer()
    engine_timer.wrap(engine, "_grammar_masks")
    if engine.draft is not None:
        for name in ("_sync_grammars", "_mask", "_advance"):
            draft_timer.wrap(engine.draft, name)
    return engine, engine_timer, draft_timer


def params_of(case: str, args):
    from dspark_ray.engine import SamplingParams
    from dspark_ray.engine.structured import StructuredOutput

    if case == "free":
        return SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    return SamplingParams(max_tokens=4 * args.max_tokens, structured=StructuredOutput.json_schema(SCHEMA))


def run_round(engine, prompts, params) -> tuple[int, float, int, list[str], int, int]:
    """(output tokens, seconds, steps, texts, drafts, accepted) for one batch run to completion."""
    steps0 = engine.counters.steps
    ids = [engine.add_request(p, params) for p in prompts]
    texts, tokens, drafts, accepted = {i: "" for i in ids}, 0, 0, 0
    start = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            texts[out.req_id] += out.new_text
            tokens += len(out.new_token_ids)
            if out.finished and out.spec is not None:
                drafts += out.spec.drafts
                accepted += out.spec.accepted_tokens
    return tokens, time.perf_counter() - start, engine.counters.steps - steps0, [texts[i] for i in ids], drafts, accepted


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=TARGET)
    ap.add_argument("--draft", type=Path, default=DRAFT)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=3, help="rounds per case and batch (after one warm-up)")
    ap.add_argument("--max-tokens", type=int, default=48, help="unconstrained output length")
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--name", default="structured")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    engines = {spec: build(args, spec) for spec in (True, False)}
    acc: dict = defaultdict(lambda: defaultdict(float))
    rows = []
    for b in args.batches:
        prompts = load_prompts(b * (args.rounds + 1))
        for case, spec in CASES:  # warm-up
            run_round(engines[spec][0], prompts[:b], params_of(case, args))
        for r in range(args.rounds):
            batch = prompts[(r + 1) * b:(r + 2) * b]
            for case, spec in CASES:
                engine, et, dt = engines[spec]
                e0, d0 = et.seconds, dt.seconds
                tokens, seconds, steps, texts, drafts, accepted = run_round(engine, batch, params_of(case, args))
                a = acc[(case, spec, b)]
                a["tokens"] += tokens
                a["seconds"] += seconds
                a["steps"] += steps
                a["drafts"] += drafts
                a["accepted"] += accepted
                a["requests"] += len(batch)
                a["engine_mask"] += et.seconds - e0
                a["draft_mask"] += dt.seconds - d0
                if case == "json":
                    a["valid"] += sum(_valid(t) for t in texts)
        for case, spec in CASES:
            a = acc[(case, spec, b)]
            steps = max(1.0, a["steps"])
            constrained = case == "json"
            mask = (a["engine_mask"] + a["draft_mask"]) if constrained else None
            rows.append(Row(
                case=case, spec=spec, batch=b, requests=int(a["requests"]), output_tokens=int(a["tokens"]),
                seconds=round(a["seconds"], 3), steps=int(a["steps"]), tok_s=round(a["tokens"] / a["seconds"], 1),
                acceptance_length=round(1 + a["accepted"] / a["drafts"], 2) if a["drafts"] else None,
                engine_mask_ms_per_step=round(1e3 * a["engine_mask"] / steps, 3) if constrained else None,
                draft_mask_ms_per_step=round(1e3 * a["draft_mask"] / steps, 3) if constrained and spec else None,
                mask_share=round(mask / a["seconds"], 3) if constrained else None,
                valid=int(a["valid"]) if constrained else 0,
            ))
        print_rows([r for r in rows if r.batch == b])
    save(rows, args)


def _valid(text: str) -> int:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), SCHEMA)
        return 1
    except (ValueError, jsonschema.ValidationError):
        return 0


def table(rows: list[Row]) -> list[str]:
    free = {(r.spec, r.batch): r.tok_s for r in rows if r.case == "free"}
    lines = ["| batch | case | speculation | tok/s | json / free | steps | acceptance length | engine mask ms/step "
             "| draft mask ms/step | mask share of time | valid JSON |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        ratio = f"{r.tok_s / free[(r.spec, r.batch)]:.2f}x" if r.case == "json" else ""
        f = lambda v, fmt="{:.3f}": "" if v is None else fmt.format(v)  # noqa: E731
        lines.append(f"| {r.batch} | {r.case} | {'on' if r.spec else 'off'} | {r.tok_s:.1f} | {ratio} | {r.steps} | "
                     f"{f(r.acceptance_length, '{:.2f}')} | {f(r.engine_mask_ms_per_step)} | "
                     f"{f(r.draft_mask_ms_per_step)} | {f(r.mask_share, '{:.1%}')} | "
                     f"{f'{r.valid}/{r.requests}' if r.case == 'json' else ''} |")
    return lines


def print_rows(rows: list[Row]) -> None:
    print("\n".join(table(rows)), flush=True)


def save(rows: list[Row], args) -> None:
    out = BENCH_DIR / "out"
    out.mkdir(exist_ok=True)
    m = machine()
    cmd = "python bench/structured.py " + " ".join(sys.argv[1:])
    md = [f"# Structured outputs: constrained against unconstrained ({time.strftime('%Y-%m-%d %H:%M')})", "",
          f"`{cmd}` on {m}; k={args.k}, rounds {args.rounds}.", "", *table(rows), ""]
    (out / f"{args.name}.md").write_text("\n".join(md))
    (out / f"{args.name}.json").write_text(json.dumps({"machine": m, "rows": [asdict(r) for r in rows]}, indent=2))
    print(f"wrote bench/out/{args.name}.md", flush=True)


if __name__ == "__main__":
    main()

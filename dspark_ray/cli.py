"""The `dspark` command line.

    dspark generate "ROMEO:" --max-tokens 64          # offline, shipped pair by default
    dspark generate "ROMEO:" --no-draft               # the target alone
"""

from __future__ import annotations

import argparse
import sys
import time

from dspark_ray.serve.config import REPO_ROOT

DEFAULT_TARGET = str(REPO_ROOT / "models" / "shakespeare-target")
DEFAULT_DRAFT = str(REPO_ROOT / "models" / "shakespeare-draft")


def _generate(args: argparse.Namespace) -> int:
    from dspark_ray import LLM, SamplingParams

    llm = LLM(args.model, None if args.no_draft else args.draft, num_speculative_tokens=args.k,
              max_context=args.max_context, device=args.device)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    start = time.perf_counter()
    outs = llm.generate(args.prompts, params)
    elapsed = time.perf_counter() - start
    for out in outs:
        print(out.text if args.quiet else f"--- {out.req_id} ({out.finish_reason})\n{out.text}")
    if not args.quiet:
        n = sum(len(o.token_ids) for o in outs)
        spec = outs[0].spec
        acc = f", mean acceptance length {spec.mean_acceptance_length:.2f}" if spec and spec.drafts else ""
        print(f"--- {n} tokens in {elapsed:.2f}s ({n / elapsed:.1f} tok/s){acc}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dspark", description="dspark_ray: speculative-decoding serving on Ray")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate offline (no Ray, no Serve)")
    gen.add_argument("prompts", nargs="+", help="one or more prompts")
    gen.add_argument("--model", default=DEFAULT_TARGET, help="target checkpoint folder")
    gen.add_argument("--draft", default=DEFAULT_DRAFT, help="draft checkpoint folder")
    gen.add_argument("--no-draft", action="store_true", help="run the target alone")
    gen.add_argument("-k", type=int, default=4, help="speculative tokens per step")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--max-context", type=int, default=512)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--device", default="cpu")
    gen.add_argument("-q", "--quiet", action="store_true", help="print only the generated text")
    gen.set_defaults(func=_generate)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())

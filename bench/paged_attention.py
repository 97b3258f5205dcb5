"""The target's attention for one layer: the Triton paged kernel vs gather + SDPA, side by side.

Both columns run ``PackedAttention`` exactly as the target runner builds it
for a decode step (every row the same length: its whole-batch path), so each
includes writing the step's new K/V into the pool: ``gathered`` copies each
row's K/V out through the request-to-token table and calls SDPA with the
engine's pinned CUDA backends and bucketed key length; ``paged`` reads the
pool in place with ``dspark_kernels.paged_attention`` (split-K by its
heuristic). Rows own scattered pool tokens, as after many allocations.

    python bench/paged_attention.py                        # Llama-3-8B heads: 32/8 x 128, bf16
    python bench/paged_attention.py --num-heads 4 --kv-heads 2 --head-dim 64   # the shipped target

Grid: batch 1/8/32/64 x context 512/2048 x T = 1 (decode) and T = 5
(verifying k = 4 drafts). Timings are medians of ``triton.testing.do_bench``.
Issue 20's target: paged >= 2x gathered at batch 32, context 2048.
Without CUDA the script says so and times only the gathered path (the
reference semantics, what CPUs run) at the shipped target's heads.
Exit status 1 if the two paths disagree anywhere.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time

import torch
from torch.nn.attention import sdpa_kernel

from dspark_ray.engine.attention_group import AttentionGroup
from dspark_ray.engine.target_runner import CUDA_ATTENTION_BACKENDS, KEY_BUCKET, PackedAttention

BATCHES = (1, 8, 32, 64)
CONTEXTS = (512, 2048)
STEPS = (1, 5)


def decode_step(batch: int, context: int, steps: int, num_heads: int, kv_heads: int, head_dim: int,
                dtype: torch.dtype, device: str, bucket: int) -> tuple[PackedAttention, PackedAttention, tuple]:
    """One layer's pools and a decode step whose rows hold ``context`` keys (the last ``steps`` new),
    as PackedAttention (gathered, paged) plus its (layer, q, k, v) arguments."""
    gen = torch.Generator(device=device).manual_seed(batch * context + steps)
    pool_tokens = 1 + batch * context
    k_pool = torch.randn((pool_tokens, kv_heads, head_dim), generator=gen, device=device).to(dtype)
    v_pool = torch.randn((pool_tokens, kv_heads, head_dim), generator=gen, device=device).to(dtype)
    table = torch.zeros((batch + 1, context), dtype=torch.int32, device=device)  # row 0: padding
    table[1:] = (torch.randperm(pool_tokens - 1, generator=gen, device=device) + 1).view(batch, context).int()
    L = min(-(-context // bucket) * bucket, context)
    key_index = table[1:, :L].long()  # [B, L], as TargetRunner._group takes it
    positions = context - steps + torch.arange(steps, device=device)  # [T], the same for every row
    mask = (torch.arange(L, device=device) <= positions[:, None])[None, None].expand(batch, 1, steps, L)
    queries = torch.arange(batch * steps, device=device).view(batch, steps)
    group = AttentionGroup(queries, torch.ones_like(queries, dtype=torch.bool), key_index, mask.contiguous(),
                           whole=True)
    write_index = key_index[:, context - steps:].reshape(-1)  # [N] the new tokens' pool slots
    q = torch.randn((1, batch * steps, num_heads, head_dim), generator=gen, device=device).to(dtype)
    k = torch.randn((1, batch * steps, kv_heads, head_dim), generator=gen, device=device).to(dtype)
    v = torch.randn((1, batch * steps, kv_heads, head_dim), generator=gen, device=device).to(dtype)
    gathered = PackedAttention([k_pool], [v_pool], write_index, [group], paged=False)
    paged = PackedAttention([k_pool], [v_pool], write_index, [group], paged=True)
    return gathered, paged, (0, q, k, v)


def _time_ms(fn, device: str) -> float:
    if device == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-heads", type=int, default=None, help="default 32 on CUDA, 4 on CPU")
    parser.add_argument("--kv-heads", type=int, default=None, help="default 8 on CUDA, 2 on CPU")
    parser.add_argument("--head-dim", type=int, default=None, help="default 128 on CUDA, 64 on CPU")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                        help="default bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS))
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    num_heads = args.num_heads or (32 if cuda else 4)
    kv_heads = args.kv_heads or (8 if cuda else 2)
    head_dim = args.head_dim or (128 if cuda else 64)
    dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    if cuda:
        print(f"device: {torch.cuda.get_device_name()}; heads {num_heads}/{kv_heads} x {head_dim}, {dtype}; "
              "one layer, medians")
        print(f"{'batch':>5} {'context':>7} {'T':>2} {'gathered us':>12} {'paged us':>9} {'ratio':>6}  max err")
    else:
        print("no CUDA device: timing only the gathered path (gather + SDPA, the reference and CPU path); "
              "the paged kernel needs a GPU")
        print(f"heads {num_heads}/{kv_heads} x {head_dim}, {dtype}, one layer, {torch.get_num_threads()} threads")
        print(f"{'batch':>5} {'context':>7} {'T':>2} {'gathered us':>12}")
    failures = 0
    for batch in args.batches:
        for context in args.contexts:
            for steps in STEPS:
                gathered, paged, call = decode_step(batch, context, steps, num_heads, kv_heads, head_dim, dtype,
                                                    device, KEY_BUCKET if cuda else 1)
                backends = sdpa_kernel(CUDA_ATTENTION_BACKENDS) if cuda else contextlib.nullcontext()
                with backends, torch.inference_mode():
                    want = gathered(*call)
                    gathered_ms = _time_ms(lambda: gathered(*call), device)
                line = f"{batch:5d} {context:7d} {steps:2d} {gathered_ms * 1e3:12.1f}"
                if cuda:
                    with torch.inference_mode():
                        got = paged(*call)
                        paged_ms = _time_ms(lambda: paged(*call), device)
                    error = float((got.float() - want.float()).abs().max())
                    agrees = error <= (1e-4 if dtype == torch.float32 else 3e-2)
                    failures += not agrees
                    line += (f" {paged_ms * 1e3:9.1f} {gathered_ms / paged_ms:6.2f}x  {error:.1e}"
                             f"{'' if agrees else '  FAIL'}")
                print(line, flush=True)
                del gathered, paged, call
    if cuda:
        print(f"{failures} disagreement(s)" if failures else "the paged kernel agrees with gather + SDPA")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

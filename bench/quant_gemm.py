"""The GGUF block matmul (dspark_kernels/quant.py) against float32 and bfloat16 matmuls, on CPU.

For SmolLM2-135M's linear shapes (blocks Q4_1, the tied LM head Q8_0) at 1 to 32 rows, side by
side in one run, on 1 and 2 threads (``--threads``):

- ``q f32 xT``:  ``QuantGemm`` — the blocks decoded in registers, float32 products and sums, on T
  threads (``quant.set_threads``);
- ``q int8 xT``: ``QuantGemm(int8=True)`` — x rounded to int8 per 32-block (llama.cpp's scheme; AVX512-VNNI or AVX2);
- ``f32 xT``:    ``F.linear`` on the dequantized float32 weight (MKL), ``torch.set_num_threads(T)``;
- ``bf16``:      ``dspark_kernels.cpu.Bf16Gemm``, the bfloat16 copy the float32 model uses today
  (one thread: it has no pool).

Weights are cold, as in a decode step that streams ~96 MB of blocks through a 32 MB L3: each
method cycles through enough copies of its weight to pass 96 MB a round, so every call reads its
weight from memory. Rounds are interleaved (every column once a round, in turn), so that load from
other processes falls on all columns alike; a cell is the best round: microseconds a call (Python
call included) and GB/s of that method's own weight bytes (the box reads ~31-35 GB/s).

``--step`` times the model's 211 linears themselves, one after another as a decode step calls
them (30 layers of q, k, v, o, gate, up, down, then the LM head: ~96 MB of blocks, so nothing is
in cache from one step to the next), rather than summing the per-shape cells; ``--fused`` with
q/k/v and gate/up fused (``QuantWeight.cat_rows``): 121 calls.

    python bench/quant_gemm.py                         # all shapes, M = 1, 2, 4, 8, 16, 32
    python bench/quant_gemm.py --rows 1 --rounds 9 --threads 1 2
    python bench/quant_gemm.py --step --rows 1 8 32
    python bench/quant_gemm.py --step --fused
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from dspark_kernels import cpu, quant

SHAPES = (  # name, in_features, out_features, GGML type, linears of this shape in the model
    ("q/o 576->576", 576, 576, quant.Q4_1, 60),
    ("k/v 576->192", 576, 192, quant.Q4_1, 60),
    ("gate/up 576->1536", 576, 1536, quant.Q4_1, 60),
    ("down 1536->576", 1536, 576, quant.Q4_1, 30),
    ("lm_head 576->49152", 576, 49152, quant.Q8_0, 1),
)
LAYER = ((576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536), (1536, 576))  # (K, N) in call order
FUSED_LAYER = ((576, 960), (576, 576), (576, 3072), (1536, 576))  # q/k/v and gate/up each one weight (cat_rows)
LAYERS, LM_HEAD = 30, (576, 49152)
ROWS = (1, 2, 4, 8, 16, 32)
COLD_BYTES = 96 << 20  # bytes of copies a round reads, so that no call finds its weight in cache


@dataclass
class Column:
    """One method on one thread count: its weight's bytes and one callable (x -> y) per cold copy."""

    label: str
    threads: int
    nbytes: int
    fns: list[Callable]

    def enter(self) -> None:
        quant.set_threads(self.threads)
        torch.set_num_threads(self.threads)


def copies(nbytes: int) -> int:
    return max(2, -(-COLD_BYTES // nbytes))


def time_columns(columns: list[Column], x: torch.Tensor, rounds: int) -> list[float]:
    """Per column, the best over interleaved rounds of the mean seconds a call."""
    best = [float("inf")] * len(columns)
    for _ in range(rounds):
        for i, col in enumerate(columns):
            col.enter()
            col.fns[-1](x)  # workers started and awake, as in a step
            start = time.perf_counter()
            for fn in col.fns:
                fn(x)
            best[i] = min(best[i], (time.perf_counter() - start) / len(col.fns))
    return best


def columns(k: int, n: int, qtype: int, threads: list[int], g: torch.Generator) -> list[Column]:
    weight = quant.QuantWeight(quant.random_blocks(qtype, (n, k), g), qtype, (n, k))
    dense = weight.dequantize()
    qcopies = [quant.QuantWeight(weight.blocks.clone(), qtype, (n, k)) for _ in range(copies(weight.nbytes))]
    out = [Column(f"q f32 x{t}", t, weight.nbytes, [quant.QuantGemm(w) for w in qcopies]) for t in threads]
    if qtype in quant.INT8_TYPES:
        out += [Column(f"q int8 x{t}", t, weight.nbytes, [quant.QuantGemm(w, int8=True) for w in qcopies])
                for t in threads]
    dense_fns = [functools.partial(F.linear, weight=dense.clone()) for _ in range(copies(dense.numel() * 4))]
    out += [Column(f"f32 x{t}", t, dense.numel() * 4, dense_fns) for t in threads]
    bf16 = dense.to(torch.bfloat16).float()  # bfloat16 values, as Bf16Gemm takes
    out.append(Column("bf16", 1, dense.numel() * 2, [cpu.Bf16Gemm(bf16) for _ in range(copies(dense.numel() * 2))]))
    return out


def per_shape(args: argparse.Namespace, g: torch.Generator) -> None:
    totals: dict[tuple[str, int], float] = {}  # (label, rows) -> seconds of all the model's linears
    labels: list[str] = []
    for name, k, n, qtype, count in SHAPES:
        if args.shapes and not any(name.startswith(p) for p in args.shapes):
            continue
        table = columns(k, n, qtype, args.threads, g)
        labels += [c.label for c in table if c.label not in labels]
        print(f"\n{name} {quant.FORMATS[qtype].name} ({table[0].nbytes / 1e6:.2f} MB of blocks)")
        print(f"{'M':>4} " + "".join(f"{c.label:>17}" for c in table))
        for rows in args.rows:
            x = torch.randn(rows, k, generator=g)
            seconds = time_columns(table, x, args.rounds)
            for col, s in zip(table, seconds):
                totals[(col.label, rows)] = totals.get((col.label, rows), 0.0) + s * count
            print(f"{rows:>4} " + "".join(f"{s * 1e6:8.1f} ({c.nbytes / s / 1e9:5.1f})" for c, s in zip(table, seconds)))
    if not args.shapes:
        print("\nthe model's 211 linears, one step (ms; sum of the cells above times each shape's count)")
        print(f"{'M':>4} " + "".join(f"{label:>12}" for label in labels))
        for rows in args.rows:
            print(f"{rows:>4} " + "".join(f"{totals[(label, rows)] * 1e3:12.2f}" for label in labels))


def step(args: argparse.Namespace, g: torch.Generator) -> None:
    """The linears in a decode step's order, each its own weight (~96 MB of blocks)."""
    shapes = [kn for _ in range(LAYERS) for kn in (FUSED_LAYER if args.fused else LAYER)] + [LM_HEAD]
    weights = [quant.QuantWeight(quant.random_blocks(qt, (n, k), g), qt, (n, k))
               for k, n in shapes for qt in [quant.Q8_0 if (k, n) == LM_HEAD else quant.Q4_1]]
    mb = sum(w.nbytes for w in weights) / 1e6
    cols = [(f"q {path} x{t}", t, [quant.QuantGemm(w, int8=path == "int8") for w in weights])
            for path in ("f32", "int8") for t in args.threads]
    print(f"\nthe model's {len(weights)} linears called in order ({mb:.1f} MB of blocks): ms a step (GB/s)")
    print(f"{'M':>4} " + "".join(f"{label:>17}" for label, _, _ in cols))
    for rows in args.rows:
        xs = {k: torch.randn(rows, k, generator=g) for k in (576, 1536)}
        best = [float("inf")] * len(cols)
        for _ in range(args.rounds):
            for i, (_, t, gemms) in enumerate(cols):
                quant.set_threads(t)
                gemms[0](xs[576])
                start = time.perf_counter()
                for gemm in gemms:
                    gemm(xs[gemm.in_features])
                best[i] = min(best[i], time.perf_counter() - start)
        print(f"{rows:>4} " + "".join(f"{s * 1e3:8.2f} ({mb / 1e3 / s:5.1f})" for s in best))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="*", default=list(ROWS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, nargs="*", default=[1, 2], help="thread counts to compare")
    parser.add_argument("--shapes", type=str, nargs="*", default=None, help="name prefixes, e.g. lm_head")
    parser.add_argument("--step", action="store_true", help="time the 211 linears in a step's order instead")
    parser.add_argument("--fused", action="store_true", help="with --step: q/k/v and gate/up fused (121 calls)")
    args = parser.parse_args()
    if quant._library() is None:
        raise SystemExit("the CPU kernels are not built here (no C compiler?)")
    g = torch.Generator().manual_seed(0)
    print(f"int8 path on: {quant.int8_isa()}; {os.cpu_count()} CPUs; load average at start "
          f"{os.getloadavg()[0]:.2f}; us a call (GB/s of that method's weight bytes)")
    if args.step:
        step(args, g)
    else:
        per_shape(args, g)
    print(f"\nload average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()

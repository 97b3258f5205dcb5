"""The GGUF block matmul (dspark_kernels/quant.py) against float32 and bfloat16 matmuls, on CPU.

For SmolLM2-135M's linear shapes (blocks Q4_1, the tied LM head Q8_0) at 1 to 32 rows, side by
side in one run, each on one thread:

- ``q f32``:  ``QuantGemm`` — the blocks decoded in registers, float32 products and sums;
- ``q int8``: ``QuantGemm(int8=True)`` — x rounded to int8 per 32-block (llama.cpp's scheme, VNNI);
- ``f32``:    ``F.linear`` on the dequantized float32 weight (MKL);
- ``bf16``:   ``dspark_kernels.cpu.Bf16Gemm``, the bfloat16 copy the float32 model uses today.

Weights are cold, as in a decode step that streams ~96 MB of blocks through a 32 MB L3: each
method cycles through enough copies of its weight to pass 96 MB a round, so every call reads its
weight from memory. A cell is microseconds a call (best of ``--rounds`` rounds, Python call
included) and GB/s of that method's own weight bytes (the box reads ~31-35 GB/s).

    python bench/quant_gemm.py                  # all shapes, M = 1, 2, 4, 8, 16, 32
    python bench/quant_gemm.py --rows 1 --rounds 9
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

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
ROWS = (1, 2, 4, 8, 16, 32)
COLD_BYTES = 96 << 20  # bytes of copies a round reads, so that no call finds its weight in cache


def copies(nbytes: int) -> int:
    return max(2, -(-COLD_BYTES // nbytes))


def time_call(fns: list[Callable[[], object]], rounds: int) -> float:
    """Best over rounds of the mean seconds a call, each round calling every fn once."""
    for fn in fns:
        fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for fn in fns:
            fn()
        best = min(best, (time.perf_counter() - start) / len(fns))
    return best


def methods(k: int, n: int, qtype: int, g: torch.Generator) -> dict[str, tuple[int, list]]:
    """Per method: its weight's bytes, and one callable (x -> y) per cold copy."""
    weight = quant.QuantWeight(quant.random_blocks(qtype, (n, k), g), qtype, (n, k))
    dense = weight.dequantize()
    bf16 = dense.to(torch.bfloat16).float()  # bfloat16 values, as Bf16Gemm takes
    out: dict[str, tuple[int, list]] = {}
    qcopies = [quant.QuantWeight(weight.blocks.clone(), qtype, (n, k)) for _ in range(copies(weight.nbytes))]
    out["q f32"] = (weight.nbytes, [quant.QuantGemm(w) for w in qcopies])
    if qtype in quant.INT8_TYPES:
        out["q int8"] = (weight.nbytes, [quant.QuantGemm(w, int8=True) for w in qcopies])
    out["f32"] = (dense.numel() * 4, [functools.partial(F.linear, weight=dense.clone())
                                      for _ in range(copies(dense.numel() * 4))])
    out["bf16"] = (dense.numel() * 2, [cpu.Bf16Gemm(bf16) for _ in range(copies(dense.numel() * 2))])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="*", default=list(ROWS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--shapes", type=str, nargs="*", default=None, help="name prefixes, e.g. lm_head")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if quant._library() is None:
        raise SystemExit("the CPU kernels are not built here (no C compiler?)")
    g = torch.Generator().manual_seed(0)
    print(f"one thread; int8 path on VNNI: {quant.int8_native()}; us a call (GB/s of that method's weight bytes)")
    totals: dict[tuple[str, int], float] = {}  # (method, rows) -> seconds of all the model's linears
    for name, k, n, qtype, count in SHAPES:
        if args.shapes and not any(name.startswith(p) for p in args.shapes):
            continue
        table = methods(k, n, qtype, g)
        header = f"{name} {quant.FORMATS[qtype].name} ({table['q f32'][0] / 1e6:.2f} MB of blocks)"
        print(f"\n{header}\n{'M':>4} " + "".join(f"{m:>18}" for m in table))
        for rows in args.rows:
            x = torch.randn(rows, k, generator=g)
            cells = []
            for label, (nbytes, fns) in table.items():
                seconds = time_call([functools.partial(f, x) for f in fns], args.rounds)
                totals[(label, rows)] = totals.get((label, rows), 0.0) + seconds * count
                cells.append(f"{seconds * 1e6:9.1f} ({nbytes / seconds / 1e9:5.1f})")
            print(f"{rows:>4} " + "".join(f"{c:>18}" for c in cells))
    if not args.shapes:
        labels = sorted({label for label, _ in totals}, key=list(table).index)
        print("\nthe model's 211 linears, one step (ms; sum of the cells above times each shape's count)")
        print(f"{'M':>4} " + "".join(f"{label:>18}" for label in labels))
        for rows in args.rows:
            print(f"{rows:>4} " + "".join(f"{totals[(label, rows)] * 1e3:18.2f}" for label in labels))


if __name__ == "__main__":
    main()

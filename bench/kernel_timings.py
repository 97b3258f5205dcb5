"""Triton kernels vs their PyTorch references: agreement, then timings.

On a CUDA machine every kernel is compiled and, at serving shapes (batch
1..64, k = 4 speculative tokens, window 32..256, vocabulary 32k..152k),
checked against its reference and timed against it (median of
`triton.testing.do_bench`, which flushes L2 between runs). Without CUDA the
script says so and runs the same comparisons at tiny shapes through Triton's
interpreter, without timings (interpreted times mean nothing).

    python bench/kernel_timings.py                      # everything
    python bench/kernel_timings.py --kernel rejection   # one kernel
    python bench/kernel_timings.py --head-dim 128 --kv-heads 8 --num-heads 32

Exit status 1 if any comparison disagrees.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

KERNELS = ("ring_write", "window_attention", "rejection", "markov")
SPEC_TOKENS = 4  # k: drafts per step, so k + 1 query positions
BATCHES = (1, 8, 32, 64)
WINDOWS = (32, 128, 256)
VOCABS = (32_000, 151_936)


@dataclass(frozen=True)
class Result:
    kernel: str
    shape: str
    agrees: bool
    detail: str  # how agreement was measured
    triton_ms: float | None = None
    reference_ms: float | None = None

    def line(self) -> str:
        verdict = "ok  " if self.agrees else "FAIL"
        timing = ""
        if self.triton_ms is not None and self.reference_ms is not None:
            speedup = self.reference_ms / self.triton_ms
            timing = (
                f"  triton {self.triton_ms * 1e3:9.1f} us  reference "
                f"{self.reference_ms * 1e3:9.1f} us  x{speedup:6.1f}"
            )
        return f"{verdict} {self.kernel:17s} {self.shape:44s} {self.detail:18s}{timing}"


@dataclass(frozen=True)
class Config:
    device: str
    timed: bool
    num_heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype


def _time_ms(fn: Callable[[], object]) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def _timings(config: Config, run: Callable[[str], object]) -> tuple[float | None, float | None]:
    if not config.timed:
        return None, None
    return _time_ms(lambda: run("triton")), _time_ms(lambda: run("reference"))


def _with_backend(backend: str, fn: Callable[[], object]) -> object:
    from dspark_kernels import ops

    with ops.use_backend(backend):
        return fn()


def bench_ring_write(config: Config, batches, windows) -> Iterator[Result]:
    from dspark_kernels import ops
    from dspark_kernels.testing import make_ring_write_case

    for batch in batches:
        ring = max(windows) + SPEC_TOKENS
        case = make_ring_write_case(
            batch, SPEC_TOKENS + 1, config.kv_heads, config.head_dim, ring,
            dtype=config.dtype, device=config.device,
        )
        outputs = {}
        for backend in ("triton", "reference"):
            copy = case.clone_caches()
            _with_backend(backend, lambda: ops.ring_write(*copy.args()))
            outputs[backend] = copy
        agrees = torch.equal(outputs["triton"].k_cache, outputs["reference"].k_cache) and torch.equal(
            outputs["triton"].v_cache, outputs["reference"].v_cache
        )
        shape = f"B={batch} T={SPEC_TOKENS + 1} kvh={config.kv_heads} d={config.head_dim} ring={ring}"
        timings = _timings(config, lambda b: _with_backend(b, lambda: ops.ring_write(*case.args())))
        yield Result("ring_write", shape, agrees, "bitwise", *timings)


def bench_window_attention(config: Config, batches, windows) -> Iterator[Result]:
    from dspark_kernels import ops
    from dspark_kernels.testing import make_attention_case

    tolerance = 1e-4 if config.dtype == torch.float32 else 3e-2
    for batch in batches:
        for window in windows:
            case = make_attention_case(
                batch, SPEC_TOKENS + 1, config.num_heads, config.kv_heads, config.head_dim,
                window, max_spec=SPEC_TOKENS, dtype=config.dtype, device=config.device,
            )
            got = _with_backend("triton", lambda: ops.window_attention(*case.args()))
            want = _with_backend("reference", lambda: ops.window_attention(*case.args()))
            error = float((got.float() - want.float()).abs().max())
            agrees = error <= tolerance and not bool(got.isnan().any())
            shape = (
                f"B={batch} T={SPEC_TOKENS + 1} h={config.num_heads}/{config.kv_heads} "
                f"d={config.head_dim} w={window}"
            )
            timings = _timings(
                config, lambda b: _with_backend(b, lambda: ops.window_attention(*case.args()))
            )
            yield Result("window_attention", shape, agrees, f"max err {error:.1e}", *timings)


def bench_rejection(config: Config, batches, vocabs) -> Iterator[Result]:
    from dspark_kernels import ops
    from dspark_kernels.testing import make_rejection_case

    for vocab in vocabs:
        for batch in batches:
            case = make_rejection_case(batch, SPEC_TOKENS, vocab, device=config.device)
            got = _with_backend("triton", lambda: ops.rejection_sample(*case.args()))
            want = _with_backend("reference", lambda: ops.rejection_sample(*case.args()))
            agrees = torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            accepted = float(want[1].float().mean())
            shape = f"B={batch} k={SPEC_TOKENS} V={vocab} greedy={batch // 3}"
            timings = _timings(
                config, lambda b: _with_backend(b, lambda: ops.rejection_sample(*case.args()))
            )
            yield Result("rejection_sample", shape, agrees, f"exact, acc {accepted:.2f}", *timings)


def _markov_args(batch: int, steps: int, vocab: int, rank: int, config: Config) -> tuple:
    """One draft block for ops.markov_sample: a third of the rows greedy, the rest at temperature 1."""
    device = config.device
    w1 = torch.randn((vocab, rank), device=device).to(config.dtype)
    w2 = (torch.randn((vocab, rank), device=device) / rank**0.5).to(config.dtype)
    is_greedy = torch.arange(batch, device=device) < batch // 3
    noise = torch.empty((batch, steps, vocab), device=device).exponential_()
    return (
        torch.randn((batch, steps, vocab), device=device) * 2, torch.randint(0, vocab, (batch,), device=device),
        w1, w2, 1.0, torch.full((batch,), steps, device=device), is_greedy,
        torch.where(is_greedy, 0.0, 1.0), noise.clamp_(min=torch.finfo(torch.float32).tiny),
    )


def bench_markov(config: Config, batches, vocabs) -> Iterator[Result]:
    from dspark_kernels import ops

    rank = 64 if config.timed else 8
    for vocab in vocabs:
        for batch in batches:
            args = _markov_args(batch, SPEC_TOKENS, vocab, rank, config)
            got = _with_backend("triton", lambda: ops.markov_sample(*args))
            want = _with_backend("reference", lambda: ops.markov_sample(*args))
            error = float((got[1] - want[1]).abs().max())
            agrees = torch.equal(got[0], want[0]) and error <= 1e-5
            shape = f"B={batch} S={SPEC_TOKENS} V={vocab} r={rank} greedy={batch // 3}"
            timings = _timings(config, lambda b: _with_backend(b, lambda: ops.markov_sample(*args)))
            yield Result("markov_sample", shape, agrees, f"q err {error:.1e}", *timings)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", choices=KERNELS, action="append", help="repeatable; default all")
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    args = parser.parse_args(argv)
    kernels = args.kernel or list(KERNELS)

    if torch.cuda.is_available():
        config = Config(
            "cuda", True, args.num_heads, args.kv_heads, args.head_dim, getattr(torch, args.dtype)
        )
        batches, windows, vocabs = BATCHES, WINDOWS, VOCABS
        print(f"device: {torch.cuda.get_device_name()}; Triton compiled, timings are medians")
    else:
        from dspark_kernels import ops

        print("no CUDA device: comparing the Triton kernels run by Triton's interpreter with")
        print("their references at tiny shapes; no timings (run on a CUDA machine for those)")
        ops.enable_interpreter()
        config = Config("cpu", False, 4, 2, 16, getattr(torch, args.dtype))
        batches, windows, vocabs = (1, 3), (8,), (64,)

    torch.manual_seed(0)
    benches = {
        "ring_write": lambda: bench_ring_write(config, batches, windows),
        "window_attention": lambda: bench_window_attention(config, batches, windows),
        "rejection": lambda: bench_rejection(config, batches, vocabs),
        "markov": lambda: bench_markov(config, batches, vocabs),
    }
    failures = 0
    for name in kernels:
        for result in benches[name]():
            print(result.line(), flush=True)
            failures += not result.agrees
    print(f"{failures} disagreement(s)" if failures else "all kernels agree with their references")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

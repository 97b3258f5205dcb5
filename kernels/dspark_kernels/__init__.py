"""Triton kernels for dspark_ray, each beside its plain-PyTorch reference.

The public API is `dspark_kernels.ops` (re-exported here): each entry point
checks its inputs and dispatches to a Triton kernel on CUDA tensors or to the
reference in `dspark_kernels.reference` elsewhere; `set_backend` /
`use_backend` force either. One kernel per file: `ring_write`,
`window_attention`, `rejection`.
"""

from dspark_kernels.ops import (
    KernelBackendError,
    draw_random,
    enable_interpreter,
    get_backend,
    logits_to_probs,
    rejection_sample,
    ring_write,
    set_backend,
    use_backend,
    window_attention,
)

__all__ = [
    "KernelBackendError",
    "draw_random",
    "enable_interpreter",
    "get_backend",
    "logits_to_probs",
    "rejection_sample",
    "ring_write",
    "set_backend",
    "use_backend",
    "window_attention",
]

"""Triton kernels for dspark_ray, each beside its plain-PyTorch reference.

The public API is `dspark_kernels.ops`: each entry point checks its inputs
and dispatches to a Triton kernel on CUDA tensors or to the reference in
`dspark_kernels.reference` elsewhere; `set_backend` / `use_backend` force
either. One Triton kernel file per op: `ring_write`, `window_attention`,
`paged_attention`, `rejection`, `markov` (imported lazily by `ops`, so they are not
re-exported here: the submodule names would shadow the functions).
"""

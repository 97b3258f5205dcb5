"""Triton kernels for dspark_ray, each beside its plain-PyTorch reference."""

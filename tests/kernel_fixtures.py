"""What every kernel test module shares: the interpreter guard, the Triton-only switch, and the
tolerance of an attention kernel against its float64 oracle.

A module does ``from kernel_fixtures import *`` and, for its own kernel,
``triton_only = triton_only_fixture("window_attention")``.
"""

from __future__ import annotations

import pytest
import torch

from dspark_kernels import ops
from dspark_kernels.testing import interpreter_in_process, refuse_references, rerun_in_fresh_process

IN_PROCESS = interpreter_in_process()

__all__ = ["IN_PROCESS", "_under_interpreter", "attention_tolerance", "rerun_file_if_needed", "triton_only_fixture"]


@pytest.fixture(autouse=True)
def _under_interpreter(request):
    """Every kernel test needs the interpreter in process, or its file reruns in a fresh one."""
    if not IN_PROCESS and request.function.__name__ != "test_file_under_interpreter":
        pytest.skip("triton was imported for the compiler; rerun in a fresh process")


def rerun_file_if_needed(path: str):
    """A test that reruns ``path`` under TRITON_INTERPRET=1, or None when this process already has it."""
    if IN_PROCESS:
        return None

    def test_file_under_interpreter():
        rerun_in_fresh_process(path, interpret=True)

    return test_file_under_interpreter


def triton_only_fixture(name: str):
    """A fixture forcing the Triton backend that fails if the reference ``name`` is reached instead."""

    @pytest.fixture
    def triton_only(monkeypatch):
        refuse_references(monkeypatch, name)
        with ops.use_backend("triton"):
            yield

    return triton_only


def attention_tolerance(dtype: torch.dtype) -> dict:
    """``assert_close`` tolerances of an attention kernel's output in ``dtype`` against a float64 oracle."""
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)

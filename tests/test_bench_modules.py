"""bench/'s scripts run with bench/ first on sys.path (``python bench/x.py``, and the bench tests put it there),
so a bench module named like an installed package hides that package from everything in the process.

It happened: transformers 5.25 requires Hugging Face's ``kernels`` package and imports it while loading any
model, and ``bench/kernels.py`` (now ``bench/kernel_timings.py``) answered instead: 355 tests failed or errored
in a fresh install, and every bench script that loads a model with transformers would have failed too."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"


def test_no_bench_module_hides_an_installed_package():
    installed = importlib.metadata.packages_distributions()  # top-level import name -> distributions
    clashes = {p.name: installed[p.stem] for p in BENCH.glob("*.py") if p.stem in installed}
    assert not clashes, f"bench modules named like installed packages (rename them): {clashes}"


def test_transformers_loads_a_model_with_bench_first_on_the_path(tmp_path):
    """As ``python bench/compare.py`` runs: bench/ is sys.path[0]; transformers must still find its own imports."""
    model = Path(__file__).resolve().parent.parent / "models" / "shakespeare-target"
    code = (f"import sys; sys.path.insert(0, {str(BENCH)!r}); from transformers import AutoModelForCausalLM; "
            f"m = AutoModelForCausalLM.from_pretrained({str(model)!r}); print(type(m).__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == "LlamaForCausalLM", out.stderr[-2000:]

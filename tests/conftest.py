"""Shared fixtures: the shipped model pair and tiny random Hugging Face checkpoints.

transformers is imported inside the fixtures, not here, so tests that do not
use them do not pay for the import.
"""

from __future__ import annotations

import copy
import functools
import os
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHIPPED_TARGET = REPO / "models" / "shakespeare-target"
SHIPPED_DRAFT = REPO / "models" / "shakespeare-draft"
SHIPPED_DSPARK = REPO / "models" / "shakespeare-dspark"  # the target's DSpark block draft
# vLLM's CPU build, in a venv of its own (bench/setup_vllm.sh). tests/run.sh installs it in the background
# while the suite runs and writes "ok" or "failed" to $DSPARK_VLLM_SETUP_STATUS when it is done; the tests
# marked `vllm` run last (pytest_collection_modifyitems) and wait for that word.
VLLM_PYTHON = REPO / "bench" / ".vllm-venv" / "bin" / "python"
NO_VLLM = ("bench/.vllm-venv is missing or has no vLLM in it (bash bench/setup_vllm.sh installs it; "
           "tests/run.sh prints the end of its log after the suite)")
VLLM_SETUP_WAIT_S = 1800.0


@functools.cache
def vllm_installed() -> bool:
    """bench/.vllm-venv exists and has vLLM in it, once tests/run.sh's background install (if any) is over:
    an install that failed half-way leaves a venv without it, and then every test that needs vLLM is
    skipped, saying so, rather than failing on an import."""
    status = os.environ.get("DSPARK_VLLM_SETUP_STATUS")
    if status:
        deadline = time.monotonic() + VLLM_SETUP_WAIT_S
        while not Path(status).is_file() and time.monotonic() < deadline:
            time.sleep(2)
        if not Path(status).is_file() or Path(status).read_text().strip() != "ok":
            return False
    if not VLLM_PYTHON.is_file():
        return False
    probe = [str(VLLM_PYTHON), "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"]
    return subprocess.run(probe, capture_output=True, timeout=120).returncode == 0


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("vllm") is not None and not vllm_installed():
        pytest.skip(NO_VLLM)


# The smallest shapes that still exercise GQA, several layers and several heads.
TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def shipped(path: Path, needs: str) -> Path:
    """``path``, or skip the test while the shipped model is still being trained."""
    if not (path / needs).is_file():
        pytest.skip(f"{path.relative_to(REPO)}/{needs} is not there yet (the shipped pair is being trained)")
    return path


@pytest.fixture
def shipped_target() -> Path:
    return SHIPPED_TARGET


@pytest.fixture
def shipped_draft() -> Path:
    return SHIPPED_DRAFT


def hf_classes(architecture: str):
    """(config class, model class) of transformers for an architecture name."""
    import transformers

    prefix = architecture.removesuffix("ForCausalLM")
    return getattr(transformers, f"{prefix}Config"), getattr(transformers, architecture)


def randomize_(model, seed: int) -> None:
    """Give every weight an O(1) random value, so that norms and biases matter to the logits.

    transformers initialises norms to one and biases to zero, under which a
    model that forgot a norm or a bias would still agree.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * noise)
            elif p.ndim == 1:
                p.copy_(0.2 * noise)
            else:
                p.copy_(noise / p.shape[-1] ** 0.5)


def save_tiny_checkpoint(folder: Path, architecture: str = "LlamaForCausalLM", *, seed: int = 0,
                         max_shard_size: str | None = None, save_dtype=None, **overrides):
    """Save a tiny random checkpoint to ``folder``; return the transformers model (float32, eval).

    Keyword arguments override ``TINY`` and go to the transformers config
    class; ``max_shard_size`` shards the safetensors; ``save_dtype`` (a torch
    dtype) is the dtype written to disk, float32 by default.
    """
    import torch

    config_cls, model_cls = hf_classes(architecture)
    config = config_cls(**{**TINY, **overrides})
    config._attn_implementation = "eager"  # the plainest reference, not the SDPA we use ourselves
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    randomize_(model, seed)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    if save_dtype is None:
        model.save_pretrained(folder, **kwargs)
        return model
    # Round the float32 reference's weights as the file stores them, leaving
    # its buffers (rotary frequencies) in float32.
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(save_dtype).float())
    copy.deepcopy(model).to(save_dtype).save_pretrained(folder, **kwargs)
    return model


@pytest.fixture
def make_checkpoint(tmp_path):
    """Factory: ``make_checkpoint(architecture, **overrides) -> (folder, transformers model)``.

    Takes the arguments of ``save_tiny_checkpoint``; each call gets a fresh folder.
    """
    count = 0

    def make(architecture: str = "LlamaForCausalLM", **kwargs):
        nonlocal count
        count += 1
        folder = tmp_path / f"ckpt{count}"
        return folder, save_tiny_checkpoint(folder, architecture, **kwargs)

    return make


# -- the shared `serve run` (serve_fixtures.served) ---------------------------------------------------


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::")[0]


def _sharing_modules(items: list[pytest.Item]) -> set[str]:
    import serve_fixtures

    return {_module(item) for item in items if serve_fixtures.uses_shared_serve(item)}


def _needing_vllm(items: list[pytest.Item]) -> set[str]:
    return {_module(item) for item in items if item.get_closest_marker("vllm") is not None}


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run the modules that share ``served`` one after another, so that one `serve run` serves them
    all, and the modules with tests that need vLLM last, so that tests/run.sh's background install of
    it has finished by then: the other modules first, then the sharing ones (those needing vLLM last
    among them), then the rest of those needing vLLM. Each module's tests keep their own order."""
    sharing = _sharing_modules(items)
    config.stash[_SHARING] = sharing
    vllm = _needing_vllm(items)

    def rank(item: pytest.Item) -> int:
        module = _module(item)
        if module in sharing:
            return 2 if module in vllm else 1
        return 3 if module in vllm else 0

    # sorted is stable: within a rank, modules (and tests) keep the order they were collected in
    items[:] = sorted(items, key=rank)


_SHARING = pytest.StashKey[set]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    """After the last test of the modules that share ``served`` (its module's fixtures torn down
    first), stop the shared run: the next module may start Ray in this process itself."""
    yield
    sharing = item.config.stash.get(_SHARING, set())
    if nextitem is None or _module(nextitem) not in sharing:
        import serve_fixtures

        serve_fixtures.stop_shared_serve()

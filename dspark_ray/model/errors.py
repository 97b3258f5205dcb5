"""Named errors raised while loading a checkpoint. Each message says how to fix it."""

from __future__ import annotations


class ModelLoadError(Exception):
    """Base class: the checkpoint at a path cannot be loaded."""


class UnsupportedArchitecture(ModelLoadError):
    """config.json names an architecture this loader does not implement."""


class CheckpointFileMissing(ModelLoadError):
    """A file the checkpoint needs (config.json, weights, tokenizer) is absent."""


class TensorMissing(ModelLoadError):
    """The weights lack a tensor the architecture needs."""


class TensorShapeMismatch(ModelLoadError):
    """A tensor in the weights has a shape other than the config implies."""


class UnsupportedDtype(ModelLoadError):
    """The requested dtype cannot run on the requested device."""


class UnsupportedQuantization(ModelLoadError):
    """config.json's quantization_config (or the weights it describes) cannot be loaded."""


class ContextTooLong(ModelLoadError):
    """The configured max_context exceeds the context length the model supports."""

"""GGUF files as checkpoints: llama.cpp's single-file format, read with ggml's own ``gguf`` package.

A GGUF file holds what a Hugging Face folder spreads over several files: the model's settings
as metadata keys (``llama.block_count``, ``llama.attention.head_count`` ...), the tokenizer
(``tokenizer.ggml.tokens``, ``.merges``, ``.token_type``, the special ids, the chat template),
and every tensor, most of them quantized in blocks (Q8_0, Q4_1, the K-quants ...).

``GgufCheckpoint`` turns it into the three things the rest of the project reads from a folder:

- ``config_dict()``: a config.json-shaped dict, so ``ModelConfig.from_dict`` and the memory
  planner take a GGUF exactly as they take a folder;
- ``tensors()``: every weight under its Hugging Face name, as a lazy handle with the same two
  methods as a safetensors slice (``get_shape()``, ``handle[index]``), so the loader's
  tensor-parallel slicing works unchanged: a rank reads and dequantizes only the rows (or the
  whole blocks of columns) of its own slice. Dequantization is ``gguf.quants.dequantize``;
- ``tokenizer_spec()``: the tokenizer's parts (``dspark_ray.tokenizer`` builds the tokenizer).

llama.cpp's converter reorders the rows of a Llama-family q_proj and k_proj within each head
(rotary pairs interleaved instead of split in halves); ``_unpermute`` puts them back, as
transformers does when it loads a GGUF, so the weights are the original checkpoint's.

Opening a file parses all its metadata (about 2 s for SmolLM2-135M's 49,152-token vocabulary),
so a process opens each file once (``open_checkpoint`` is cached by path, size and mtime).
Every failure is a ``ModelLoadError`` naming the file, and the key or tensor, and what is supported.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dspark_ray.model.errors import (
    CheckpointFileMissing,
    ModelLoadError,
    TensorMissing,
    UnsupportedArchitecture,
    UnsupportedQuantization,
)

GGUF_MAGIC = b"GGUF"

# general.architecture -> (Hugging Face architecture, whether llama.cpp permuted q/k rows).
# Mistral's files say "llama" (its sliding window, when set, is llama.attention.sliding_window).
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", True),
    "mistral": ("MistralForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
}

# The tensor types dequantized at load: the float types, the legacy 32-weight blocks and the
# K-quants (256-weight super-blocks), each by gguf.quants.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.").
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Tensors llama.cpp stores that this implementation computes itself.
_COMPUTED = ("rope_freqs.weight",)

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6


class GgufError(ModelLoadError):
    """A GGUF file cannot be read, or holds something this loader does not take."""


@dataclass(frozen=True)
class TokenizerSpec:
    """A GGUF file's tokenizer, as its metadata gives it (``dspark_ray.tokenizer`` builds it)."""

    model: str  # tokenizer.ggml.model: "gpt2" (byte-level BPE) is the one built here
    pre: str  # tokenizer.ggml.pre: how text is split before BPE ("smollm", "llama-bpe", "qwen2", ...)
    tokens: list[str]
    token_types: list[int]  # TOKEN_* per token
    merges: list[str]  # "a b" pairs, best first
    bos_id: int | None
    eos_ids: list[int]  # eos, then eot/eom where the file names other ids
    unk_id: int | None
    pad_id: int | None
    add_bos: bool
    add_eos: bool
    chat_template: str | None


class GgufTensor:
    """One weight of a GGUF file under its Hugging Face shape, dequantized on indexing.

    ``handle[index]`` (``index`` a tuple of slices, as the loader's tensor-parallel slicing
    gives it) returns a float32 tensor of only those rows and columns. Rows are taken from the
    file's blocks directly; columns too when the slice starts and ends on a block boundary,
    otherwise the rows are dequantized whole and then cut.
    """

    def __init__(self, name: str, gguf_name: str, data: np.ndarray, qtype: Any, shape: tuple[int, ...],
                 heads: int | None) -> None:
        self.name = name
        self.gguf_name = gguf_name
        self._data = data  # memory-mapped: [rows, row bytes] for block types, [rows, cols] for floats
        self.qtype = qtype  # gguf.GGMLQuantizationType
        self.shape = shape  # the Hugging Face shape: [out, in] for a weight, [n] for a vector
        self._heads = heads  # q/k rows to put back in Hugging Face order (llama.cpp permuted them)

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def get_dtype(self) -> str:
        """The file's type name (F32, Q4_1, ...), as a safetensors slice names its dtype."""
        return self.qtype.name

    @property
    def nbytes(self) -> int:
        return int(self._data.nbytes)

    def __getitem__(self, index: Any) -> torch.Tensor:
        rows, cols = _two_slices(index, len(self.shape))
        if len(self.shape) == 1:
            return self._dequantize(self._data)[rows]
        if self._heads is not None:
            return self._permuted_rows(rows)[:, cols]
        row_data = self._data[rows]
        block = _block_size(self.qtype)
        start, stop, step = cols.indices(self.shape[1])
        if block > 1 and step == 1 and start % block == 0 and (stop % block == 0 or stop == self.shape[1]):
            per_block = row_data.shape[1] // (self.shape[1] // block)
            return self._dequantize(row_data[:, start // block * per_block: -(-stop // block) * per_block])
        return self._dequantize(row_data)[:, cols]

    def _permuted_rows(self, rows: slice) -> torch.Tensor:
        """Rows ``rows`` in Hugging Face order. The permutation stays within each head, so a slice of
        whole heads (what tensor parallelism asks for) reads the same rows of the file."""
        head_dim = self.shape[0] // self._heads
        start, stop, step = rows.indices(self.shape[0])
        if step == 1 and start % head_dim == 0 and stop % head_dim == 0:
            return _unpermute(self._dequantize(self._data[start:stop]), (stop - start) // head_dim)
        return _unpermute(self._dequantize(self._data), self._heads)[rows]

    def _dequantize(self, data: np.ndarray) -> torch.Tensor:
        from gguf.quants import dequantize

        values = dequantize(data, self.qtype)
        if values.dtype != np.float32 or not values.flags.writeable or not values.flags.c_contiguous:
            values = np.array(values, dtype=np.float32)  # a float tensor comes back as the file's read-only view
        return torch.from_numpy(values)

    def block_shape(self, index: Any) -> tuple[int, int] | None:
        """(rows, bytes a row) of the blocks ``blocks(index)`` returns; None where ``index``'s columns
        cut a block (that slice is only read dequantized)."""
        rows, cols = _two_slices(index if index is not None else slice(None), 2)
        n_rows = len(range(*rows.indices(self.shape[0])))
        start, stop, step = cols.indices(self.shape[1])
        block = _block_size(self.qtype)
        if step != 1 or start % block or stop % block:
            return None
        per_block = self._data.shape[1] // (self.shape[1] // block)
        return n_rows, (stop - start) // block * per_block

    def blocks(self, index: Any = None) -> torch.Tensor:
        """This rank's slice of the file's blocks, uint8 [rows, bytes a row], rows in Hugging Face order
        (q/k rows put back as for ``handle[index]``); ``block_shape(index)`` must not be None."""
        shape = self.block_shape(index)
        if shape is None or len(self.shape) != 2:
            raise ValueError(f"{self.name}: {index!r} does not slice whole blocks")
        rows, cols = _two_slices(index if index is not None else slice(None), 2)
        start, stop, _ = cols.indices(self.shape[1])
        block = _block_size(self.qtype)
        per_block = self._data.shape[1] // (self.shape[1] // block)
        byte_cols = slice(start // block * per_block, stop // block * per_block)
        if self._heads is None:
            return torch.from_numpy(np.array(self._data[rows, byte_cols]))
        whole = _unpermute(torch.from_numpy(np.array(self._data[:, byte_cols])), self._heads)
        return whole[rows].contiguous()


def _two_slices(index: Any, ndim: int) -> tuple[slice, slice]:
    if not isinstance(index, tuple):
        index = (index,)
    if len(index) > ndim or not all(isinstance(s, slice) for s in index):
        raise IndexError(f"a GGUF tensor takes up to {ndim} slices, got {index!r}")
    full = tuple(index) + (slice(None),) * (2 - len(index))
    return full[0], full[1]


def _block_size(qtype: Any) -> int:
    from gguf import GGML_QUANT_SIZES

    return GGML_QUANT_SIZES[qtype][0]


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: within a head, llama.cpp stores the rows of each rotary
    pair next to each other ([r0, r_half, r1, r_half+1, ...]); Hugging Face stores the first
    half of the head's rows, then the second."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class GgufCheckpoint:
    """A GGUF file opened and validated: its config, tensors and tokenizer (see the module docstring).

    Build it with ``open_checkpoint(path)``; the constructor raises ``GgufError`` for a file
    that is not GGUF, is truncated, or holds an architecture or tensor type not supported here.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._reader = _read(path)
        self.arch = self._str("general.architecture")
        if self.arch not in ARCHITECTURES:
            raise UnsupportedArchitecture(
                f"{path}: general.architecture is {self.arch!r}; GGUF files of {', '.join(ARCHITECTURES)} "
                "are supported"
            )
        self.hf_architecture, permuted = ARCHITECTURES[self.arch]
        self._raw = self._config()
        self._tensors = self._index_tensors(permuted)
        self._raw["gguf_tensor_types"] = self._tensor_types()

    # -- metadata -----------------------------------------------------------------------------

    def _field(self, key: str) -> Any:
        field = self._reader.fields.get(key)
        return None if field is None else field.contents()

    def _str(self, key: str) -> str:
        value = self._field(key)
        if not isinstance(value, str):
            raise GgufError(f"{self.path}: metadata key {key!r} is missing or not a string; re-convert the model "
                            "with llama.cpp's convert_hf_to_gguf.py")
        return value

    def _int(self, key: str, default: int | None = None) -> int:
        value = self._field(key)
        if value is None and default is not None:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise GgufError(f"{self.path}: metadata key {key!r} is missing or not an integer (got {value!r})")
        return value

    def _float(self, key: str, default: float) -> float:
        value = self._field(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise GgufError(f"{self.path}: metadata key {key!r} must be a number, got {value!r}")
        # GGUF stores float32: 1e-05 comes back as 9.999999747e-06; the shortest decimal that is the
        # same float32 is the value the converter was given.
        return float(str(np.float32(value)))

    def _config(self) -> dict:
        a = self.arch
        heads = self._int(f"{a}.attention.head_count")
        hidden = self._int(f"{a}.embedding_length")
        tokens = self._field("tokenizer.ggml.tokens")
        vocab = self._field(f"{a}.vocab_size")
        if vocab is None:
            vocab = len(tokens) if isinstance(tokens, list) else self._token_rows()
        raw = {
            "architectures": [self.hf_architecture],
            "model_type": self.hf_architecture.removesuffix("ForCausalLM").lower(),
            "vocab_size": vocab,
            "hidden_size": hidden,
            "intermediate_size": self._int(f"{a}.feed_forward_length"),
            "num_hidden_layers": self._int(f"{a}.block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": self._int(f"{a}.attention.head_count_kv", heads),
            "head_dim": self._int(f"{a}.attention.key_length", hidden // heads),
            "max_position_embeddings": self._int(f"{a}.context_length", 2048),
            "rms_norm_eps": self._float(f"{a}.attention.layer_norm_rms_epsilon", 1e-6),
            "rope_theta": self._float(f"{a}.rope.freq_base", 10000.0),
            "tie_word_embeddings": "output.weight" not in {t.name for t in self._reader.tensors},
            "hidden_act": "silu",
            "torch_dtype": "bfloat16",
        }
        window = self._field(f"{a}.attention.sliding_window")
        if window:
            raw["sliding_window"] = int(window)
        rope_scaling = self._rope_scaling()
        if rope_scaling is not None:
            raw["rope_scaling"] = rope_scaling
        self._check_rope_dims(raw)
        return raw

    def _rope_scaling(self) -> dict | None:
        kind = self._field(f"{self.arch}.rope.scaling.type")
        if kind in (None, "none"):
            return None
        if kind not in ("linear", "yarn"):
            raise GgufError(f"{self.path}: {self.arch}.rope.scaling.type {kind!r} is not supported; "
                            "linear and yarn are")
        scaling = {"rope_type": kind, "factor": self._float(f"{self.arch}.rope.scaling.factor", 1.0)}
        original = self._field(f"{self.arch}.rope.scaling.original_context_length")
        if original:
            scaling["original_max_position_embeddings"] = int(original)
        return scaling

    def _check_rope_dims(self, raw: dict) -> None:
        dims = self._field(f"{self.arch}.rope.dimension_count")
        if dims is not None and dims != raw["head_dim"]:
            raise GgufError(f"{self.path}: {self.arch}.rope.dimension_count is {dims} but heads have "
                            f"{raw['head_dim']} dimensions; partial rotary embeddings are not supported")

    def _token_rows(self) -> int:
        embd = next((t for t in self._reader.tensors if t.name == "token_embd.weight"), None)
        if embd is None:
            raise TensorMissing(f"{self.path} has no tensor 'token_embd.weight' and no {self.arch}.vocab_size")
        return int(embd.shape[-1])

    def _tensor_types(self) -> dict[str, list[str]]:
        """Each weight's block type, by the memory planner's tensor name (a layer's without its
        ``model.layers.N.`` prefix), one entry per layer: what ``quantization: auto`` keeps is planned
        at its stored size (``dspark_ray.model.memory``)."""
        types: dict[str, list[str]] = {}
        for name, t in self._tensors.items():
            short = name.split(".", 3)[3] if name.startswith("model.layers.") else name.removeprefix("model.")
            types.setdefault(short, []).append(t.qtype.name)
        return types

    def config_dict(self) -> dict:
        """The model's settings as a Hugging Face config.json would hold them (a fresh copy)."""
        return {k: (dict(v) if isinstance(v, dict) else list(v) if isinstance(v, list) else v)
                for k, v in self._raw.items()}

    def hf_config(self) -> dict:
        """``config_dict()`` without the keys of this project's own (what an exported config.json holds)."""
        return {k: v for k, v in self.config_dict().items() if not k.startswith("gguf_")}

    # -- tensors ------------------------------------------------------------------------------

    def _index_tensors(self, permuted: bool) -> dict[str, GgufTensor]:
        from gguf import GGMLQuantizationType

        raw = self._raw
        out: dict[str, GgufTensor] = {}
        for t in self._reader.tensors:
            if t.name in _COMPUTED:
                self._check_computed(t)
                continue
            name = _hf_name(t.name)
            if name is None:
                raise GgufError(f"{self.path}: tensor {t.name!r} has no place in a {self.arch} model; "
                                "is general.architecture right?")
            qtype = GGMLQuantizationType(t.tensor_type)
            if qtype.name not in SUPPORTED_TYPES:
                raise UnsupportedQuantization(
                    f"{self.path}: tensor {t.name!r} is stored as {qtype.name}, which is not supported; "
                    f"supported types: {', '.join(SUPPORTED_TYPES)}. Re-quantize the file (llama.cpp's "
                    "llama-quantize) to one of them"
                )
            shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists the fastest dimension first
            heads = None
            if permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = raw["num_attention_heads"] if "q_proj" in name else raw["num_key_value_heads"]
            out[name] = GgufTensor(name, t.name, t.data, qtype, shape, heads)
        return out

    def _check_computed(self, t: Any) -> None:
        """rope_freqs holds llama3-style rope scaling as per-dimension factors, which this loader
        does not read back into rope settings; refuse rather than run with other frequencies."""
        raise GgufError(f"{self.path}: tensor {t.name!r} (Llama 3.1-style rope scaling stored as factors) is not "
                        "supported; convert the Hugging Face checkpoint instead (safetensors folders with "
                        "rope_scaling llama3 are)")

    def tensors(self) -> Iterator[tuple[str, GgufTensor]]:
        """Every weight under its Hugging Face name, in file order."""
        return iter(self._tensors.items())

    def tensor(self, name: str) -> GgufTensor:
        if name not in self._tensors:
            raise TensorMissing(f"{self.path} has no tensor for {name!r}")
        return self._tensors[name]

    @property
    def nbytes(self) -> int:
        """The bytes of all tensors as stored in the file."""
        return sum(t.nbytes for t in self._tensors.values())

    # -- tokenizer ----------------------------------------------------------------------------

    def tokenizer_spec(self) -> TokenizerSpec:
        """The tokenizer's parts; raises ``GgufError`` naming the key when one is missing."""
        tokens = self._field("tokenizer.ggml.tokens")
        if not isinstance(tokens, list) or not tokens:
            raise GgufError(f"{self.path} has no tokenizer (metadata key 'tokenizer.ggml.tokens' is missing); "
                            "a GGUF converted without its tokenizer cannot be served")
        model = self._str("tokenizer.ggml.model")
        types = self._field("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens)
        merges = self._field("tokenizer.ggml.merges")
        if model == "gpt2" and not merges:
            raise GgufError(f"{self.path}: a gpt2 (byte-level BPE) tokenizer needs 'tokenizer.ggml.merges', "
                            "which is missing")
        if len(types) != len(tokens):
            raise GgufError(f"{self.path}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
        ids = {key: self._token_id(key, len(tokens)) for key in
               ("bos_token_id", "eos_token_id", "eot_token_id", "eom_token_id", "unknown_token_id",
                "padding_token_id")}
        eos = [ids[k] for k in ("eos_token_id", "eot_token_id", "eom_token_id") if ids[k] is not None]
        if not eos:
            raise GgufError(f"{self.path} names no end-of-sequence token (tokenizer.ggml.eos_token_id)")
        pre = self._field("tokenizer.ggml.pre")
        return TokenizerSpec(
            model=model, pre=pre if isinstance(pre, str) else "default", tokens=tokens, token_types=list(types),
            merges=list(merges or []), bos_id=ids["bos_token_id"], eos_ids=list(dict.fromkeys(eos)),
            unk_id=ids["unknown_token_id"], pad_id=ids["padding_token_id"],
            add_bos=bool(self._field("tokenizer.ggml.add_bos_token") or False),
            add_eos=bool(self._field("tokenizer.ggml.add_eos_token") or False),
            chat_template=self._field("tokenizer.chat_template"),
        )

    def _token_id(self, key: str, n: int) -> int | None:
        value = self._field(f"tokenizer.ggml.{key}")
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < n:
            raise GgufError(f"{self.path}: tokenizer.ggml.{key} is {value!r}, not a token id in [0, {n})")
        return value


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}"
    return None


def _read(path: Path) -> Any:
    """gguf's reader over ``path``, its failures turned into errors that name the file."""
    if not path.is_file():
        raise CheckpointFileMissing(f"GGUF file {path} not found")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise GgufError(f"{path} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})")
    try:
        from gguf import GGUFReader
    except ImportError as exc:
        raise GgufError("reading GGUF files needs the 'gguf' package: pip install gguf") from exc
    try:
        reader = GGUFReader(path)
    except (ValueError, IndexError, KeyError, OverflowError, MemoryError, UnicodeDecodeError) as exc:
        size = path.stat().st_size
        raise GgufError(f"{path} cannot be read as GGUF ({size} bytes; truncated or corrupt?): "
                        f"{type(exc).__name__}: {exc}") from exc
    for t in reader.tensors:  # a tensor past the end of the file: gguf's memmap views come up short
        if t.data.nbytes != t.n_bytes:
            raise GgufError(f"{path} is truncated: tensor {t.name!r} needs {t.n_bytes} bytes, the file holds "
                            f"{t.data.nbytes}; download or copy the file again")
    return reader


@functools.lru_cache(maxsize=8)
def _open_cached(path: str, size: int, mtime_ns: int) -> GgufCheckpoint:
    return GgufCheckpoint(Path(path))


def release() -> None:
    """Forget the files opened so far: their memory maps close once nothing else holds them. The
    loader calls it when the weights are in place, so that the file's pages it read do not stay
    resident beside the model's own copy. The reader's metadata (a small array per vocabulary
    entry: ~180 MB of heap for a 49,152-token vocabulary) is freed with it, and on glibc the heap
    is trimmed so that the process's resident memory shows it."""
    _open_cached.cache_clear()
    gc.collect()  # the reader's arrays sit in reference cycles of its fields
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the memory is free for reuse, only not returned
        pass


def open_checkpoint(path: str | Path) -> GgufCheckpoint:
    """The GGUF file at ``path``, opened once per process (a changed file is opened again)."""
    path = Path(path).resolve()
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        raise CheckpointFileMissing(f"GGUF file {path} not found") from None
    return _open_cached(str(path), stat.st_size, stat.st_mtime_ns)

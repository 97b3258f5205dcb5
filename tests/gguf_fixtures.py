"""Small GGUF files written for the tests with ggml's own writer (``gguf.GGUFWriter``).

``write_tiny_gguf`` builds a random model of a supported family the way llama.cpp's converter
writes one: metadata under the architecture's keys, a byte-level BPE tokenizer, the q/k rows of
a Llama-family model permuted, each weight quantized to the type asked for by
``gguf.quants.quantize``. transformers loads the same file, so a test can hold this project's
GGUF reader against transformers' on every family and type.

``random_blocks`` makes valid random blocks of any block type (the f16 scales set to finite,
modest values), for the types ``gguf.quants`` cannot quantize (the K-quants).

``SMOLLM2`` is the real model deploy/setup.sh installs.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from dspark_ray.model.checkpoint import DEFAULT_MODEL, locate

# Byte offsets of the float16 scale fields inside one block of each type (ggml's block layouts).
F16_FIELDS = {
    "Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
}
CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file; an AssertionError naming the fix if it is not installed."""
    try:
        return locate(DEFAULT_MODEL)
    except Exception as exc:  # CheckpointFileMissing: the set-up did not run
        raise AssertionError(f"{exc} (tests/run.sh runs deploy/setup.sh, which installs it)") from None


@functools.cache
def hf_smollm2():
    """transformers' own GGUF loader's SmolLM2 (float32, eval mode) and its tokenizer: the reference
    the tests hold this project's loader, tokenizer and engine against. Loaded once per test process
    (half a minute: its reader parses the file's metadata in Python); nobody may change it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_path()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return model, tokenizer


def byte_alphabet() -> list[str]:
    """GPT-2's byte-to-character table, in byte order (what byte-level BPE vocabularies spell bytes as)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return [chars[b] for b in range(256)]


def tiny_vocab() -> tuple[list[str], list[str], list[int]]:
    """(tokens, merges, token types): control tokens, the 256 bytes, and a few merges."""
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s", "r e", "a t"]
    merged = ["".join(m.split(" ")) for m in merges]
    tokens = CONTROL + byte_alphabet() + merged
    types = [3] * len(CONTROL) + [1] * (len(tokens) - len(CONTROL))
    return tokens, merges, types


def random_blocks(qtype_name: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Valid random blocks of ``qtype_name`` for a [rows, cols] weight: [rows, row bytes] uint8."""
    import gguf

    qtype = gguf.GGMLQuantizationType[qtype_name]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for offset in F16_FIELDS[qtype_name]:
        scales = rng.uniform(-0.05, 0.05, size=(rows, cols // block)).astype(np.float16)
        data[:, :, offset:offset + 2] = scales.view(np.uint8).reshape(rows, cols // block, 2)
    return data.reshape(rows, cols // block * size)


def llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order (what the reader must undo)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: Path, arch: str = "llama", qtype: str = "Q8_0", embed_qtype: str = "Q8_0",
                    layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2, inter: int = 96,
                    head_dim: int | None = None,
                    tied: bool = True, seed: int = 0, tokenizer: bool = True, skip: tuple[str, ...] = (),
                    extra_tensors: dict[str, tuple[np.ndarray, str]] | None = None,
                    metadata: dict | None = None) -> dict[str, np.ndarray]:
    """Write a random ``arch`` model to ``path``; returns its float32 weights by GGUF name, before
    quantization and permutation (the values a reader should get back, up to quantization)."""
    import gguf

    rng = np.random.default_rng(seed)
    tokens, merges, types = tiny_vocab()
    vocab = len(tokens)
    head_dim = head_dim or hidden // heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(head_dim)
    if arch == "qwen3" or head_dim != hidden // heads:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    for key, value in (metadata or {}).items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, value)
    if tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("smollm")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        w.add_pad_token_id(2)
        w.add_add_bos_token(False)
        w.add_chat_template(TEMPLATE)

    weights: dict[str, np.ndarray] = {}

    def tensor(name: str, shape: tuple[int, ...], kind: str, permute_heads: int | None = None) -> None:
        if name in skip:
            return
        value = (rng.standard_normal(shape) * (0.5 if len(shape) == 2 else 0.1)).astype(np.float32)
        if len(shape) == 1:
            value += 1.0
        weights[name] = value
        stored = llama_permute(value, permute_heads) if permute_heads and arch == "llama" else value
        if kind in ("F32", "F16", "BF16") or len(shape) == 1:
            kind = "F32" if len(shape) == 1 else kind
            if kind == "F16":
                w.add_tensor(name, stored.astype(np.float16))
            elif kind == "BF16":
                raw = gguf.quants.quantize(stored, gguf.GGMLQuantizationType.BF16)
                w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType.BF16)
            else:
                w.add_tensor(name, stored)
            return
        q = gguf.GGMLQuantizationType[kind]
        w.add_tensor(name, gguf.quants.quantize(stored, q), raw_dtype=q)

    tensor("token_embd.weight", (vocab, hidden), embed_qtype)
    tensor("output_norm.weight", (hidden,), "F32")
    if not tied:
        tensor("output.weight", (vocab, hidden), qtype)
    for i in range(layers):
        b = f"blk.{i}."
        tensor(b + "attn_norm.weight", (hidden,), "F32")
        tensor(b + "ffn_norm.weight", (hidden,), "F32")
        tensor(b + "attn_q.weight", (heads * head_dim, hidden), qtype, heads)
        tensor(b + "attn_k.weight", (kv_heads * head_dim, hidden), qtype, kv_heads)
        tensor(b + "attn_v.weight", (kv_heads * head_dim, hidden), qtype)
        tensor(b + "attn_output.weight", (hidden, heads * head_dim), qtype)
        if arch == "qwen2":
            for part, rows in (("q", heads * head_dim), ("k", kv_heads * head_dim), ("v", kv_heads * head_dim)):
                tensor(b + f"attn_{part}.bias", (rows,), "F32")
        if arch == "qwen3":
            tensor(b + "attn_q_norm.weight", (head_dim,), "F32")
            tensor(b + "attn_k_norm.weight", (head_dim,), "F32")
        tensor(b + "ffn_gate.weight", (inter, hidden), qtype)
        tensor(b + "ffn_up.weight", (inter, hidden), qtype)
        tensor(b + "ffn_down.weight", (hidden, inter), qtype)
    for name, (value, kind) in (extra_tensors or {}).items():
        w.add_tensor(name, value, raw_dtype=gguf.GGMLQuantizationType[kind] if kind != "F32" else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return weights


def write_truncated(source: Path, dest: Path, layers: int) -> Path:
    """``source`` with only its first ``layers`` decoder layers: every other tensor and every metadata
    key (the tokenizer included) copied as stored, the block count changed. From SmolLM2 this makes a
    real draft of the same family, tokenizer and embeddings, which agrees with the full model often
    but not always (the rejection path is exercised on real weights)."""
    import gguf

    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dest), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = layers if key == f"{arch}.block_count" else field.contents()
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, value, field.types[0], sub)
    for t in reader.tensors:
        if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= layers:
            continue
        qtype = gguf.GGMLQuantizationType(t.tensor_type)
        if qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(t.name, np.array(t.data))
        else:
            w.add_tensor(t.name, np.array(t.data), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dest

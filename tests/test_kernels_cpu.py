"""The CPU attention kernels (dspark_kernels/csrc/cpu_attention.c, called through dspark_kernels.cpu).

Each is checked against its torch reference (dspark_kernels.reference) on random
inputs: the target's packed step (``PagedStep``: KV written through the
write index, keys read through an int32 request-to-token table, grouped heads,
sliding windows, head dims with and without a vector specialisation), and the
draft's window cache (``RingStep``: padding, catch-up chunks, positions that wrap
the ring, the lengths grown at the first layer only). Bad indices are refused
before anything is written. In the engine: both models' attention runs on the
kernels, and greedy output equals the torch path's token for token.
"""

from __future__ import annotations

import logging

import pytest
import torch

from conftest import SHIPPED_DRAFT, SHIPPED_TARGET, shipped
from dspark_kernels import cpu, ops, reference
from dspark_ray.engine import EngineConfig, SamplingParams
from dspark_ray.engine.local import build_local_engine

# Skipped only where nothing can build them; with a compiler, a build or load failure fails the tests.
pytestmark = pytest.mark.skipif(not cpu.can_build(), reason="the CPU kernels are off or no C compiler is here")


def test_the_kernels_build_and_load_on_this_cpu():
    """With a compiler they must load, whatever the CPU's vector extensions (an AVX2 machine once got a
    library with an undefined intrinsic, which left every kernel off and every kernel test skipped)."""
    assert cpu.library() is not None


def paged_case(seed: int, rows: int, fed: int, context: int, hq: int, hkv: int, d: int):
    """A packed step of ``rows`` rows feeding ``fed`` tokens each after ``context - fed`` held ones:
    pools with random contents, a table mapping each row's positions to distinct pool indices."""
    g = torch.Generator().manual_seed(seed)
    pool = rows * context + 7
    k_pool, v_pool = torch.randn(pool, hkv, d, generator=g), torch.randn(pool, hkv, d, generator=g)
    table = torch.zeros(rows + 1, context + 3, dtype=torch.int32)  # row 0: the padding row, unused here
    order = torch.randperm(pool - 1, generator=g)[:rows * context] + 1
    table[1:, :context] = order.view(rows, context).to(torch.int32)
    slots = torch.arange(1, rows + 1).repeat_interleave(fed)  # [N]
    positions = (torch.arange(fed) + context - fed).repeat(rows)  # [N]
    write = table[slots, positions].long()
    n = rows * fed
    q, k, v = (torch.randn(n, h, d, generator=g) for h in (hq, hkv, hkv))
    return k_pool, v_pool, table, slots, positions, write, q, k, v


@pytest.mark.parametrize("rows, fed, context, hq, hkv, d, window", [
    (1, 1, 1, 4, 2, 64, None),  # a first token: one key, itself
    (1, 5, 60, 4, 2, 64, None),  # the shipped target verifying 4 drafts
    (4, 5, 200, 8, 2, 128, None),  # four query heads a K/V head, head_dim 128
    (3, 2, 40, 4, 4, 96, 16),  # no grouping, a head_dim of 64 + 32 (AVX2: two slices), a sliding window
    (2, 3, 19, 4, 2, 36, None),  # a head_dim without a vector path
    (2, 33, 33, 2, 1, 256, 8),  # a prefill chunk, head_dim 256
])
def test_paged_step_matches_the_reference(rows, fed, context, hq, hkv, d, window):
    k_pool, v_pool, table, slots, positions, write, q, k, v = paged_case(0, rows, fed, context, hq, hkv, d)
    want_k, want_v = k_pool.clone(), v_pool.clone()
    want_k.index_copy_(0, write, k)
    want_v.index_copy_(0, write, v)
    want = reference.paged_attention(q.view(rows, fed, hq, d), want_k, want_v, table, torch.arange(1, rows + 1),
                                     positions.view(rows, fed), d ** -0.5, window).view(-1, hq, d)
    lo = torch.zeros_like(positions) if window is None else (positions - window + 1).clamp_min(0)
    got = cpu.paged_attention(q, k, v, k_pool, v_pool, write, table, slots * table.shape[1], lo, positions)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(k_pool, want_k) and torch.equal(v_pool, want_v)


def test_paged_step_leaves_non_queries_zero_and_reads_every_layer_s_own_pools():
    k_pool, v_pool, table, slots, positions, write, q, k, v = paged_case(1, 2, 3, 20, 4, 2, 64)
    base = slots * table.shape[1]
    base[1] = -1  # token 1 writes its K/V but asks nothing
    pools = [(k_pool.clone(), v_pool.clone()), (torch.randn_like(k_pool), torch.randn_like(v_pool))]
    step = cpu.PagedStep([p[0] for p in pools], [p[1] for p in pools], write, table, base,
                         torch.zeros_like(positions), positions)
    first, second = (step(layer, q[None], k[None], v[None])[0] for layer in (0, 1))
    assert torch.equal(first[1], torch.zeros_like(first[1])) and torch.equal(second[1], torch.zeros_like(second[1]))
    for layer, out in ((0, first), (1, second)):
        k_l, v_l = pools[layer]
        want = reference.paged_attention(q.view(2, 3, 4, 64), k_l, v_l, table, torch.tensor([1, 2]),
                                         positions.view(2, 3), 64 ** -0.5).view(-1, 4, 64)
        assert torch.equal(k_l[write], k) and torch.equal(v_l[write], v)
        keep = torch.arange(6) != 1
        torch.testing.assert_close(out[keep], want[keep], rtol=1e-5, atol=1e-5)


def test_paged_step_on_the_pools_threads_is_the_one_thread_step_bit_for_bit():
    """With the kernels' pool on two threads (torch_threads 2 sets it: model/quantized.py), a step's
    (query, K/V head) pairs are shared among the threads, each computed whole by one: output and pools
    bit for bit those of one thread, a non-query's zeros included, and the workers did compute some."""
    from dspark_kernels import quant

    lib = quant._library()
    k_pool, v_pool, table, slots, positions, write, q, k, v = paged_case(2, 16, 3, 150, 9, 3, 64)
    base = slots * table.shape[1]
    base[5] = -1

    def step(threads: int) -> tuple[torch.Tensor, ...]:
        quant.set_threads(threads)
        kp, vp = k_pool.clone(), v_pool.clone()
        return cpu.paged_attention(q, k, v, kp, vp, write, table, base, torch.zeros_like(positions), positions), kp, vp

    try:
        alone = step(1)
        assert torch.equal(alone[0][5], torch.zeros_like(alone[0][5]))
        before = lib.dspark_quant_pool_worker_runs()
        for _ in range(500):  # on a loaded box a worker may miss a short call: its caller then does it all
            assert all(torch.equal(a, b) for a, b in zip(step(2), alone))
            if lib.dspark_quant_pool_worker_runs() > before:
                break
        else:
            raise AssertionError("the pool's workers computed no pairs in 500 steps")
    finally:
        quant.set_threads(1)


def ring_case(seed: int, slots: int, ring: int, hkv: int, d: int):
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(slots + 1, ring, hkv, d, generator=g)
    v_cache = torch.randn(slots + 1, ring, hkv, d, generator=g)
    return g, k_cache, v_cache


@pytest.mark.parametrize("rows, t, start, hq, hkv, d", [
    (1, 1, 0, 4, 2, 64),  # a slot's first position
    (4, 1, 70, 4, 2, 64),  # one draft token a row, positions past the ring (it wrapped)
    (3, 5, 30, 8, 2, 128),  # a catch-up chunk
    (2, 9, 10, 3, 3, 48),  # no grouping, a head_dim without a vector path
])
def test_ring_step_matches_the_reference(rows, t, start, hq, hkv, d):
    window, ring = 32, 36
    g, k_cache, v_cache = ring_case(2, 6, ring, hkv, d)
    slots = torch.tensor([2, 5, 1, 4][:rows])
    lengths = torch.zeros(7, dtype=torch.int64)
    lengths[slots] = start  # each row continues its slot
    if start + t < ring - 1:  # stale contents past a slot's length are never read
        k_cache[slots[0], ring - 1] = float("nan")
    positions = start + torch.arange(t).repeat(rows, 1)
    if rows > 1 and t > 1:
        positions[1, -2:] = -1  # padding: neither written nor attended
    qs = [torch.randn(rows, t, hq, d, generator=g) for _ in range(2)]
    ks = [torch.randn(rows, t, hkv, d, generator=g) for _ in range(2)]
    vs = [torch.randn(rows, t, hkv, d, generator=g) for _ in range(2)]
    want_k, want_v, want_len = [k_cache.clone(), k_cache.clone()], [v_cache.clone(), v_cache.clone()], lengths.clone()
    want_len.scatter_reduce_(0, slots, (positions.amax(1) + 1).clamp_min(0), reduce="amax")
    wants = []
    for layer in range(2):  # two layers: the second sees the lengths the first grew
        reference.ring_write(want_k[layer], want_v[layer], slots, positions, ks[layer], vs[layer])
        wants.append(reference.window_attention(qs[layer], want_k[layer], want_v[layer], slots, positions, want_len,
                                                window, d ** -0.5))
    caches_k, caches_v = [k_cache.clone(), k_cache.clone()], [v_cache.clone(), v_cache.clone()]
    step = cpu.RingStep(caches_k, caches_v, slots, positions, lengths, window)
    for layer in range(2):
        got = step(layer, qs[layer], ks[layer], vs[layer])
        torch.testing.assert_close(got, wants[layer], rtol=1e-5, atol=1e-5)
        assert not got.isnan().any()
        assert torch.equal(caches_k[layer].nan_to_num(), want_k[layer].nan_to_num())
        assert torch.equal(caches_v[layer], want_v[layer])
    assert torch.equal(lengths, want_len)


def test_bad_indices_are_refused_and_nothing_is_written():
    k_pool, v_pool, table, slots, positions, write, q, k, v = paged_case(3, 2, 2, 10, 4, 2, 64)
    before = k_pool.clone(), v_pool.clone()
    bad_write = write.clone()
    bad_write[-1] = k_pool.shape[0]
    with pytest.raises(cpu.CpuKernelError, match="write index is outside"):
        cpu.paged_attention(q, k, v, k_pool, v_pool, bad_write, table, slots * table.shape[1],
                            torch.zeros_like(positions), positions)
    bad_table = table.clone()
    bad_table[2, 0] = 10**6
    with pytest.raises(cpu.CpuKernelError, match="key index is outside"):
        cpu.paged_attention(q, k, v, k_pool, v_pool, write, bad_table, slots * table.shape[1],
                            torch.zeros_like(positions), positions)
    assert torch.equal(k_pool, before[0]) and torch.equal(v_pool, before[1])
    with pytest.raises(cpu.CpuKernelError, match="int64"):
        cpu.paged_attention(q, k, v, k_pool, v_pool, write.int(), table, slots * table.shape[1],
                            torch.zeros_like(positions), positions)

    _, k_cache, v_cache = ring_case(4, 3, 8, 2, 64)
    cache_before, lengths = k_cache.clone(), torch.zeros(4, dtype=torch.int64)
    x = torch.randn(1, 1, 4, 64)
    with pytest.raises(cpu.CpuKernelError, match="slot is outside"):
        cpu.ring_attention(x, x[:, :, :2], x[:, :, :2], k_cache, v_cache, torch.tensor([4]), torch.tensor([[0]]),
                           lengths, 4)
    assert torch.equal(k_cache.nan_to_num(), cache_before.nan_to_num()) and not lengths.any()


def test_the_kernels_are_off_when_turned_off_or_the_reference_is_forced(monkeypatch):
    x = torch.zeros(2)
    assert cpu.takes(x) and not cpu.takes(x.double())
    with ops.use_backend("reference"):
        assert not cpu.takes(x)
    monkeypatch.setenv("DSPARK_CPU_KERNELS", "0")
    assert not cpu.takes(x)


def test_a_fresh_build_and_a_missing_compiler(tmp_path, monkeypatch, caplog):
    """A new cache folder gets its own build; without a compiler the kernels are off, with a warning."""
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path))
    cpu.library.cache_clear()
    try:
        assert cpu.library() is not None and len(list(tmp_path.glob("cpu_kernels-*.so"))) == 1
        cpu.library.cache_clear()
        monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
        with caplog.at_level(logging.WARNING, logger="dspark_kernels.cpu"):
            assert cpu.library() is None and not cpu.takes(torch.zeros(1))
        assert "no C compiler" in caplog.text
    finally:
        monkeypatch.undo()
        cpu.library.cache_clear()
    assert cpu.library() is not None


def test_the_engine_attends_on_the_kernels_and_greedy_output_equals_the_torch_path():
    """The shipped pair in float32: every attention layer of the target and the draft runs on the
    kernels, and speculative greedy output is the torch path's, token for token."""
    common = dict(model=str(shipped(SHIPPED_TARGET, "model.safetensors")), capacity=8, max_context=160,
                  draft=str(shipped(SHIPPED_DRAFT, "model.safetensors")), adaptive_speculation=False,
                  dtype="float32", draft_dtype="float32")
    prompts = ["ROMEO:\nWhat light", "First Citizen:\nWe are", "KING", "To be, or not to be"]
    params = SamplingParams(max_tokens=96, temperature=0, ignore_eos=True)
    calls = {"paged": 0, "ring": 0}
    paged_call, ring_call = cpu.PagedStep.__call__, cpu.RingStep.__call__

    def run() -> dict[int, list[int]]:
        engine = build_local_engine(EngineConfig(**common))
        ids = {engine.add_request(p, params): i for i, p in enumerate(prompts)}
        out: dict[int, list[int]] = {i: [] for i in ids.values()}
        while engine.has_unfinished():
            for o in engine.step():
                out[ids[o.req_id]].extend(o.new_token_ids)
        return out

    def counted(kind, call):
        def wrapper(self, *args):
            calls[kind] += 1
            return call(self, *args)
        return wrapper

    mp = pytest.MonkeyPatch()
    mp.setattr(cpu.PagedStep, "__call__", counted("paged", paged_call))
    mp.setattr(cpu.RingStep, "__call__", counted("ring", ring_call))
    try:
        with_kernels = run()
    finally:
        mp.undo()
    assert calls["paged"] > 0 and calls["paged"] % 8 == 0  # the target's 8 layers, every step
    assert calls["ring"] > 0 and calls["ring"] % 2 == 0  # the draft's 2 layers, every pass
    with ops.use_backend("reference"):
        torch_path = run()
    assert with_kernels == torch_path
    assert all(len(tokens) == 96 for tokens in torch_path.values())


# -- bfloat16 weight copies for small matmuls (csrc/cpu_gemm.c) ---------------------------------------


def bf16_valued(*shape: int, seed: int = 0) -> torch.Tensor:
    """A float32 tensor of bfloat16 values (a bfloat16 checkpoint loaded in float32)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16).float()


@pytest.mark.parametrize("out_features, in_features", [(512, 256), (256, 768), (4096, 256), (100, 37), (64, 1)])
def test_bf16_gemm_is_the_float32_matmul_and_each_row_its_own(out_features, in_features):
    """The bfloat16 copy of a weight of bfloat16 values computes the float32 matmul (up to the order of
    the sums), for every row count and for widths that leave a partial panel; each row's bits are the
    same alone as beside any others (a request's logits do not depend on its batch)."""
    weight, bias = bf16_valued(out_features, in_features), torch.randn(out_features)
    gemm = cpu.Bf16Gemm(weight)
    x = torch.randn(13, in_features, generator=torch.Generator().manual_seed(1))
    alone = torch.cat([gemm(x[i:i + 1]) for i in range(13)])
    for rows in (1, 2, 5, 6, 7, 12, 13):
        got = gemm(x[:rows])
        torch.testing.assert_close(got, x[:rows] @ weight.T, rtol=1e-5, atol=1e-4)
        assert torch.equal(got, alone[:rows])
    torch.testing.assert_close(gemm(x.view(13, 1, in_features), bias), (x @ weight.T + bias)[:, None],
                               rtol=1e-5, atol=1e-4)
    with pytest.raises(cpu.CpuKernelError, match="bfloat16 values"):
        cpu.Bf16Gemm(weight + 1e-3)
    with pytest.raises(cpu.CpuKernelError, match="float32"):
        gemm(x.double())


def test_linears_of_bf16_values_get_copies_used_for_their_small_calls(monkeypatch):
    """``pack_weights`` gives every linear a bfloat16 copy when all the model's float32 weights hold
    bfloat16 values (the shipped pair: a bfloat16 checkpoint) and the copies fit the cap; calls of up to
    BF16_MAX_ROWS rows (on one torch thread, BF16_MAX_ROWS_ONE_THREAD) run on it (bit for bit its kernel;
    after the weight changes in place they still see the copy), larger ones as before. Otherwise no
    copies."""
    import torch.nn.functional as F

    from dspark_ray.model import cpu_gemm
    from dspark_ray.model.loader import load

    model = load(shipped(SHIPPED_DRAFT, "model.safetensors"), dtype="float32")
    gemms = [model.lm_gemm, model.model.layers[0].self_attn.o_proj.gemm, model.model.layers[1].mlp.down_proj.gemm]
    assert all(g.bf16 is not None for g in gemms)
    gemm = gemms[1]
    small = torch.randn(cpu_gemm.BF16_MAX_ROWS, gemm.weight.shape[1])
    large = torch.randn(cpu_gemm.BF16_MAX_ROWS + 1, gemm.weight.shape[1])
    torch.testing.assert_close(gemm(small), F.linear(small, gemm.weight), rtol=1e-5, atol=1e-4)
    assert torch.equal(gemm(small), cpu.Bf16Gemm(gemm.weight)(small))  # the copy's kernel, bit for bit
    most = torch.randn(cpu_gemm.BF16_MAX_ROWS_ONE_THREAD, gemm.weight.shape[1])
    beyond = torch.randn(cpu_gemm.BF16_MAX_ROWS_ONE_THREAD + 1, gemm.weight.shape[1])
    saved, threads = gemm.bf16.packed.clone(), torch.get_num_threads()
    gemm.bf16.packed.zero_()  # a call that runs on the copy now gives zeros
    try:
        torch.set_num_threads(2)
        assert not gemm(small).any() and gemm(large).all()  # past BF16_MAX_ROWS: as before
        torch.set_num_threads(1)  # one thread: the copy up to BF16_MAX_ROWS_ONE_THREAD rows
        assert not gemm(large).any() and not gemm(most).any() and gemm(beyond).all()
    finally:
        torch.set_num_threads(threads)
        gemm.bf16.packed.copy_(saved)
    before = gemm(small)
    with torch.no_grad():
        gemm.weight.mul_(2)  # the parameter changes; the copy does not
    try:
        assert torch.equal(gemm(small), before)
    finally:
        with torch.no_grad():
            gemm.weight.div_(2)

    monkeypatch.setattr(cpu_gemm, "BF16_COPY_MAX_BYTES", 1000)
    assert cpu_gemm.PackedGemm(gemm.weight).bf16 is None
    assert not cpu_gemm.bf16_copies([gemm.weight])  # over the cap
    monkeypatch.undo()
    assert cpu_gemm.bf16_copies([gemm.weight]) and not cpu_gemm.bf16_copies([gemm.weight + 1e-3])
    assert not cpu_gemm.bf16_copies([gemm.weight.to(torch.bfloat16)])  # bfloat16 weights need no copy
    with ops.use_backend("reference"):
        assert not cpu_gemm.bf16_copies([gemm.weight])


def test_a_long_prompt_chunk_takes_the_torch_path_and_the_same_tokens_come_out():
    """A step with a row feeding more than NATIVE_MAX_FED tokens attends through torch (its SDPA is
    faster for a long causal prefill); decode steps after it take the kernel, and the greedy tokens are
    the torch path's."""
    from dspark_ray.engine import target_runner

    config = EngineConfig(model=str(shipped(SHIPPED_TARGET, "model.safetensors")), capacity=2, max_context=256,
                          dtype="float32")
    prompt = "ROMEO:\n" + "But soft, what light through yonder window breaks? " * 12
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    native_steps = []
    step = target_runner.TargetRunner._native_step

    def counted(self, write, slots, positions):
        out = step(self, write, slots, positions)
        native_steps.append((len(positions), out is not None))
        return out

    def run() -> list[int]:
        engine = build_local_engine(config)
        engine.add_request(prompt, params)
        tokens = []
        while engine.has_unfinished():
            for o in engine.step():
                tokens += o.new_token_ids
        return tokens

    mp = pytest.MonkeyPatch()
    mp.setattr(target_runner.TargetRunner, "_native_step", counted)
    try:
        with_kernels = run()
    finally:
        mp.undo()
    assert len(build_local_engine(config).tokenizer.encode(prompt)) > target_runner.NATIVE_MAX_FED
    assert native_steps and all(n <= target_runner.NATIVE_MAX_FED and used for n, used in native_steps)
    with ops.use_backend("reference"):
        assert with_kernels == run()

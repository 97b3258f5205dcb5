"""bench/served.py: the side-by-side serving benchmark (dspark served, vLLM served, in process).

The pure parts run on real output kept small in tests/data/:

- ``vllm_bench_serve_*.json``: what ``vllm bench serve --save-result
  --save-detailed`` wrote in one run of bench/served.py against ``serve run
  deploy/dspark.yaml`` (dspark) and ``vllm serve`` (vllm), 16 prompts at
  concurrency 8, and against a closed port (every request failed); the
  per-request lists dropped and the tracebacks shortened, the figures untouched;
- ``dspark_stats_timeline.json``: the served app's ``GET /stats`` timeline read
  before and after that dspark level.

The last test runs vLLM's benchmark client, unmodified, against a real
``serve run`` (tests/serve_fixtures.py) when bench/.vllm-venv is there.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from dspark_ray.serve.timeline import per_step_ms

sys.path.insert(0, str(REPO / "bench"))
import served as bench  # noqa: E402
from metrics import RequestTrace  # noqa: E402
from serve_fixtures import ServeModels, ServeRun, serve_models, served  # noqa: E402,F401 - fixtures

DATA = Path(__file__).resolve().parent / "data"


def load(name: str) -> dict:
    return json.loads((DATA / name).read_text())


@pytest.fixture(scope="module")
def vllm_result() -> dict:
    return load("vllm_bench_serve_vllm_c8.json")


@pytest.fixture(scope="module")
def dspark_result() -> dict:
    return load("vllm_bench_serve_dspark_c8.json")


@pytest.fixture(scope="module")
def timeline() -> dict:
    return load("dspark_stats_timeline.json")


# -- vLLM's result file into rows --------------------------------------------------------------


def test_row_reads_the_client_figures(vllm_result):
    row = bench.Row.from_vllm_result("vllm", vllm_result)
    assert (row.system, row.concurrency) == ("vllm", vllm_result["max_concurrency"]) == ("vllm", 8)
    assert (row.completed, row.failed) == (vllm_result["completed"], vllm_result["failed"]) == (16, 0)
    assert row.output_tok_s == vllm_result["output_throughput"]
    assert row.request_s == vllm_result["request_throughput"]
    assert row.duration_s == vllm_result["duration"]
    assert (row.ttft_mean, row.ttft_p50, row.ttft_p99) == (
        vllm_result["mean_ttft_ms"], vllm_result["p50_ttft_ms"], vllm_result["p99_ttft_ms"])
    assert (row.tpot_mean, row.tpot_p50) == (vllm_result["mean_tpot_ms"], vllm_result["p50_tpot_ms"])
    assert (row.itl_p50, row.itl_p99) == (vllm_result["p50_itl_ms"], vllm_result["p99_itl_ms"])
    assert row.acceptance_length == vllm_result["spec_decode_acceptance_length"] > 1
    assert row.errors == {}


def test_the_fixture_is_the_clients_own_arithmetic(vllm_result, dspark_result):
    """The figures the rows take agree with the per-request data beside them (seconds vs ms, tokens)."""
    for data in (vllm_result, dspark_result):
        ttfts = data["ttfts"]
        assert len(ttfts) == data["completed"] == data["num_prompts"]
        assert data["mean_ttft_ms"] == pytest.approx(1e3 * sum(ttfts) / len(ttfts))
        assert data["output_lens"] == [64] * data["completed"]
        assert data["total_output_tokens"] == 64 * data["completed"]
        assert data["output_throughput"] == pytest.approx(data["total_output_tokens"] / data["duration"])
        assert data["request_throughput"] == pytest.approx(data["completed"] / data["duration"])


def test_dspark_served_row(dspark_result):
    row = bench.Row.from_vllm_result("dspark", dspark_result)
    assert row.label == "dspark_ray served"
    assert (row.completed, row.failed, row.concurrency) == (16, 0, 8)
    assert row.output_tokens == 16 * 64
    assert row.acceptance_length is None  # dspark publishes no vllm:spec_decode counters on /metrics
    assert row.ttft_p99 == dspark_result["p99_ttft_ms"]


def test_failed_requests_are_counted_and_leave_no_latencies():
    data = load("vllm_bench_serve_failed.json")
    row = bench.Row.from_vllm_result("dspark", data)
    assert (row.completed, row.failed) == (0, 2)
    # vLLM writes 0.0 for every latency when nothing completed; a row must not show that as a figure.
    assert data["mean_ttft_ms"] == 0.0
    assert row.ttft_mean is row.ttft_p99 is row.tpot_mean is row.itl_p50 is None
    [(message, count)] = row.errors.items()
    assert count == 2 and message.startswith("aiohttp.client_exceptions.ClientConnectorError")
    line = next(line for line in bench.rows_table([row]).splitlines() if line.startswith("| dspark_ray served"))
    assert line.endswith("| - | - | - | - | - | - | - | - | 0 | 2 |")


def test_error_counts_by_last_line():
    tb = "Traceback (most recent call last):\n  File x\nValueError: boom\n"
    assert bench.error_counts(["", None, tb, tb, "Bad Request"]) == {"ValueError: boom": 2, "Bad Request": 1}


# -- the timeline ---------------------------------------------------------------------------------


def test_timeline_is_per_step_ms_of_the_two_snapshots(dspark_result, timeline):
    before, after = timeline["before"], timeline["after"]
    row = bench.measured_row("dspark", dspark_result, before, after)
    assert row.timeline_ms == per_step_ms(before, after)
    steps = after["step"]["count"] - before["step"]["count"]
    assert row.steps == steps > 0
    for phase in ("step", "propose", "verify", "schedule", "commit", "deliver", "loop"):
        expected = 1e3 * (after[phase]["seconds"] - before[phase]["seconds"]) / steps
        assert row.timeline_ms[phase] == pytest.approx(expected)
    # The parts of a step cannot add up to more than the step.
    parts = sum(row.timeline_ms[p] for p in ("schedule", "propose", "verify", "commit"))
    assert parts <= row.timeline_ms["step"] * 1.001

    table = bench.timeline_table([row])
    phases = [line.split("|")[1].strip() for line in table.splitlines()[2:] if not line.startswith("| (")]
    assert phases == sorted(after)  # every phase the server publishes, sorted
    assert f"| (engine steps) | {steps} |" in table
    assert f"| (output tokens per step) | {16 * 64 / steps:.2f} |" in table


def test_no_timeline_without_two_snapshots(vllm_result, timeline):
    row = bench.measured_row("vllm", vllm_result, None, timeline["after"])
    assert row.timeline_ms == {} and row.steps is None
    assert bench.timeline_table([row]) == ""


# -- in process, ratios, the report ---------------------------------------------------------------


def trace(sent: float, arrivals: list[float], tokens: int, drafts: int = 0, accepted: int = 0) -> RequestTrace:
    t = RequestTrace(sent=sent, output_tokens=tokens, drafts=drafts, accepted_tokens=accepted)
    for a in arrivals:
        t.deliver(a, 0)
    return t


def test_row_from_traces_arithmetic():
    traces = [trace(0.0, [0.010, 0.030, 0.070], 9, drafts=2, accepted=6),
              trace(0.0, [0.020, 0.040, 0.060], 5, drafts=2, accepted=2),
              trace(0.0, [], 0)]
    traces[2].error = "engine error"
    row = bench.row_from_traces("inprocess", 2, traces, seconds=0.1)
    assert (row.completed, row.failed, row.errors) == (2, 1, {"engine error": 1})
    assert row.output_tokens == 14 and row.output_tok_s == pytest.approx(140.0)
    assert row.request_s == pytest.approx(20.0)
    assert row.ttft_mean == pytest.approx(15.0) and row.ttft_p50 == pytest.approx(15.0)
    assert row.tpot_mean == pytest.approx((60 / 8 + 40 / 4) / 2)
    assert row.itl_p50 == pytest.approx(20.0)  # gaps 20, 40, 20, 20 ms
    assert row.acceptance_length == pytest.approx(1 + 8 / 4)


def test_ratios_and_tables(vllm_result, dspark_result):
    d = bench.Row.from_vllm_result("dspark", dspark_result)
    v = bench.Row.from_vllm_result("vllm", vllm_result)
    i = bench.Row("inprocess", 8, 16, 0, 1.0, output_tok_s=2 * d.output_tok_s, request_s=16.0)
    only = bench.Row("inprocess", 1, 8, 0, 1.0, output_tok_s=100.0, request_s=8.0)
    q8, q1 = {q.concurrency: q for q in bench.ratios([d, v, i, only])}[8], bench.ratios([only])[0]
    assert q8.vs_vllm == pytest.approx(d.output_tok_s / v.output_tok_s)
    assert q8.vs_inprocess == pytest.approx(0.5)
    assert (q8.ttft_dspark, q8.ttft_vllm) == (d.ttft_mean, v.ttft_mean)
    assert q1.vs_vllm is None and q1.vs_inprocess is None

    table = bench.ratio_table([d, v, i, only])
    line8 = next(line for line in table.splitlines() if line.startswith("| 8 |"))
    assert f"| {d.output_tok_s / v.output_tok_s:.2f}x |" in line8 and "| 0.50x |" in line8
    assert next(line for line in table.splitlines() if line.startswith("| 1 |")).startswith("| 1 | - | - | - | 100.0 |")
    rows = bench.rows_table([i, v, d]).splitlines()[2:]
    assert [r.split("|")[1].strip() for r in rows] == ["dspark_ray served", "vLLM served", "dspark_ray in-process"]


def test_report_files(tmp_path, monkeypatch, vllm_result, dspark_result, timeline):
    monkeypatch.setattr(bench, "OUT_DIR", tmp_path)
    report = bench.Report(machine="test box", workload={"input_len": 24, "output_len": 64, "seed": 0,
                                                          "num_prompts": 16, "warmup_prompts": None})
    report.rows = [bench.measured_row("dspark", dspark_result, timeline["before"], timeline["after"]),
                   bench.Row.from_vllm_result("vllm", vllm_result)]
    report.commands.append("vllm bench serve ...")
    report.notes.append("a note")
    report.save()
    md = (tmp_path / "served.md").read_text()
    assert md.startswith("Machine: test box.") and "dspark / vLLM" in md and "ms/step" in md
    assert "```\nvllm bench serve ...\n```" in md and "Note: a note" in md
    data = json.loads((tmp_path / "served.json").read_text())
    assert [r["system"] for r in data["rows"]] == ["dspark", "vllm"]
    assert data["rows"][0]["timeline_ms"] == pytest.approx(per_step_ms(timeline["before"], timeline["after"]))
    [ratio] = data["ratios"]
    assert ratio["vs_vllm"] == pytest.approx(dspark_result["output_throughput"] / vllm_result["output_throughput"])


# -- commands and configs ---------------------------------------------------------------------------


def test_client_command_and_how_it_is_shown(tmp_path):
    cli = [str(bench.VLLM_VENV / "bin" / "python"), "-c", bench.VLLM_SHIM]
    w = bench.Workload(num_prompts=None)
    cmd = bench.client_command(cli, "http://127.0.0.1:8123", "shakespeare-target", bench.REPO / "models" / "t",
                                w, 8, w.prompts(8), tmp_path, "r.json")
    assert w.prompts(1) == 16 and w.prompts(8) == 32 and bench.Workload(num_prompts=5).prompts(32) == 5
    text = bench.show(cmd)
    assert text.startswith("vllm bench serve --backend openai --base-url http://127.0.0.1:8123 "
                           "--endpoint /v1/completions --model shakespeare-target --tokenizer models/t ")
    for flags in ("--dataset-name random", "--random-input-len 24", "--random-output-len 64", "--ignore-eos",
                  "--temperature 0", "--num-prompts 32", "--max-concurrency 8", "--save-result",
                  f"--result-dir {tmp_path}", "--result-filename r.json"):
        assert f" {flags}" in text


def test_vllm_server_command():
    app = {"model": "/m/target", "draft": "/m/draft", "k": 4, "name": "shakespeare-target"}
    cmd = bench.vllm_server_command(["vllm"], app, "shakespeare-target", 9000)
    spec = json.loads(cmd[cmd.index("--speculative-config") + 1])
    assert spec == {"method": "draft_model", "model": "/m/draft", "num_speculative_tokens": 4}
    assert cmd[:3] == ["vllm", "serve", "/m/target"] and "--enforce-eager" in cmd
    assert cmd[cmd.index("--dtype") + 1] == "float32" and cmd[cmd.index("--host") + 1] == "127.0.0.1"
    env = bench.vllm_server_env(2)
    assert env["HF_HUB_OFFLINE"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_serve_yaml_changes_only_the_http_options(tmp_path):
    import yaml

    shipped = yaml.safe_load(bench.DEFAULT_YAML.read_text())
    if shipped["http_options"] == {"host": "127.0.0.1", "port": 8000}:
        assert bench.serve_yaml(bench.DEFAULT_YAML, 8000, tmp_path) == bench.DEFAULT_YAML
    copy = bench.serve_yaml(bench.DEFAULT_YAML, 8123, tmp_path)
    assert copy.parent == tmp_path
    config = yaml.safe_load(copy.read_text())
    assert config.pop("http_options") == {**shipped.pop("http_options"), "host": "127.0.0.1", "port": 8123}
    assert config == shipped


def test_random_prompts_are_seeded_and_skip_special_tokens(serve_models_tokenizer):
    tok = serve_models_tokenizer
    a = bench.random_prompts(tok, 4, 24, seed=0)
    assert a == bench.random_prompts(tok, 4, 24, seed=0) != bench.random_prompts(tok, 4, 24, seed=1)
    assert [len(p) for p in a] == [24] * 4
    vocab = tok.get_vocab()
    special = {vocab[t] for t in tok.special_tokens.values() if t in vocab}
    assert special and not special & {i for p in a for i in p}
    assert all(0 <= i < tok.vocab_size for p in a for i in p)


@pytest.fixture(scope="module")
def serve_models_tokenizer():
    from dspark_ray.tokenizer import Tokenizer

    return Tokenizer.from_path(REPO / "models" / "shakespeare-target")


def test_dspark_bench_served_runs_this_script(capsys):
    from dspark_ray import cli

    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--served", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: dspark bench --served") and "--concurrency" in out and "vllm bench serve" in out
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    assert "--batches" in capsys.readouterr().out  # plain `dspark bench` is still bench/compare.py


# -- vLLM's client against a real `serve run` ---------------------------------------------------------

VLLM_PYTHON = bench.VLLM_VENV / "bin" / "python"


def vllm_installed() -> bool:
    """bench/.vllm-venv exists and has vLLM in it (an install that failed half-way leaves a venv without)."""
    if not VLLM_PYTHON.is_file():
        return False
    probe = [str(VLLM_PYTHON), "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"]
    return subprocess.run(probe, capture_output=True, timeout=120).returncode == 0


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.skipif(not vllm_installed(), reason="bench/.vllm-venv is missing or has no vLLM in it "
                    "(bash bench/setup_vllm.sh installs vLLM's benchmark client; tests/run.sh says if it failed)")
def test_vllm_benchmark_client_against_serve_run(served: ServeRun, serve_models: ServeModels, tmp_path):
    w = bench.Workload(output_len=16, num_prompts=6)
    cmd = bench.client_command(bench.vllm_cli(), served.base_url, served.model, serve_models.target, w,
                                concurrency=3, num_prompts=6, result_dir=tmp_path, result_name="r.json")
    data = bench.run_client(cmd, tmp_path / "r.json", tmp_path / "client.log", timeout_s=600)
    row = bench.Row.from_vllm_result("dspark", data)
    assert row.errors == {}, (tmp_path / "client.log").read_text()[-3000:]
    assert (row.completed, row.failed) == (6, 0)
    assert data["output_lens"] == [16] * 6  # ignore_eos honoured, usage counted
    assert row.ttft_mean is not None and row.output_tok_s > 0
    # The client reads speculation from GET /metrics under vLLM's names: acceptance length in [1, k + 1].
    assert row.acceptance_length is not None and 1.0 <= row.acceptance_length <= 5.0, data.keys()


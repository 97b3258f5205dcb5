"""bench/served.py: the side-by-side serving benchmark (dspark served, vLLM served, in process).

The pure parts run on real output kept small in tests/data/:

- ``vllm_bench_serve_*.json``: what ``vllm bench serve --save-result
  --save-detailed`` wrote in one run of bench/served.py against ``serve run
  deploy/dspark.yaml`` (dspark) and ``vllm serve`` (vllm), 16 prompts at
  concurrency 8, and against a closed port (every request failed); the
  per-request lists dropped and the tracebacks shortened, the figures untouched;
- ``dspark_stats_timeline.json``: the served app's ``GET /stats`` timeline read
  before and after that dspark level.

The rounds (the schedule that interleaves the two servers' runs, the medians
over rounds) are tested on hand-made rows, the idle-CPU sampling on real
processes read from /proc.

vLLM's benchmark client runs, unmodified, against a real ``serve run``
(tests/serve_fixtures.py) when bench/.vllm-venv is there.

The real model's parts: the chat workload (bench/chat_prompts.jsonl is
well-formed and every prompt renders through SmolLM2's chat template; vLLM's own
custom dataset picks the same requests in the same order as ours, and the
exported folder's template renders them as dspark_ray does), the in-process
closed loop on a stand-in engine, vLLM's command line for each --vllm-spec and
--vllm-threads-bind, the export cache on a tiny GGUF file, the bytes of weights
a decode step reads (against the memory planner's count for a quantized file),
the bandwidth / bytes arithmetic, resident memory from /proc.
"""

from __future__ import annotations

import dataclasses

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
import torch

from conftest import REPO
from dspark_ray.runtime.timeline import per_step_ms

sys.path.insert(0, str(REPO / "bench"))
import served as bench  # noqa: E402
from metrics import RequestTrace  # noqa: E402
from serve_fixtures import ServeModels, ServeRun, serve_models, served  # noqa: E402,F401 - fixtures

DATA = Path(__file__).resolve().parent / "data"
SHAKESPEARE = REPO / "deploy" / "shakespeare.yaml"  # the toy pair, with its draft


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
    assert line.endswith("| 0.0 | 0.00 | - | - | - | - | - | - | - | - | - | 0 | 2 |")


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


# -- rounds: the schedule and the medians -------------------------------------------------------------


def test_schedule_interleaves_and_alternates_the_first_system():
    runs = bench.schedule(["dspark", "vllm"], [1, 8], rounds=3)
    assert [(r.round, r.concurrency, r.system) for r in runs] == [
        (1, 1, "dspark"), (1, 1, "vllm"), (1, 8, "dspark"), (1, 8, "vllm"),
        (2, 1, "vllm"), (2, 1, "dspark"), (2, 8, "vllm"), (2, 8, "dspark"),
        (3, 1, "dspark"), (3, 1, "vllm"), (3, 8, "dspark"), (3, 8, "vllm"),
    ]


@pytest.mark.parametrize("systems", [["dspark", "vllm"], ["vllm", "dspark"]])
@pytest.mark.parametrize("levels", [[1], [1, 8, 32]])
@pytest.mark.parametrize("rounds", [1, 2, 5])
def test_schedule_pairs_every_level_of_every_round(systems, levels, rounds):
    runs = bench.schedule(systems, levels, rounds)
    assert len(runs) == len(set(runs)) == len(systems) * len(levels) * rounds
    # The runs of a level in a round follow each other: one of each system, back to back.
    pairs = [runs[i:i + 2] for i in range(0, len(runs), 2)]
    assert all(a.round == b.round and a.concurrency == b.concurrency and {a.system, b.system} == set(systems)
               for a, b in pairs)
    # Rounds in order, levels in order within a round.
    assert [(r.round, r.concurrency) for r in runs] == sorted((r.round, r.concurrency) for r in runs)
    # Who goes first: systems[0] in odd rounds, systems[1] in even ones, at every level.
    first = {(a.round, a.concurrency): a.system for a, _ in pairs}
    assert all(s == systems[(k - 1) % 2] for (k, _), s in first.items())
    counts = Counter(s for s in first.values())
    assert counts[systems[0]] - counts[systems[1]] == (len(levels) if rounds % 2 else 0)


def test_schedule_with_one_system_repeats_it():
    runs = bench.schedule(["vllm"], [1, 8], rounds=2)
    assert [(r.round, r.concurrency, r.system) for r in runs] == [
        (1, 1, "vllm"), (1, 8, "vllm"), (2, 1, "vllm"), (2, 8, "vllm")]


def test_stages_keep_the_in_process_engine_away_from_the_servers():
    assert bench.stages(["dspark", "vllm", "inprocess"], sequential=False) == [["dspark", "vllm"], ["inprocess"]]
    assert bench.stages(["inprocess", "vllm", "dspark"], sequential=False) == [["vllm", "dspark"], ["inprocess"]]
    assert bench.stages(["dspark", "inprocess"], sequential=False) == [["dspark"], ["inprocess"]]
    assert bench.stages(["inprocess"], sequential=False) == [["inprocess"]]
    assert bench.stages(["vllm"], sequential=False) == [["vllm"]]
    assert bench.stages(["dspark", "vllm", "inprocess"], sequential=True) == [["dspark"], ["vllm"], ["inprocess"]]
    assert bench.stages(["vllm", "inprocess", "dspark"], sequential=True) == [["vllm"], ["inprocess"], ["dspark"]]


def test_order_text_says_who_goes_first():
    text = bench.order_text(["vllm", "dspark", "inprocess"], sequential=False)
    assert "up together" in text and "vLLM served first in odd rounds, dspark_ray served first in even" in text
    assert bench.order_text(["dspark", "inprocess"], sequential=False).startswith("dspark_ray served only")
    assert bench.order_text(["inprocess"], sequential=False) == "the in-process engine only"
    assert bench.order_text(["dspark", "vllm"], sequential=True).startswith("--sequential: one system after")


def test_rounds_and_sequential_flags():
    args = bench.parse(["--systems", "vllm", "dspark", "vllm"], None)
    assert (args.rounds, args.sequential, args.systems) == (2, False, ["vllm", "dspark"])
    args = bench.parse(["--rounds", "3", "--sequential"], None)
    assert (args.rounds, args.sequential) == (3, True)
    with pytest.raises(SystemExit):
        bench.parse(["--rounds", "0"], None)


def run_row(system: str, c: int, rnd: int, tok_s: float, ttft: float, itl: tuple[float, float],
            timeline: dict[str, float] | None = None, steps: int | None = None, errors: dict | None = None,
            others_cpu: float | None = None) -> bench.Row:
    """A hand-made run: 16 requests of 64 tokens, its figures as given."""
    return bench.Row(system, c, completed=16, failed=0, duration_s=16 * 64 / tok_s, output_tok_s=tok_s,
                     request_s=16 / (16 * 64 / tok_s), ttft_mean=ttft, ttft_p50=ttft, ttft_p99=2 * ttft,
                     itl_p50=itl[0], itl_p99=itl[1], output_tokens=16 * 64, errors=errors or {},
                     timeline_ms=timeline or {}, steps=steps, others_cpu=others_cpu, round=rnd)


@pytest.fixture
def three_rounds() -> list[bench.Row]:
    """dspark and vLLM at c=8 over three rounds, the machine drifting so that the rounds disagree (ratios
    0.50, 0.72, 0.60); and dspark alone at c=1 (as when vLLM did not start)."""
    return [
        run_row("dspark", 8, 1, 100.0, ttft=50.0, itl=(20.0, 60.0), timeline={"step": 5.0, "verify": 2.0}, steps=10,
                others_cpu=0.02),
        run_row("vllm", 8, 1, 200.0, ttft=30.0, itl=(10.0, 40.0), others_cpu=0.12),
        run_row("vllm", 8, 2, 180.0, ttft=20.0, itl=(8.0, 30.0), others_cpu=0.15),
        run_row("dspark", 8, 2, 130.0, ttft=40.0, itl=(15.0, 50.0), timeline={"step": 4.0, "verify": 1.5}, steps=30,
                errors={"boom": 1}, others_cpu=0.03),
        run_row("dspark", 8, 3, 90.0, ttft=60.0, itl=(25.0, 90.0), timeline={"step": 6.0, "verify": 2.5,
                                                                             "draft.compute": 1.0}, steps=20,
                errors={"boom": 2, "other": 1}, others_cpu=0.01),
        run_row("vllm", 8, 3, 150.0, ttft=35.0, itl=(12.0, 45.0), others_cpu=0.13),
        run_row("dspark", 1, 1, 40.0, ttft=10.0, itl=(9.0, 12.0)),
        run_row("dspark", 1, 2, 44.0, ttft=12.0, itl=(8.0, 11.0)),
    ]


def test_median_rows_over_rounds(three_rounds):
    medians = {(m.system, m.concurrency): m for m in bench.median_rows(three_rounds)}
    assert list(medians) == [("dspark", 1), ("dspark", 8), ("vllm", 8)]
    d, v, d1 = medians["dspark", 8], medians["vllm", 8], medians["dspark", 1]
    assert (d.round, d.runs, v.runs, d1.runs) == (None, 3, 3, 2)
    assert (d.output_tok_s, d.ttft_mean, d.ttft_p99, d.itl_p50, d.itl_p99) == (100.0, 50.0, 100.0, 20.0, 60.0)
    assert (v.output_tok_s, v.ttft_mean, v.itl_p50, v.itl_p99) == (180.0, 30.0, 10.0, 40.0)
    assert (d.others_cpu, v.others_cpu, d1.others_cpu) == (0.02, 0.13, None)
    assert (d1.output_tok_s, d1.ttft_mean, d1.itl_p50) == (42.0, 11.0, 8.5)  # two rounds: the mean of the two
    assert d.tpot_mean is None and d.acceptance_length is None  # no run had one
    assert (d.completed, d.failed, d.output_tokens) == (48, 0, 3 * 16 * 64)
    assert d.duration_s == pytest.approx(16 * 64 / 100 + 16 * 64 / 130 + 16 * 64 / 90)
    assert d.errors == {"boom": 3, "other": 1}
    # The timeline over all 60 steps of the three runs, not the median (nor the mean) of their ms/step.
    assert d.steps == 60
    assert d.timeline_ms == pytest.approx({"step": (5 * 10 + 4 * 30 + 6 * 20) / 60, "verify": (20 + 45 + 50) / 60,
                                           "draft.compute": 20 / 60})
    assert v.timeline_ms == {} and v.steps is None and d1.timeline_ms == {}
    assert "| (engine steps) | 60 |" in bench.timeline_table(list(medians.values()))
    assert f"| (output tokens per step) | {3 * 16 * 64 / 60:.2f} |" in bench.timeline_table([d])


def test_timeline_is_summed_only_over_runs_that_all_have_one(three_rounds):
    d8 = [r for r in three_rounds if r.system == "dspark" and r.concurrency == 8]
    assert bench.summed_timeline(d8)[1] == 60
    d8[1].timeline_ms, d8[1].steps = {}, None  # GET /stats failed around round 2
    assert bench.summed_timeline(d8) == ({}, None)


def test_the_headline_is_the_median_of_the_per_round_ratios(three_rounds):
    q1, q8 = bench.ratios(three_rounds)
    assert [(r.round, r.dspark, r.vllm) for r in q8.rounds] == [(1, 100.0, 200.0), (2, 130.0, 180.0), (3, 90.0, 150.0)]
    assert [r.ratio for r in q8.rounds] == pytest.approx([0.5, 130 / 180, 0.6])
    assert q8.vs_vllm == pytest.approx(0.6)
    # Not the ratio of the medians, which pairs runs of different rounds (dspark's first, vLLM's second).
    assert (q8.dspark, q8.vllm) == (100.0, 180.0) and q8.dspark / q8.vllm == pytest.approx(0.556, abs=1e-3)
    assert (q8.ttft_dspark, q8.ttft_vllm) == (50.0, 30.0)
    assert q1.vs_vllm is None and [r.ratio for r in q1.rounds] == [None, None] and q1.dspark == 42.0
    # A round with one side missing does not count.
    del three_rounds[1]  # vLLM's round 1 at c=8
    q8 = bench.ratios(three_rounds)[1]
    assert [r.ratio for r in q8.rounds] == pytest.approx([None, 130 / 180, 0.6])
    assert q8.vs_vllm == pytest.approx((130 / 180 + 0.6) / 2)


def test_ratios_take_one_run_per_system_level_and_round(three_rounds):
    with pytest.raises(AssertionError, match="one run per system"):
        bench.ratios(three_rounds + [run_row("vllm", 8, 3, 1.0, 1.0, (1.0, 1.0))])
    medians = bench.median_rows(three_rounds)
    assert bench.ratios(three_rounds + medians) == bench.ratios(three_rounds)  # median rows are not runs
    with pytest.raises(AssertionError, match="median_rows takes the runs"):
        bench.median_rows(medians)


def test_report_shows_every_round_and_the_medians(tmp_path, monkeypatch, three_rounds):
    monkeypatch.setattr(bench, "OUT_DIR", tmp_path)
    report = bench.Report(machine="test box", workload={"input_len": 24, "output_len": 64, "seed": 0,
                                                          "num_prompts": 16, "warmup_prompts": None},
                          rows=three_rounds, order=bench.order_text(["dspark", "vllm"], sequential=False),
                          schedule=bench.schedule(["dspark", "vllm"], [8], 3))
    report.save()
    md = (tmp_path / "served.md").read_text()
    assert "3 rounds per level; dspark_ray served and vLLM served up together" in md
    headline = md[md.index("| concurrency | dspark_ray served tok/s"):].split("\n\n")[0].splitlines()
    assert headline[3] == "| 8 | 100.0 | 180.0 | 0.60x | - | - | 50.0 ms vs 30.0 ms |"
    per_round = md[md.index("Per round"):].split("\n\n")[1].splitlines()
    assert per_round[2:] == ["| 1 | 1 | 40.0 | - | - |", "| 1 | 2 | 44.0 | - | - |", "| 1 | median | 42.0 | - | - |",
                             "| 8 | 1 | 100.0 | 200.0 | 0.50x |", "| 8 | 2 | 130.0 | 180.0 | 0.72x |",
                             "| 8 | 3 | 90.0 | 150.0 | 0.60x |", "| 8 | median | 100.0 | 180.0 | 0.60x |"]
    medians = md[md.index("Medians over the rounds"):].split("\n\n")[1]
    assert "| dspark_ray served | 8 | median of 3 | 100.0 |" in medians
    assert "| 20.0 | 60.0 | - | 0.020 | 48 | 0 |" in medians  # ITL p50, p99, others' CPU medians; completed summed
    every = md[md.index("Every run"):].split("\n\n")[1].splitlines()[2:]
    assert [line.split("|")[1:4] for line in every][2:5] == [[" dspark_ray served ", " 8 ", f" {k} "] for k in "123"]
    assert "| (engine steps) | 60 |" in md
    data = json.loads((tmp_path / "served.json").read_text())
    assert len(data["rows"]) == 8 and [r["round"] for r in data["rows"]][:3] == [1, 1, 2]
    assert [(m["system"], m["concurrency"], m["runs"]) for m in data["medians"]] == [
        ("dspark", 1, 2), ("dspark", 8, 3), ("vllm", 8, 3)]
    q8 = data["ratios"][1]
    assert q8["vs_vllm"] == pytest.approx(0.6)
    assert [r["ratio"] for r in q8["rounds"]] == pytest.approx([0.5, 130 / 180, 0.6])
    assert [(r["round"], r["system"]) for r in data["schedule"]][:4] == [(1, "dspark"), (1, "vllm"), (2, "vllm"),
                                                                         (2, "dspark")]


# -- the servers' idle CPU, from /proc ---------------------------------------------------------------


def test_process_table_sees_this_process():
    table = bench.process_table()
    me = table[os.getpid()]
    assert me.ppid == os.getppid() and me.ticks > 0  # importing torch and friends took CPU
    assert bench.process_name(os.getpid()).startswith("python")
    assert bench.process_name(999_999_999) == "pid 999999999"


def test_server_trees_give_dspark_everything_else_below_this_script():
    """vLLM's tree is what is below ``vllm serve``; dspark's is ``serve run`` and every other process this
    script started (its Ray head), never vLLM's nor this script itself."""
    vllm = subprocess.Popen(["sh", "-c", "sleep 30 & wait"], start_new_session=True)
    serve_run = subprocess.Popen(["sleep", "30"], start_new_session=True)
    ray_head = subprocess.Popen(["sleep", "30"], start_new_session=True)  # as ray.init starts gcs_server, raylet
    servers = {"dspark": SimpleNamespace(proc=serve_run), "vllm": SimpleNamespace(proc=vllm)}
    try:
        deadline = time.monotonic() + 10
        while len(bench.descendants(vllm.pid, table := bench.process_table())) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        trees = bench.server_trees(servers, table)
        assert trees["vllm"] == bench.descendants(vllm.pid, table) and len(trees["vllm"]) == 2
        assert {serve_run.pid, ray_head.pid} <= trees["dspark"]
        assert not trees["dspark"] & trees["vllm"] and os.getpid() not in trees["dspark"]
        assert bench.server_trees({"vllm": servers["vllm"]}, table) == {"vllm": trees["vllm"]}
    finally:
        for proc in (vllm, serve_run, ray_head):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_descendants_and_their_cpu(tmp_path):
    """A tree with a grandchild, and a busy process beside it: the tree is found whole, and the busy one
    shows about a core while the sleeping tree shows none."""
    sleeping = subprocess.Popen(["sh", "-c", "sleep 30 & sleep 30 & wait"], start_new_session=True)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while len(tree := bench.descendants(sleeping.pid, bench.process_table())) < 3:
            assert time.monotonic() < deadline, tree
            time.sleep(0.05)
        assert sleeping.pid in tree and busy.pid not in tree
        assert bench.descendants(sleeping.pid, {}) == set()
        before = bench.process_table()
        time.sleep(1.0)
        after = bench.process_table()
        assert bench.cpu_cores(tree, before, after, 1.0) < 0.05
        assert bench.cpu_cores({busy.pid}, before, after, 1.0) > 0.3  # a core, less what neighbours take
        assert bench.cpu_cores({busy.pid, 999_999_999}, before, after, 1.0) == bench.cpu_cores(
            {busy.pid}, before, after, 1.0)  # a pid in neither table counts nothing
    finally:
        for proc in (sleeping, busy):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_cpu_by_name_and_the_machines_idle_cores():
    """Two busy processes of one kind and a sleeping one: the kind shows about two cores' worth less what the
    machine's other work takes, the sleeper is left out, and the machine's idle falls by what they took."""
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True) for _ in range(2)]
    sleeping = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        time.sleep(0.3)
        before, machine = bench.process_table(), bench.cpu_times()
        time.sleep(1.5)
        after, machine_after = bench.process_table(), bench.cpu_times()
        pids = {p.pid for p in busy} | {sleeping.pid, 999_999_999}
        by = bench.cpu_by_name(pids, before, after, 1.5)
        assert list(by) == [bench.process_name(busy[0].pid)] and by[bench.process_name(busy[0].pid)] > 0.6
        cpus = os.cpu_count()
        idle = bench.machine_idle_cores(machine, machine_after, cpus)
        assert 0 <= idle <= cpus - by[bench.process_name(busy[0].pid)] + 0.2
    finally:
        for proc in (*busy, sleeping):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.parametrize("says_so", [True, False])
def test_run_client_calls_on_start_when_the_measured_requests_begin(tmp_path, says_so):
    """A stand-in client that takes 0.6 s to start, then logs what vllm bench serve logs, runs 0.6 s and
    writes its result: the CPU window opens at the log line, not at the launch (nor after the end); a
    client that never logs it opens the window when it ends."""
    script = ("import json, sys, time; time.sleep(0.6); "
              + (f"print({bench.CLIENT_STARTS + '...'!r}, flush=True); " if says_so else "")
              + "time.sleep(0.6); json.dump({'completed': 1}, open(sys.argv[1], 'w'))")
    result, log, called = tmp_path / "r.json", tmp_path / "client.log", []
    t0 = time.monotonic()
    data = bench.run_client([sys.executable, "-c", script, str(result)], result, log,
                            on_start=lambda: called.append(time.monotonic() - t0))
    ended = time.monotonic() - t0
    assert data == {"completed": 1} and len(called) == 1
    if says_so:
        assert 0.55 < called[0] < ended - 0.3
    else:
        assert called[0] > 1.1


def test_cpu_times_reads_proc_stats_first_line():
    # proc(5): cpu user nice system idle iowait irq softirq steal guest guest_nice
    text = "cpu  100 5 20 800 30 0 7 2 0 0\ncpu0 50 2 10 400 15 0 3 1 0 0\n"
    assert bench.cpu_times(text) == (830, 964)
    assert bench.machine_idle_cores((830, 964), (830 + 150, 964 + 200), cpus=2) == pytest.approx(1.5)
    assert bench.machine_idle_cores((1, 10), (1, 10), cpus=2) == 0.0
    with pytest.raises(ValueError):
        bench.cpu_times("intr 1 2 3\n")
    idle, total = bench.cpu_times()  # this machine's
    assert 0 < idle < total


def test_the_report_shows_each_runs_cpu(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "OUT_DIR", tmp_path)
    report = bench.Report(machine="test box", workload={"input_len": 24, "output_len": 64, "seed": 0,
                                                          "num_prompts": 16, "warmup_prompts": None})
    served = run_row("dspark", 8, 1, 100.0, ttft=50.0, itl=(20.0, 60.0))
    served.own_cpu = {"ray::TargetShard": 0.76, "ray::DraftWorker": 0.46, "ray::ServeReplica": 0.14,
                      "gcs_server": 0.02, "raylet": 0.01}
    served.idle_cores = 0.42
    report.rows = [served, run_row("vllm", 8, 1, 200.0, ttft=30.0, itl=(10.0, 40.0))]
    report.save()
    md = (tmp_path / "served.md").read_text()
    line = next(x for x in md.splitlines() if x.startswith("| dspark_ray served | 8 | 1 | 0.42 |"))
    assert line.endswith("| 1.39 | ray::TargetShard 0.76, ray::DraftWorker 0.46, ray::ServeReplica 0.14, "
                         "gcs_server 0.02 |")  # the four busiest, their total over all
    assert "| vLLM served | 8 |" not in md.split("CPU during each run")[1].split("\n\n")[1]  # not measured
    data = json.loads((tmp_path / "served.json").read_text())
    assert data["rows"][0]["own_cpu"]["ray::TargetShard"] == 0.76 and data["rows"][0]["idle_cores"] == 0.42


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
    assert "--random-range-ratio" not in text  # equal lengths unless asked
    varied = bench.Workload(range_ratio=0.5)
    text = bench.show(bench.client_command(cli, "http://h:1", "m", bench.REPO / "models" / "t", varied, 8, 32,
                                           tmp_path, "r.json"))
    assert " --random-range-ratio 0.5" in text
    lengths = varied.lengths(400, seed=0)
    assert lengths == varied.lengths(400, seed=0) != varied.lengths(400, seed=1)  # seeded
    assert {n for n, _ in lengths} == set(range(12, 37)) and {m for _, m in lengths} == set(range(32, 97))
    assert bench.Workload().lengths(3, seed=0) == [(24, 64)] * 3
    assert varied.output_range() == (32, 96) and bench.Workload().output_range() == (64, 64)


def test_the_replicas_timelines_are_read_from_each_and_summed():
    """Replicas sharing a port each answer GET /stats for themselves: every_replica asks until each has
    answered (a fetch reaching one already seen counts for nothing), summed adds their snapshots."""
    from dspark_ray.runtime.timeline import every_replica, summed

    answers = iter([{"replica": "a", "n": 1}, {"replica": "a", "n": 2}, {"replica": "b", "n": 3},
                    {"replica": "c", "n": 4}])
    seen = every_replica(lambda: next(answers), replicas=2, attempts=5)
    assert seen == {"a": {"replica": "a", "n": 2}, "b": {"replica": "b", "n": 3}}
    assert every_replica(lambda: {"replica": "a"}, replicas=2, attempts=5) is None  # b never answered
    assert every_replica(lambda: None, replicas=1, attempts=5) is None  # a failed fetch
    a = {"step": {"seconds": 1.0, "count": 10}, "verify": {"seconds": 0.5, "count": 10}}
    b = {"step": {"seconds": 3.0, "count": 30}}
    total = summed([a, b])
    assert total == {"step": {"seconds": 4.0, "count": 40}, "verify": {"seconds": 0.5, "count": 10}}
    assert per_step_ms({}, total)["step"] == pytest.approx(100.0)


def test_the_inprocess_run_draws_each_request_length_within_the_range(tmp_path, monkeypatch):
    """--range-ratio reaches the in-process engine: its requests ask for different numbers of tokens,
    each within output_len * (1 -+ r), and the report says so (the real engine, the shipped pair)."""
    monkeypatch.setattr(bench, "OUT_DIR", tmp_path)
    args = bench.parse(["--systems", "inprocess", "--yaml", str(SHAKESPEARE), "--workload", "random",
                        "--concurrency", "2", "--num-prompts", "6", "--input-len", "8", "--output-len", "8",
                        "--range-ratio", "0.5", "--threads", "1", "--name", "rr"], None)
    report = bench.Report(machine="test", workload=dataclasses.asdict(args.workload), name="rr")
    threads = torch.get_num_threads()
    try:
        bench.run_inprocess(args, report)  # sets this process's torch threads
    finally:
        torch.set_num_threads(threads)
    (row,) = report.rows
    wanted = sum(m for _, m in args.workload.lengths(6, args.workload.seed))
    assert row.completed == 6 and row.output_tokens == wanted != 6 * 8  # ignore_eos: each gets its own length
    assert "each length uniform within +-50%" in report.markdown()
    with pytest.raises(SystemExit):
        bench.parse(["--range-ratio", "1.0"], None)


def test_vllm_server_command():
    app = {"model": "/m/target", "draft": "/m/draft", "k": 4, "name": "shakespeare-target", "dtype": "bfloat16"}
    cmd = bench.vllm_server_command(["vllm"], app, "shakespeare-target", 9000)
    spec = json.loads(cmd[cmd.index("--speculative-config") + 1])
    assert spec == {"method": "draft_model", "model": "/m/draft", "num_speculative_tokens": 4}
    assert cmd[:3] == ["vllm", "serve", "/m/target"] and "--enforce-eager" in cmd
    assert cmd[cmd.index("--dtype") + 1] == "bfloat16" and cmd[cmd.index("--host") + 1] == "127.0.0.1"


def test_vllm_runs_in_the_dtype_dspark_resolves(tmp_path):
    """vLLM gets the dtype dspark's target runs in: the YAML's dtype as dspark_ray resolves it."""
    import yaml

    assert bench.app_of(REPO / "deploy" / "dspark.yaml")["dtype"] == "float32"  # auto on CPU
    raw = yaml.safe_load(SHAKESPEARE.read_text())
    raw["applications"][0]["args"]["dtype"] = "bfloat16"
    (tmp_path / "bf16.yaml").write_text(yaml.safe_dump(raw))
    app = bench.app_of(tmp_path / "bf16.yaml")
    assert app["dtype"] == "bfloat16"
    cmd = bench.vllm_server_command(["vllm"], app, app["name"], 9000)
    assert cmd[cmd.index("--dtype") + 1] == "bfloat16"


def test_serve_yaml_changes_only_the_http_address(tmp_path):
    import yaml

    shipped = yaml.safe_load(bench.DEFAULT_YAML.read_text())
    args = shipped["applications"][0]["args"]
    assert (args["http_host"], args["http_port"]) == ("127.0.0.1", 8000)  # the replicas serve HTTP themselves
    assert bench.serve_yaml(bench.DEFAULT_YAML, 8000, tmp_path) == bench.DEFAULT_YAML
    copy = bench.serve_yaml(bench.DEFAULT_YAML, 8123, tmp_path)
    assert copy.parent == tmp_path
    config = yaml.safe_load(copy.read_text())
    assert config["applications"][0]["args"].pop("http_port") == 8123
    args.pop("http_port")
    assert config == shipped
    # A YAML that serves through Serve's proxy gets its http_options moved instead.
    proxied = yaml.safe_load(bench.DEFAULT_YAML.read_text())
    proxied["applications"][0]["args"]["http_port"] = None
    proxied.update(proxy_location="HeadOnly", http_options={"host": "0.0.0.0", "port": 8000})
    (tmp_path / "proxied").mkdir()
    source = tmp_path / "proxied" / "dspark.yaml"
    source.write_text(yaml.safe_dump(proxied))
    moved = yaml.safe_load(bench.serve_yaml(source, 8124, tmp_path).read_text())
    assert moved.pop("http_options") == {"host": "127.0.0.1", "port": 8124}
    proxied.pop("http_options")
    assert moved == proxied


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

@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.vllm
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



def test_served_ab_puts_both_configurations_in_one_serve_config(tmp_path):
    """bench/served_ab.py: A's and B's first applications in one config, on two ports, B renamed
    under /b with its own args kept; a YAML whose replica serves no HTTP of its own is refused."""
    import yaml

    import served_ab

    variant = yaml.safe_load((REPO / "deploy" / "dspark.yaml").read_text())
    shipped = dict(variant["applications"][0]["args"])
    variant["applications"][0]["args"].update(draft_placement="worker", torch_threads=3)
    b_path = tmp_path / "b.yaml"
    b_path.write_text(yaml.safe_dump(variant))
    combined = yaml.safe_load(served_ab.two_apps(REPO / "deploy" / "dspark.yaml", b_path, 8200, tmp_path).read_text())
    a, b = combined["applications"]
    assert (a["name"], a["route_prefix"], a["args"]["http_port"]) == ("dspark", "/", 8200)
    assert (b["name"], b["route_prefix"], b["args"]["http_port"]) == ("dspark-b", "/b", 8201)
    assert (b["args"]["draft_placement"], b["args"]["torch_threads"]) == ("worker", 3)
    marks = ("http_host", "http_port", "worker_env_vars")
    assert {k: v for k, v in a["args"].items() if k not in marks} == \
        {k: v for k, v in shipped.items() if k not in marks}  # deploy/dspark.yaml's
    # Each application's processes carry its mark (replicas: runtime env; workers: worker_env_vars), so that
    # the one not measured can be frozen; the variables a YAML sets itself stay.
    variant["applications"][0]["args"]["worker_env_vars"] = {"GOMP_SPINCOUNT": "1000"}
    b_path.write_text(yaml.safe_dump(variant))
    combined = yaml.safe_load(served_ab.two_apps(REPO / "deploy" / "dspark.yaml", b_path, 8200, tmp_path).read_text())
    a, b = combined["applications"]
    # ... and claims CPUs (bind_cores) in a directory of its own, as it would alone on the machine.
    assert a["args"]["worker_env_vars"] == {served_ab.APP_MARK: "A", "DSPARK_CORES_DIR": str(tmp_path / "cores-A")}
    assert b["args"]["worker_env_vars"] == {"GOMP_SPINCOUNT": "1000", served_ab.APP_MARK: "B",
                                            "DSPARK_CORES_DIR": str(tmp_path / "cores-B")}
    assert [app["runtime_env"]["env_vars"][served_ab.APP_MARK] for app in (a, b)] == ["A", "B"]
    assert combined["proxy_location"] == "Disabled"
    variant["applications"][0]["args"]["http_port"] = None
    b_path.write_text(yaml.safe_dump(variant))
    with pytest.raises(bench.SystemUnavailable, match="http_port"):
        served_ab.two_apps(REPO / "deploy" / "dspark.yaml", b_path, 8200, tmp_path)


def test_processes_with_env_finds_an_application_s_processes_by_its_mark():
    marked = subprocess.Popen(["sleep", "30"], env={**os.environ, "DSPARK_BENCH_APP": "B"})
    other = subprocess.Popen(["sleep", "30"], env={**os.environ, "DSPARK_BENCH_APP": "A"})
    try:
        assert marked.pid in bench.processes_with_env("DSPARK_BENCH_APP", "B")
        assert other.pid not in bench.processes_with_env("DSPARK_BENCH_APP", "B")
        assert os.getpid() not in bench.processes_with_env("DSPARK_BENCH_APP", "B")
    finally:
        for proc in (marked, other):
            proc.kill()
            proc.wait()


def _continued(pid: int) -> str | None:
    """The process's state once it has left "stopped" (SIGCONT, too, is delivered when it next runs)."""
    deadline = time.monotonic() + 5
    while (state := bench.process_state(pid)) == "T" and time.monotonic() < deadline:
        time.sleep(0.01)
    return state


def test_frozen_stops_a_server_s_processes_for_the_run_and_continues_them_however_it_ends():
    """The server not being measured is stopped for the run (its idle polling took a tenth of a core on the
    2-core box), its whole tree, and continued after: on an error too."""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
    sleeper = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        with bench.frozen({busy.pid, sleeper.pid}):
            assert bench.process_state(busy.pid) == bench.process_state(sleeper.pid) == "T"  # stopped
            ticks = bench.process_table()[busy.pid].ticks
            time.sleep(0.3)
            assert bench.process_table()[busy.pid].ticks == ticks  # a stopped process takes no CPU
        # Continued: running, sleeping, or in an uninterruptible wait (D, seen on a loaded CI run).
        assert _continued(busy.pid) in ("R", "S", "D") and _continued(sleeper.pid) in ("R", "S", "D")
        ticks = bench.process_table()[busy.pid].ticks
        time.sleep(0.3)
        assert bench.process_table()[busy.pid].ticks > ticks  # running again
        with pytest.raises(RuntimeError), bench.frozen({busy.pid}):
            raise RuntimeError("the client failed")
        assert _continued(busy.pid) in ("R", "S")
        with bench.frozen({busy.pid, 999_999_999}):  # a process gone meanwhile is no error
            assert bench.process_state(999_999_999) is None
    finally:
        for proc in (busy, sleeper):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _threads_cpus(pid: int) -> set[tuple[int, ...]]:
    """The CPU sets the threads of process ``pid`` may run on (one entry per distinct set)."""
    sets = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            sets.add(tuple(sorted(os.sched_getaffinity(int(tid)))))
        except (ProcessLookupError, FileNotFoundError):
            pass
    return sets


def _processes(prefix: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            except OSError:
                continue
            if cmdline.startswith(prefix):
                found.append(int(entry))
    return found


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs for two replicas' cores")
def test_the_shipped_yaml_binds_each_replica_to_its_worker_s_core(served: ServeRun):
    """deploy/dspark.yaml's bind_cores and bind_replica, served for real: each worker's torch thread holds a
    core of its own, and every thread of each replica's process runs on its worker's core."""
    worker_cores = set()
    for pid in _processes("ray::TargetShard"):
        worker_cores |= {cpus for cpus in _threads_cpus(pid) if len(cpus) == 1}  # the bound torch thread
    replicas = _processes("ray::ServeReplica:dspark:")
    assert len(replicas) == 2 and len(worker_cores) == 2, (replicas, worker_cores)
    replica_cores = [_threads_cpus(pid) for pid in replicas]
    assert all(len(sets) == 1 for sets in replica_cores), replica_cores  # every thread, one binding
    assert {next(iter(sets)) for sets in replica_cores} == worker_cores


# -- the chat workload ---------------------------------------------------------------------------------

import chat_workload  # noqa: E402
import common  # noqa: E402


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from dspark_ray.model.checkpoint import locate
    from dspark_ray.tokenizer import Tokenizer

    return Tokenizer.from_path(locate(chat_workload.MODEL))


def test_the_chat_workload_is_well_formed_and_every_prompt_renders(smollm2_tokenizer):
    """bench/chat_prompts.jsonl: vLLM's custom-dataset lines, ~160 distinct prompts of a few words to ~150,
    each answer's natural length within the cap, and every prompt through SmolLM2's chat template fitting the
    served max_context with its answer."""
    lines = chat_workload.WORKLOAD.read_text(encoding="utf-8").splitlines()
    rows = [json.loads(line) for line in lines]
    assert all(set(r) == {"prompt", "output_tokens"} for r in rows)
    items = chat_workload.load()
    assert 150 <= len(items) <= 200 and len({p.prompt for p in items}) == len(items)
    words = [len(p.prompt.split()) for p in items]
    assert min(words) <= 3 and max(words) >= 120
    lengths = [p.output_tokens for p in items]
    assert all(1 <= n <= chat_workload.MAX_OUTPUT_TOKENS for n in lengths)
    assert len(set(lengths)) > 50  # natural lengths, not one figure
    max_context = bench.app_of(bench.DEFAULT_YAML)["max_context"]
    for p in items:
        text = smollm2_tokenizer.apply_chat_template([{"role": "user", "content": p.prompt}])
        assert p.prompt in text and text.endswith("<|im_start|>assistant\n")
        ids = chat_workload.render(smollm2_tokenizer, p.prompt)
        assert ids == smollm2_tokenizer.encode(text, add_special_tokens=False)
        assert len(ids) + p.output_tokens <= max_context
    assert "must never use them" in chat_workload.__doc__  # held out from the drafter's training recipe


def test_answer_length_stops_before_the_first_end_of_sequence_token():
    assert chat_workload.answer_length([5, 6, 2, 7], frozenset({2})) == 2
    assert chat_workload.answer_length([5, 6, 7], frozenset({2})) == 3
    assert chat_workload.answer_length([2], frozenset({0, 2})) == 0


def test_in_client_order_is_seeded_and_oversamples_like_vllm():
    items = [chat_workload.ChatPrompt(f"p{i}", i + 1) for i in range(10)]
    a = chat_workload.in_client_order(items, 4, seed=0)
    assert a == chat_workload.in_client_order(items, 4, seed=0) != chat_workload.in_client_order(items, 4, seed=1)
    assert len(a) == 4 and len(set(a)) == 4 and set(a) <= set(items)
    full = chat_workload.in_client_order(items, 10, seed=0)
    assert full[:4] == a and sorted(full, key=lambda p: p.output_tokens) == items  # a shuffle, all of them
    more = chat_workload.in_client_order(items, 13, seed=0)
    assert more[:10] == full and set(more[10:]) <= set(items)  # drawn again from those chosen
    assert chat_workload.in_client_order(items, 0, seed=0) == full  # 0: all, as vLLM takes it


@pytest.mark.vllm
def test_vllm_s_client_sends_the_prompts_in_our_order_and_its_server_renders_them_as_dspark(tmp_path):
    """vLLM 0.32's own CustomDataset (as ``vllm bench serve --dataset-name custom --seed`` builds it) picks the
    same requests in the same order as ``in_client_order``, oversampling included, and the exported folder's
    chat template (what ``vllm serve`` applies) renders each prompt as dspark_ray's tokenizer does."""
    if bench.client_lacks([str(REPO / "bench" / ".vllm-venv" / "bin" / "python")], "pandas"):
        pytest.skip("bench/.vllm-venv lacks pandas, which vLLM's custom dataset needs (pip install pandas)")
    from dspark_ray.model.checkpoint import locate

    folder = bench.exported(locate(chat_workload.MODEL), "bfloat16", tmp_path)  # the tokenizer is the same
    script = (
        "import json, sys\n"
        "from transformers import AutoTokenizer\n"
        "from vllm.benchmarks.datasets import CustomDataset\n"
        "tok = AutoTokenizer.from_pretrained(sys.argv[2])\n"
        "out = []\n"
        "for seed, n in ((0, 170), (7, 5)):\n"
        "    reqs = CustomDataset(dataset_path=sys.argv[1], random_seed=seed).sample(\n"
        "        tokenizer=tok, num_requests=n, output_len=-1, skip_chat_template=True)\n"
        "    out.append([[r.prompt, r.expected_output_len, tok.apply_chat_template(\n"
        "        [{'role': 'user', 'content': r.prompt}], add_generation_prompt=True, tokenize=False)] for r in reqs])\n"
        "print(json.dumps(out))\n")
    proc = subprocess.run([str(REPO / "bench" / ".vllm-venv" / "bin" / "python"), "-c", script,
                           str(chat_workload.WORKLOAD), str(folder)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = json.loads(proc.stdout.splitlines()[-1])
    tok = __import__("dspark_ray.tokenizer", fromlist=["Tokenizer"]).Tokenizer.from_path(locate(chat_workload.MODEL))
    for (seed, n), requests in zip(((0, 170), (7, 5)), theirs, strict=True):
        ours = chat_workload.in_client_order(chat_workload.load(), n, seed)
        assert [(r[0], r[1]) for r in requests] == [(p.prompt, p.output_tokens) for p in ours]
        for prompt, _, text in requests:
            assert tok.apply_chat_template([{"role": "user", "content": prompt}]) == text


def test_the_chat_workload_in_the_client_command_and_the_report(tmp_path):
    cli = [str(bench.VLLM_VENV / "bin" / "python"), "-c", bench.VLLM_SHIM]
    w = bench.Workload(kind="chat", num_prompts=6)
    text = bench.show(bench.client_command(cli, "http://127.0.0.1:8123", "smollm2", tmp_path / "tok", w, 2,
                                           w.prompts(2), tmp_path, "r.json"))
    for flags in ("--backend openai-chat", "--endpoint /v1/chat/completions", "--dataset-name custom",
                  "--dataset-path bench/chat_prompts.jsonl", "--custom-output-len -1", "--skip-chat-template",
                  "--ignore-eos", "--temperature 0", "--seed 0", "--num-prompts 6", "--max-concurrency 2",
                  f"--tokenizer {tmp_path / 'tok'}"):
        assert f" {flags}" in text
    assert "--random" not in text and "/v1/completions" not in text
    chosen = chat_workload.in_client_order(chat_workload.load(), 6, 0)
    assert w.chat(6) == chosen
    lengths = sorted(p.output_tokens for p in chosen)
    assert w.output_tokens(6, 6) == (sum(lengths), sum(lengths))
    assert w.output_tokens(6, 4) == (sum(lengths[:4]), sum(lengths[2:]))
    assert bench.Workload(output_len=64).output_tokens(6, 5) == (320, 320)
    assert "chat completions endpoint" in w.text() and "held-out chat prompts" in w.text()
    args = bench.parse([], None)
    assert args.workload.kind == "chat" and bench.parse(["--workload", "random"], None).workload.kind == "random"


class FakeEngine:
    """An engine whose request i takes ``steps[i]`` steps and delivers a token each; records the in-flight
    count at every step and the order requests arrive in."""

    def __init__(self, steps: dict[str, int]) -> None:
        self.steps, self.left, self.added, self.in_flight = steps, {}, [], []

    def add_request(self, prompt, params) -> str:
        req_id = prompt[0]
        self.added.append(req_id)
        self.left[req_id] = self.steps[req_id]
        return req_id

    def has_unfinished(self) -> bool:
        return bool(self.left)

    def step(self) -> list:
        self.in_flight.append(len(self.left))
        outs = []
        for req_id in list(self.left):
            self.left[req_id] -= 1
            done = self.left[req_id] == 0
            outs.append(SimpleNamespace(req_id=req_id, new_token_ids=[1], finished=done, finish_reason="length",
                                        num_output_tokens=self.steps[req_id], spec=None))
            if done:
                del self.left[req_id]
        return outs


def test_closed_loop_keeps_b_in_flight_and_sends_in_order():
    """As vLLM's client at --max-concurrency b: b requests in flight, the next one sent as soon as one ends."""
    steps = {"a": 5, "b": 1, "c": 2, "d": 3, "e": 1}
    engine = FakeEngine(steps)
    prompts = [[k] for k in steps]
    traces, seconds = bench.closed_loop(engine, prompts, [None] * 5, 2)
    assert engine.added == list(steps) and seconds > 0
    assert max(engine.in_flight) == 2 and engine.in_flight[:5] == [2, 2, 2, 2, 2]
    assert [t.output_tokens for t in traces] == [5, 1, 2, 3, 1]  # in sending order
    assert [len(t.arrivals) for t in traces] == [5, 1, 2, 3, 1]
    assert all(t.sent <= t.arrivals[0] for t in traces)
    assert traces[2].sent >= traces[1].arrivals[-1]  # c was sent once b ended
    engine = FakeEngine(steps)
    bench.closed_loop(engine, prompts, [None] * 5, 8)
    assert engine.in_flight[0] == 5


# -- vLLM's side: its command lines, the export cache --------------------------------------------------


def test_vllm_command_lines_for_each_speculation():
    app = {"model": "/m/target", "draft": "/m/draft", "k": 3, "name": "t", "dtype": "float32", "max_context": 2048,
           "prompt_lookup": (2, 5)}
    def config(cmd):
        return json.loads(cmd[cmd.index("--speculative-config") + 1]) if "--speculative-config" in cmd else None

    none = bench.vllm_server_command(["vllm"], app, "t", 9000, "none")
    assert config(none) is None and none[:3] == ["vllm", "serve", "/m/target"]
    assert none[none.index("--max-model-len") + 1] == "2048" and none[none.index("--dtype") + 1] == "float32"
    assert config(bench.vllm_server_command(["vllm"], app, "t", 9000, "ngram")) == {
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5, "prompt_lookup_min": 2}
    assert config(bench.vllm_server_command(["vllm"], {**app, "draft": None, "k": 0}, "t", 9000, "ngram"))[
        "num_speculative_tokens"] == 4  # the YAML speculates with none: 4
    assert config(bench.vllm_server_command(["vllm"], app, "t", 9000, "draft")) == {
        "method": "draft_model", "model": "/m/draft", "num_speculative_tokens": 3}
    with pytest.raises(bench.SystemUnavailable, match="serves none"):
        bench.vllm_server_command(["vllm"], {**app, "draft": None}, "t", 9000, "draft")


def test_vllm_spec_and_threads_bind_flags(tmp_path):
    assert bench.parse([], None).vllm_spec == "none"  # deploy/dspark.yaml: SmolLM2 alone
    assert bench.parse(["--yaml", str(SHAKESPEARE)], None).vllm_spec == "draft"
    assert bench.parse(["--yaml", str(SHAKESPEARE), "--vllm-spec", "ngram"], None).vllm_spec == "ngram"
    with pytest.raises(SystemExit):
        bench.parse(["--vllm-spec", "draft"], None)  # no draft to give vLLM
    assert bench.parse(["--vllm-spec", "draft", "--systems", "dspark"], None).vllm_spec == "draft"  # no vLLM
    ngram_yaml = tmp_path / "ngram.yaml"  # a YAML with prompt lookup: vLLM gets its own, same lengths
    doc = yaml.safe_load(SHAKESPEARE.read_text())
    doc["applications"][0]["args"].update(draft="ngram", prompt_lookup_min=1, prompt_lookup_max=3)
    ngram_yaml.write_text(yaml.safe_dump(doc))
    assert bench.parse(["--yaml", str(ngram_yaml)], None).vllm_spec == "ngram"
    app = bench.app_of(ngram_yaml)
    assert app["draft"] is None and app["ngram"] and app["prompt_lookup"] == (1, 3)
    assert bench.parse([], None).vllm_threads_bind == "all"
    assert bench.vllm_server_env(2, "all")["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert bench.vllm_server_env(4, "all")["VLLM_CPU_OMP_THREADS_BIND"] == "0-3"
    assert bench.vllm_server_env(2, "auto")["VLLM_CPU_OMP_THREADS_BIND"] == "auto"  # vLLM's own choice
    args = bench.parse(["--vllm-threads-bind", "auto", "--vllm-spec", "ngram"], None)
    text = bench.vllm_setup_text(bench.app_of(args.yaml), args)
    assert text == "ngram speculation (prompt lookup, k 4), VLLM_CPU_OMP_THREADS_BIND=auto"


def test_vllm_app_exports_gguf_checkpoints(monkeypatch, tmp_path):
    """vLLM gets a GGUF target (and draft) as its export in the dtype dspark's target runs in; folders as
    they are; a DSpark draft becomes --vllm-draft."""
    calls = []
    monkeypatch.setattr(bench, "exported", lambda path, dtype: calls.append((path, dtype)) or tmp_path / path.stem)
    app = bench.app_of(bench.DEFAULT_YAML)
    assert app["model"].endswith(".gguf") and app["draft"] is None
    vllm = bench.vllm_app(app, "none", REPO / "models" / "shakespeare-draft")
    assert vllm["model"] == str(tmp_path / Path(app["model"]).stem) and calls == [(Path(app["model"]), "float32")]
    pair = {**app, "model": "/m/target", "draft": str(tmp_path / "d.gguf"), "k": 4}
    assert bench.vllm_app(pair, "draft", Path("/x"))["draft"] == str(tmp_path / "d") and calls[-1][1] == "float32"
    toy = bench.app_of(SHAKESPEARE)
    assert bench.vllm_app(toy, "draft", Path("/x")) == toy  # folders as they are
    assert len(calls) == 2


def test_the_export_cache_is_keyed_by_the_file_and_the_dtype(tmp_path, monkeypatch):
    from gguf_fixtures import write_tiny_gguf

    import dspark_ray.export as export

    model = tmp_path / "tiny.gguf"
    write_tiny_gguf(model)
    cache = tmp_path / "cache"
    folder = bench.exported(model, "float32", cache)
    assert folder.parent == cache and folder.name.startswith("tiny-") and folder.name.endswith("-float32")
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(
        os.listdir(folder))
    assert json.loads((folder / "exported_from.json").read_text())["file"] == str(model.resolve())
    assert [p.name for p in cache.iterdir()] == [folder.name]  # no partial folder left behind
    monkeypatch.setattr(export, "export_gguf", lambda *a: pytest.fail("exported again"))
    assert bench.exported(model, "float32", cache) == folder  # kept
    monkeypatch.undo()
    bf16 = bench.exported(model, "bfloat16", cache)
    assert bf16 != folder and bf16.name.endswith("-bfloat16")
    assert json.loads((bf16 / "config.json").read_text())["torch_dtype"] == "bfloat16"
    os.utime(model, ns=(time.time_ns(), time.time_ns() + 10**9))  # the file changed
    assert bench.exported(model, "float32", cache) not in (folder, bf16)
    with pytest.raises(bench.SystemUnavailable, match="dtype"):
        bench.exported(model, "auto", cache)
    assert bench.as_folder(str(REPO / "models" / "shakespeare-target"), "float32") == str(
        REPO / "models" / "shakespeare-target")


# -- the machine's limit: bytes of weights a step, memory bandwidth ----------------------------------------


def test_weight_bytes_of_a_loaded_gguf_model(tmp_path):
    """Float weights: every weight once (tied embeddings and fused projections once), an untied input
    embedding left out but for a row, half the bytes in bfloat16; the AppConfig's way loads it as its engine
    does. A quantized file: what the memory planner counts for the same file (blocks kept or not)."""
    from gguf_fixtures import write_tiny_gguf

    from dspark_ray.model import load
    from dspark_ray.model.memory import Checkpoint, read_config
    from dspark_ray.serve.config import AppConfig

    for tied in (True, False):
        path = tmp_path / f"tiny-{tied}.gguf"
        weights = write_tiny_gguf(path, qtype="F32", embed_qtype="F32", tied=tied)
        embed = weights["token_embd.weight"]
        total = sum(w.size for w in weights.values())
        want = total if tied else total - embed.size + embed.shape[-1]
        f32 = common.model_weight_bytes(load(path, dtype="float32", pack=False))
        assert f32 == common.WeightBytes(values=want, stored=4 * want), tied
        bf16 = common.model_weight_bytes(load(path, dtype="bfloat16"))  # packed copies beside: not counted
        assert bf16 == common.WeightBytes(values=want, stored=2 * want)
        assert f32.in_dtype(2) == bf16.stored

    path = tmp_path / "tiny-q8.gguf"
    write_tiny_gguf(path, qtype="Q8_0", embed_qtype="Q8_0")
    cfg = AppConfig(model=str(path), draft=None, num_speculative_tokens=0, max_context=128, capacity=2,
                    num_replicas=1)
    got = common.weight_bytes(cfg)
    planned = Checkpoint.of(read_config(path), "cpu", "float32")
    assert got == common.WeightBytes(values=planned.arch.params, stored=planned.weight_bytes())


def test_weight_bytes_counts_gguf_blocks_kept_as_stored():
    """A weight kept as GGUF blocks (dspark_ray/model/quantized.py: a uint8 ``weight`` buffer [out, row bytes]
    beside a ``qtype``) counts its bytes as stored and out x in weights; rows shared by a fused view once."""

    class BlockLinear(torch.nn.Linear):
        def __init__(self, blocks: torch.Tensor, in_features: int) -> None:
            super().__init__(in_features, blocks.shape[0], bias=False, device="meta")
            del self.weight
            self.register_buffer("weight", blocks)
            self.qtype = 3  # Q4_1: 32 weights in 20 bytes

    fused = torch.zeros(8 + 4, 64 // 32 * 20, dtype=torch.uint8)
    model = torch.nn.Sequential(BlockLinear(fused[:8], 64), BlockLinear(fused[8:], 64), torch.nn.LayerNorm(64))
    got = common.model_weight_bytes(model)
    assert got == common.WeightBytes(values=12 * 64 + 2 * 64, stored=12 * 2 * 20 + 2 * 64 * 4)


def test_the_limit_arithmetic_and_its_table():
    """Ceiling = bandwidth / bytes a step; single-stream decode = 1000 / TPOT at concurrency 1; each system
    against the bytes its own target reads."""
    limit = bench.Limit(bandwidth=30e9, dspark=common.WeightBytes(135_000_000, 540_000_000), dtype="float32",
                        vllm_bytes=270_000_000)
    assert limit.ceiling(540_000_000) == pytest.approx(55.556, abs=1e-3)
    rows = [bench.Row("dspark", 1, 4, 0, 1.0, 50.0, 4.0, tpot_mean=20.0),
            bench.Row("vllm", 1, 4, 0, 1.0, 40.0, 4.0, tpot_mean=25.0),
            bench.Row("inprocess", 1, 4, 0, 1.0, 60.0, 4.0, tpot_mean=16.0),
            bench.Row("dspark", 8, 4, 0, 1.0, 300.0, 4.0, tpot_mean=5.0)]
    table = bench.limit_table(rows, limit).splitlines()
    assert table[2] == "| dspark_ray served | 540.0 MB | 55.6 | 50.0 | 0.90 |"
    assert table[3] == "| vLLM served | 270.0 MB | 111.1 | 40.0 | 0.36 |"
    assert table[4] == "| dspark_ray in-process | 540.0 MB | 55.6 | 62.5 | 1.12 |"
    assert len(table) == 5  # concurrency 1 only
    assert bench.limit_table(rows[3:], limit) == ""
    assert bench.machine_limit.__doc__ and common.memory_bandwidth(gib=0.05, repeats=2) > 1e9


def test_the_report_shows_the_limit_the_memory_and_the_plan(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "OUT_DIR", tmp_path)
    report = bench.Report(machine="test box", workload={"input_len": 24, "output_len": 64, "seed": 0,
                                                          "num_prompts": 16, "warmup_prompts": None})
    report.rows = [run_row("dspark", 1, 1, 50.0, ttft=10.0, itl=(20.0, 30.0))]
    report.rows[0].tpot_mean = 20.0
    report.limit = bench.Limit(30e9, common.WeightBytes(135_000_000, 540_000_000), "float32", 540_000_000)
    report.memory = [bench.ProcessMemory("dspark", 11, "ray::TargetShard", 900_000_000, 700_000_000),
                     bench.ProcessMemory("dspark", 12, "ray::ServeReplica:dspark:DSparkServer", 400_000_000,
                                         200_000_000),
                     bench.ProcessMemory("dspark", 13, "raylet", 5_000_000, 1_000_000),
                     bench.ProcessMemory("vllm", 21, "VLLM::EngineCore", 1_500_000_000, 1_200_000_000)]
    report.memory_plan = "verdict: fits\nsmollm2: ..."
    report.save()
    md = (tmp_path / "served.md").read_text()
    assert "memory bandwidth 30.0 GB/s" in md and "reads 540.0 MB of weights a decode step" in md
    assert "| dspark_ray served | 540.0 MB | 55.6 | 50.0 | 0.90 |" in md
    assert "| dspark_ray served | ray::TargetShard | 11 | 900 | 700 |" in md
    assert "| dspark_ray served | (1 others) | | 5 | 1 |" in md and "| dspark_ray served | (all) | | 1305 | 901 |" in md
    assert "| vLLM served | VLLM::EngineCore | 21 | 1500 | 1200 |" in md
    assert "```\nverdict: fits\nsmollm2: ...\n```" in md
    data = json.loads((tmp_path / "served.json").read_text())
    assert data["limit"]["dspark_ceiling"] == pytest.approx(55.556, abs=1e-3)
    assert data["memory"][0]["rss"] == 900_000_000 and data["memory_plan"].startswith("verdict: fits")


def test_resident_memory_from_proc():
    rss, anon = bench.process_memory(os.getpid())
    assert rss > anon > 0  # torch and friends
    assert bench.process_memory(999_999_999) is None
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        deadline = time.monotonic() + 10
        while bench.process_name(sleeper.pid) != "sleep":  # until it has exec'd
            assert time.monotonic() < deadline
            time.sleep(0.01)
        [mine] = bench.resident("vllm", {sleeper.pid, 999_999_999})
        assert (mine.system, mine.pid, mine.name) == ("vllm", sleeper.pid, "sleep") and 0 < mine.rss < 50e6
        assert bench.resident("inprocess", {os.getpid()}, "this script")[0].name == "this script"
    finally:
        sleeper.kill()
        sleeper.wait()


def test_the_memory_plan_of_the_shipped_yaml():
    plan = bench.app_of(bench.DEFAULT_YAML)["config"].memory_plan()
    assert plan.verdict in ("fits", "kv-limited") and "verdict:" in plan.table()

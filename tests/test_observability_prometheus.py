"""The real Prometheus server scraping a real Serve deployment through Ray's service discovery.

One module-scoped stack: a local Ray (with its dashboard, which writes the
service-discovery file), ``serve.run`` of ``build_app`` with the model pair of
``serve_fixtures`` at tensor-parallel 2, and ``prometheus`` started from
``dashboards/prometheus.yml`` with a 1 s scrape interval and this session's
discovery file. Traffic: concurrent completions (plain and streaming), a chat
completion and one bad request, into a deliberately small deployment (2 slots,
a KV pool that holds one long request) so that exhaustion and preemption
happen too. The tests then read everything back through Prometheus' HTTP API
and compare it with what the clients received.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import ray
import yaml
from ray import serve

from conftest import REPO
from dspark_ray.ops import dashboards
from dspark_ray.slots import slot_manager_name
from serve_fixtures import serve_models  # noqa: F401 - fixture

pytestmark = [pytest.mark.ray, pytest.mark.slow]

K = 4
MAX_CONTEXT = 128
APP = "dspark"
PROMPTS = ["ROMEO: What light through yonder", "JULIET: O Romeo, Romeo", "KING LEAR: Blow, winds",
           "HAMLET: To be, or not", "MACBETH: Tomorrow, and tomorrow"]
SHARED_PREFIX = "SYSTEM: Answer as a player of the Globe would, in verse. " * 2  # > BUDGET tokens
BUDGET = 24  # target tokens per step: the shared prefix is fed in chunks


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports: all held bound until all are chosen (one at a time, the kernel may
    hand out a just-closed port again, and the replica's HTTP port then was Serve's proxy's)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def prometheus_binary() -> str | None:
    """The prometheus server: on PATH, in .venv/bin, /usr/bin; else apt-get it when root (as deploy/setup.sh)."""
    def find() -> str | None:
        for path in (shutil.which("prometheus"), str(Path(sys.executable).parent / "prometheus"),
                     "/usr/bin/prometheus"):
            if path and os.access(path, os.X_OK):
                return path
        return None

    if find() is None and shutil.which("apt-get") and os.geteuid() == 0:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for cmd in (["apt-get", "install", "-y", "-qq", "--no-install-recommends", "prometheus"],
                    ["apt-get", "update", "-qq"],
                    ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "prometheus"]):
            subprocess.run(cmd, env=env, capture_output=True, timeout=600)
            if find():
                break
    return find()


class Prometheus:
    """A prometheus server process and its HTTP API."""

    def __init__(self, binary: str, discovery_file: Path, folder: Path) -> None:
        config = yaml.safe_load((REPO / "dashboards" / "prometheus.yml").read_text())
        config["global"].update(scrape_interval="1s", evaluation_interval="1s")
        config["scrape_configs"][0]["file_sd_configs"][0]["files"] = [str(discovery_file)]
        config["rule_files"] = [str(REPO / "dashboards" / f) for f in config["rule_files"]]
        (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = folder / "prometheus.log"
        self.proc = subprocess.Popen(
            [binary, f"--config.file={folder / 'prometheus.yml'}", f"--storage.tsdb.path={folder / 'data'}",
             f"--web.listen-address={self.url.removeprefix('http://')}"],
            stdout=self.log.open("w"), stderr=subprocess.STDOUT)
        self._wait_ready()

    def _wait_ready(self, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited: {self.log.read_text()[-3000:]}")
            try:
                urllib.request.urlopen(f"{self.url}/-/ready", timeout=2)
                return
            except OSError:
                time.sleep(0.3)
        raise RuntimeError(f"prometheus not ready after {timeout_s}s: {self.log.read_text()[-3000:]}")

    def api(self, path: str, **params) -> dict:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as reply:
            body = json.loads(reply.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        return self.api("query", query=expr)["result"]

    def value(self, expr: str) -> float | None:
        """The value of a query returning one series (or None when it returns none)."""
        result = self.query(expr)
        assert len(result) <= 1, f"{expr} returned {len(result)} series"
        return float(result[0]["value"][1]) if result else None

    def names(self) -> set[str]:
        return set(self.api("label/__name__/values"))

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@dataclass
class ClientTotals:
    """What the HTTP clients received."""

    ok: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reasons: Counter = field(default_factory=Counter)
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=lambda: [0] * K)
    bad_status: list[int] = field(default_factory=list)
    cached_tokens: int = 0

    def add(self, usage: dict, finish_reason: str, spec: dict | None) -> None:
        self.ok += 1
        self.prompt_tokens += usage["prompt_tokens"]
        self.cached_tokens += usage["prompt_tokens_details"]["cached_tokens"]
        self.completion_tokens += usage["completion_tokens"]
        self.reasons[finish_reason] += 1
        if spec:
            self.drafts += spec["drafts"]
            self.draft_tokens += spec["draft_tokens"]
            self.accepted_tokens += spec["accepted_tokens"]
            for i, n in enumerate(spec["accepted_per_position"]):
                self.accepted_per_position[i] += n


async def _complete(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int, totals: ClientTotals,
                    ignore_eos: bool = False):
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": ignore_eos}
    reply = await client.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    data = reply.json()
    totals.add(data["usage"], data["choices"][0]["finish_reason"], data["speculation"])


async def _stream(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int, totals: ClientTotals):
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    reason = spec = usage = None
    async with client.stream("POST", "/v1/completions", json=body) as reply:
        assert reply.status_code == 200
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                reason = choice["finish_reason"] or reason
            spec = chunk.get("speculation") or spec
            usage = chunk.get("usage") or usage
    totals.add(usage, reason, spec)


async def _chat(client: httpx.AsyncClient, model: str, max_tokens: int, totals: ClientTotals):
    body = {"model": model, "messages": [{"role": "user", "content": "Speak, Horatio."}], "max_tokens": max_tokens,
            "temperature": 0}
    reply = await client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    data = reply.json()
    totals.add(data["usage"], data["choices"][0]["finish_reason"], data["speculation"])


async def _bad_request(client: httpx.AsyncClient, totals: ClientTotals):
    reply = await client.post("/v1/completions", json={"model": "no-such-model", "prompt": "x"})
    totals.bad_status.append(reply.status_code)


async def send_traffic(base_url: str, proxy_url: str, model: str) -> ClientTotals:
    """More requests than slots, long enough that two of them overflow the KV pool (preemption);
    then two prompts sharing a prefix longer than the step's token budget, one after the other
    (chunked prefill, and the second finds the first's blocks in the prefix cache). Most go to
    the replica's own HTTP server (``base_url``, as the shipped YAML serves), the shared-prefix
    pair and one bad request through Serve's proxy (``proxy_url``): both paths' metrics appear."""
    totals = ClientTotals()
    async with (httpx.AsyncClient(base_url=base_url, timeout=180) as client,
                httpx.AsyncClient(base_url=proxy_url, timeout=180) as proxied):
        await asyncio.gather(
            _complete(client, model, PROMPTS[0], 100, totals, ignore_eos=True),
            _complete(client, model, PROMPTS[1], 100, totals, ignore_eos=True),
            _stream(client, model, PROMPTS[2], 60, totals),
            _stream(client, model, PROMPTS[3], 30, totals),
            _complete(client, model, PROMPTS[4], 20, totals),
            _chat(client, model, 24, totals),
            _bad_request(client, totals),
            _bad_request(proxied, totals),
        )
        for ending in ("ROMEO:", "JULIET:"):
            await _complete(proxied, model, SHARED_PREFIX + ending, 8, totals)
    return totals


@dataclass
class Stack:
    prometheus: Prometheus
    totals: ClientTotals
    model: str
    names: set[str] = field(default_factory=set)
    idle_since: float = 0.0  # time.monotonic() when the traffic had ended

    def value(self, expr: str) -> float | None:
        return self.prometheus.value(expr)


def slot_manager(app: str):
    """The application's slot manager, in whichever namespace the replica started it."""
    name = slot_manager_name(app)
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["name"] == name:
            return ray.get_actor(name, namespace=actor["namespace"])
    raise LookupError(f"no actor named {name!r}")


def wait_until(check, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        ok, last = check()
        if ok:
            return
        time.sleep(0.5)
    raise AssertionError(f"{what} not reached in {timeout_s}s; last: {last}")


@pytest.fixture(scope="module")
def stack(serve_models, tmp_path_factory):  # noqa: F811 - the fixture imported above
    binary = prometheus_binary()
    if binary is None:
        pytest.skip("the prometheus server is not installed and cannot be (not root, or no apt-get): "
                    "install the Debian package `prometheus` (bash deploy/setup.sh --test does)")
    if ray.is_initialized():  # a leftover connection would lack the dashboard and metrics settings used here
        ray.shutdown()
    folder = tmp_path_factory.mktemp("prometheus")
    dashboard, metrics, port, direct = free_ports(4)
    ray.init(num_cpus=2, object_store_memory=100 * 1024 * 1024, include_dashboard=True,
             dashboard_host="127.0.0.1", dashboard_port=dashboard, _metrics_export_port=metrics,
             namespace="dspark-test-observability", log_to_driver=False,
             _system_config={"metrics_report_interval_ms": 500})
    prometheus = None
    try:
        discovery = Path(ray._private.worker._global_node.get_session_dir_path()) / "prom_metrics_service_discovery.json"
        prometheus = Prometheus(binary, discovery, folder)
        from dspark_ray.serve.app import build_app

        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app({
            "model": str(serve_models.target), "draft": str(serve_models.draft), "tensor_parallel_size": 2,
            "num_speculative_tokens": K, "capacity": 2, "max_num_seqs": 4, "max_context": MAX_CONTEXT,
            "kv_pool_tokens": MAX_CONTEXT + K, "cpus_per_shard": 0.25, "max_num_batched_tokens": BUDGET,
            "http_port": direct,
        }), name=APP, route_prefix="/")
        traffic = send_traffic(f"http://127.0.0.1:{direct}", f"http://127.0.0.1:{port}", serve_models.name)
        s = Stack(prometheus, asyncio.run(traffic), serve_models.name, idle_since=time.monotonic())
        # A late retry of a release: the slot manager counts it as stale and frees nothing.
        manager = slot_manager(APP)
        assert ray.get(manager.release_many.remote([("never-allocated", None)])) == [False]

        def settled():
            seen = (s.value("sum(ray_dspark_generation_tokens_total)"), s.value("sum(ray_dspark_slot_in_use)"),
                    s.value("sum(ray_dspark_requests_running)"), s.value("sum(ray_dspark_spec_decode_num_drafts_total)"),
                    s.value("sum(ray_dspark_slot_stale_releases_total)"),
                    s.value("sum(ray_dspark_target_step_seconds_count)"))
            want = (s.totals.completion_tokens, 0, 0, s.totals.drafts)
            return seen[:4] == want and seen[4] and seen[5], seen

        wait_until(settled, 60, "Prometheus showing the final counts")
        time.sleep(2.5)  # two more scrapes, so that rate() has two samples of even the newest series
        s.names = prometheus.names()
        yield s
    finally:
        if prometheus is not None:
            prometheus.stop()
        serve.shutdown()
        ray.shutdown()


def test_traffic_went_through(stack):
    assert stack.totals.ok == 8
    assert stack.totals.bad_status == [400, 400]


def test_http_requests_the_replica_served_itself_are_counted(stack):
    """dspark_http_requests: the 6 good requests and the bad one sent to the replica's own server
    (the 2 + 1 through Serve's proxy are Serve's to count)."""
    v = stack.value
    wait_until(lambda: (v('sum(ray_dspark_http_requests_total{status_code="200"})') == 6, v), 30, "HTTP counts")
    assert v('sum(ray_dspark_http_requests_total{status_code="400", route="/v1/completions"})') == 1
    assert v('sum(ray_dspark_http_requests_total{route="/v1/chat/completions"})') == 1
    assert v("sum(ray_serve_num_http_requests_total)") >= 3
    assert v("sum(ray_dspark_http_request_latency_seconds_count)") == 7
    assert stack.totals.drafts > 0, "speculation never ran"


def test_token_counters_equal_what_clients_received(stack):
    assert stack.value("sum(ray_dspark_generation_tokens_total)") == stack.totals.completion_tokens
    assert stack.value("sum(ray_dspark_prompt_tokens_total)") == stack.totals.prompt_tokens


def test_finished_requests_by_reason(stack):
    got = {r["metric"]["reason"]: float(r["value"][1])
           for r in stack.prometheus.query("sum by (reason) (ray_dspark_requests_finished_total)")}
    assert got == {reason: float(n) for reason, n in stack.totals.reasons.items()}


def test_speculation_counters_match_the_responses(stack):
    t, v = stack.totals, stack.value
    assert v("sum(ray_dspark_spec_decode_num_drafts_total)") == t.drafts
    assert v("sum(ray_dspark_spec_decode_num_draft_tokens_total)") == t.draft_tokens
    assert v("sum(ray_dspark_spec_decode_num_accepted_tokens_total)") == t.accepted_tokens
    per_pos = {int(r["metric"]["position"]): int(float(r["value"][1])) for r in stack.prometheus.query(
        "sum by (position) (ray_dspark_spec_decode_num_accepted_tokens_per_pos_total)")}
    want = {i: n for i, n in enumerate(t.accepted_per_position) if n}
    assert per_pos == want
    # Consistency of vLLM's meanings: position i counts drafts accepted at least up to i.
    counts = [per_pos.get(i, 0) for i in range(K)]
    assert counts == sorted(counts, reverse=True) and counts[0] <= t.drafts
    assert sum(counts) == t.accepted_tokens <= t.draft_tokens <= K * t.drafts
    mean_len = 1 + t.accepted_tokens / t.drafts
    assert 1 <= mean_len <= K + 1


def test_vllm_names_from_the_recording_rules(stack):
    """dashboards/vllm-names.rules.yml: the same counters under vLLM's names, labelled model_name."""
    t = stack.totals
    deadline = time.monotonic() + 30  # rules are evaluated every second here
    while time.monotonic() < deadline and stack.value("sum(vllm:spec_decode_num_drafts_total)") != t.drafts:
        time.sleep(0.5)
    assert stack.value("sum(vllm:spec_decode_num_drafts_total)") == t.drafts
    assert stack.value("sum(vllm:spec_decode_num_draft_tokens_total)") == t.draft_tokens
    assert stack.value("sum(vllm:spec_decode_num_accepted_tokens_total)") == t.accepted_tokens
    assert stack.value("sum(vllm:generation_tokens_total)") == t.completion_tokens
    names = {r["metric"].get("model_name") for r in stack.prometheus.query("vllm:spec_decode_num_drafts_total")}
    assert names and None not in names
    per_pos = {int(r["metric"]["position"]): int(float(r["value"][1])) for r in stack.prometheus.query(
        "sum by (position) (vllm:spec_decode_num_accepted_tokens_per_pos_total)")}
    assert per_pos == {i: n for i, n in enumerate(t.accepted_per_position) if n}


def test_adaptive_k_steps_are_counted(stack):
    """Every step of the (adaptive, by default) engine that carried requests counts its chosen k."""
    by_k = {r["metric"]["k"]: float(r["value"][1]) for r in stack.prometheus.query(
        "sum by (k) (ray_dspark_spec_k_steps_total)")}
    assert by_k and all(0 <= int(k) <= K for k in by_k) and sum(by_k.values()) > 0


def test_slot_events(stack):
    v = stack.value
    allocations = v("sum(ray_dspark_slot_allocations_total)")
    assert allocations == v("sum(ray_dspark_slot_releases_total)") == stack.totals.ok
    assert v("sum(ray_dspark_slot_hold_time_seconds_count)") == allocations
    assert v("sum(ray_dspark_slot_exhausted_total)") > 0, "6 requests on 2 slots must have waited for one"
    assert v("sum(ray_dspark_slot_stale_releases_total)") == 1


def test_latency_histograms(stack):
    v, n = stack.value, stack.totals.ok
    assert v("sum(ray_dspark_time_to_first_token_seconds_count)") == n
    assert v("sum(ray_dspark_e2e_request_latency_seconds_count)") == n
    itl = v("sum(ray_dspark_inter_token_latency_seconds_count)")
    assert 0 < itl <= stack.totals.completion_tokens - n  # a request's first token has no gap before it
    p50_ttft = v("histogram_quantile(0.5, sum by (le) (ray_dspark_time_to_first_token_seconds_bucket))")
    p50_e2e = v("histogram_quantile(0.5, sum by (le) (ray_dspark_e2e_request_latency_seconds_bucket))")
    assert 0 < p50_ttft <= p50_e2e


def test_prefill_chunks_and_prefix_cache_hits(stack):
    """The shared prefix was chunked, and the second request's usage reported the cached tokens the
    target counted."""
    assert stack.value("sum(ray_dspark_prefill_chunks_total)") > 0
    assert stack.totals.cached_tokens > 0
    # the counter also counts what a preempted request's recompute found of its own earlier blocks
    assert stack.value("sum(ray_dspark_prefix_cache_hit_tokens_total)") >= stack.totals.cached_tokens
    assert stack.value("sum(ray_dspark_prefix_cache_query_tokens_total)") >= stack.totals.prompt_tokens
    assert stack.value("sum(ray_dspark_requests_prefilling)") == 0


def test_steps_batches_and_preemption(stack):
    v = stack.value
    steps = v("sum(ray_dspark_batch_size_count)")
    assert steps > 0
    assert v('sum(ray_dspark_batch_size_bucket{le=~"4|4.0"})') == steps, "a step ran more rows than max_num_seqs"
    phases = {r["metric"]["phase"]: float(r["value"][1])
              for r in stack.prometheus.query("sum by (phase) (ray_dspark_step_phase_seconds_count)")}
    assert set(phases) == {"schedule", "propose", "verify", "commit"}
    assert all(count == steps for count in phases.values())
    assert v("sum(ray_dspark_step_phase_time_seconds_total{phase='verify'})") > 0
    assert v("sum(ray_dspark_preemptions_total)") > 0, "two 100-token requests must overflow a 132-token KV pool"


def test_per_rank_target_and_collective_time(stack):
    q = stack.prometheus.query
    steps = {r["metric"]["rank"]: float(r["value"][1])
             for r in q("sum by (rank) (ray_dspark_target_step_seconds_count)")}
    assert set(steps) == {"0", "1"} and steps["0"] == steps["1"], steps  # every step goes to every rank
    collectives = {r["metric"]["rank"]: float(r["value"][1])
                   for r in q("sum by (rank) (ray_dspark_target_collective_seconds_count)")}
    assert collectives == steps
    for rank in ("0", "1"):
        collective = stack.value(f"sum(ray_dspark_target_collective_time_seconds_total{{rank='{rank}'}})")
        step = stack.value(f"sum(ray_dspark_target_step_time_seconds_total{{rank='{rank}'}})")
        assert 0 < collective < step


def _instant(expr: str) -> str:
    """A dashboard query as Prometheus can run it: Grafana's variables filled in."""
    return expr.replace("$__rate_interval", "2m").replace("$model", ".*").replace("$app", ".*")


# Queries whose series only exist after something went wrong (none did here).
ONLY_ON_TROUBLE = {"Requests ended by abort or error"}


@pytest.mark.parametrize("path", sorted((REPO / "dashboards").glob("*.json")), ids=lambda p: p.stem)
def test_every_dashboard_metric_exists_and_every_query_runs(stack, path):
    dash = json.loads(path.read_text())
    for expr in dashboards.queries(dash):
        missing = dashboards.metric_names(expr) - stack.names
        assert not missing, f"{path.name}: {sorted(missing)} not in the scrape (query: {expr})"
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            result = stack.prometheus.query(_instant(target["expr"]))  # a syntax error fails here
            if panel["title"] not in ONLY_ON_TROUBLE:
                assert result, f"{path.name}: panel {panel['title']!r} shows nothing: {target['expr']}"


# Last: the wait for Ray's gauge expiry overlaps the tests above.
# Ray's metrics agent drops a gauge series not exported for two report intervals, and the agent
# uses the default interval (10 s) whatever _system_config says (measured: a gauge set once is
# scraped for 20 s, then never again).
RAY_GAUGE_EXPIRY_S = 20.0


def test_gauges_return_to_idle(stack):
    """The gauges read idle, and still do after an idle period longer than Ray's gauge expiry
    (the slot capacity was set once, when the slot manager started, long before the traffic)."""
    time.sleep(max(0.0, stack.idle_since + RAY_GAUGE_EXPIRY_S + 5 - time.monotonic()))
    v = stack.value
    assert v("sum(ray_dspark_requests_running)") == 0
    assert v("sum(ray_dspark_requests_waiting)") == 0
    assert v("sum(ray_dspark_kv_pool_tokens_in_use)") == 0
    assert v("sum(ray_dspark_kv_pool_tokens_capacity)") >= MAX_CONTEXT + K
    assert v("sum(ray_dspark_slot_in_use)") == 0
    assert v("sum(ray_dspark_slot_capacity)") == 2

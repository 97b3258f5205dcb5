"""The Grafana dashboards of ``dashboards/``, written as data.

Four dashboards: serving (traffic, latency, errors), speculation (acceptance,
draft vs verify time), slots (occupancy, hold times, stale releases,
exhaustion) and cluster (per-rank step and all-reduce time). The JSON files in
``dashboards/`` are generated from here (``dspark dashboards build``); tests
check that they are up to date, that each is a valid dashboard, and that every
metric they query exists in a real Prometheus scrape of a running server.

Queries use the names Prometheus sees: Ray adds the ``ray_`` prefix and
``_total`` to counters (``dspark_ray.runtime.metrics`` and ``dspark_ray.slots``
define them). Time shares divide the exact ``*_time_seconds_total`` counters;
percentiles come from the histograms' buckets.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
PROVISIONED_DATASOURCE_UID = "dspark-prometheus"
RATE = "$__rate_interval"
MODEL = '{model=~"$model"}'  # the label filter of the engine's metrics
APP = '{app=~"$app"}'  # the label filter of the slot manager's metrics


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str = ""


@dataclass(frozen=True)
class Panel:
    title: str
    queries: tuple[Query, ...]
    unit: str = "short"
    description: str = ""
    width: int = 12  # of 24 grid columns


@dataclass(frozen=True)
class Row:
    title: str
    panels: tuple[Panel, ...]


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    rows: tuple[Row, ...]
    variable: str  # "model" or "app": the label the dashboard filters on


def q(expr: str, legend: str = "") -> Query:
    return Query(expr, legend)


def percentiles(metric: str, labels: str = MODEL, by: str = "", scale: str = "") -> tuple[Query, ...]:
    """p50, p90, p99 of histogram ``metric`` (its ``_bucket`` series)."""
    group = f"le{', ' + by if by else ''}"
    prefix = f"{{{{{by}}}}} " if by else ""
    return tuple(
        q(f"histogram_quantile({p}, sum by ({group}) (rate({metric}_bucket{labels}[{RATE}]))){scale}",
          f"{prefix}p{int(p * 100)}")
        for p in (0.5, 0.9, 0.99)
    )


SERVING = Dashboard(
    uid="dspark-serving",
    title="dspark / Serving",
    description="Traffic, latency percentiles and errors of the dspark_ray engine loops and their HTTP servers.",
    variable="model",
    rows=(
        Row("Traffic", (
            Panel("Finished requests per second, by reason", (
                q(f"sum by (reason) (rate(ray_dspark_requests_finished_total{MODEL}[{RATE}]))", "{{reason}}"),),
                unit="reqps", description="stop and length are normal ends; abort = client gone; error = engine."),
            Panel("Requests running and waiting", (
                q(f"sum(ray_dspark_requests_running{MODEL})", "running"),
                q(f"sum(ray_dspark_requests_waiting{MODEL})", "waiting")),
                description="Waiting requests hold no slot yet; a growing queue means too little capacity."),
            Panel("Tokens per second", (
                q(f"sum(rate(ray_dspark_prompt_tokens_total{MODEL}[{RATE}]))", "prompt"),
                q(f"sum(rate(ray_dspark_generation_tokens_total{MODEL}[{RATE}]))", "generation"))),
            Panel("Batch size (requests per step)", percentiles("ray_dspark_batch_size")),
            Panel("Target KV pool use", (
                q(f"sum by (replica) (ray_dspark_kv_pool_tokens_in_use{MODEL}) / "
                  f"sum by (replica) (ray_dspark_kv_pool_tokens_capacity{MODEL})", "{{replica}}"),),
                unit="percentunit", description="Near 100% the scheduler preempts requests (recompute)."),
            Panel("Preemptions per second", (
                q(f"sum(rate(ray_dspark_preemptions_total{MODEL}[{RATE}]))", "preemptions"),),
                description="Requests whose target KV was freed to make room; they are recomputed later."),
        )),
        Row("Prefill", (
            Panel("Prefix cache hit rate", (
                q(f"sum(rate(ray_dspark_prefix_cache_hit_tokens_total{MODEL}[{RATE}])) / "
                  f"sum(rate(ray_dspark_prefix_cache_query_tokens_total{MODEL}[{RATE}]))", "hit tokens / prompt tokens"),),
                unit="percentunit", width=8, description="Prompt tokens the target mapped from its prefix cache "
                "instead of computing (shared system prompts, chat history)."),
            Panel("Prefill tokens per second", (
                q(f"sum(rate(ray_dspark_prefix_cache_query_tokens_total{MODEL}[{RATE}]))", "prompt tokens"),
                q(f"sum(rate(ray_dspark_prefix_cache_hit_tokens_total{MODEL}[{RATE}]))", "from the cache"),
                q(f"sum(rate(ray_dspark_prefill_chunks_total{MODEL}[{RATE}]))", "partial chunks")), width=8,
                description="Prompts longer than max_num_batched_tokens are fed in chunks beside the decode rows."),
            Panel("Requests mid-prefill", (
                q(f"sum(ray_dspark_requests_prefilling{MODEL})", "prefilling"),), width=8,
                description="Running requests whose prompt (or recompute after preemption) is still being fed."),
        )),
        Row("Latency", (
            Panel("Time to first token", percentiles("ray_dspark_time_to_first_token_seconds"), unit="s", width=8),
            Panel("Inter-token latency", percentiles("ray_dspark_inter_token_latency_seconds"), unit="s", width=8,
                  description="Per token: a step that emits several tokens shares its gap among them."),
            Panel("End-to-end request latency", percentiles("ray_dspark_e2e_request_latency_seconds"), unit="s",
                  width=8),
            Panel("HTTP latency at the replicas' own servers (http_port)",
                  percentiles("ray_dspark_http_request_latency_seconds"), unit="s", width=12,
                  description="Arrival to the last byte, streams included (dspark_ray/openai/http.py)."),
            Panel("HTTP latency at the Serve proxy (http_port: null)",
                  percentiles("ray_serve_http_request_latency_ms", labels="", scale=" / 1000"), unit="s", width=12),
        )),
        Row("Errors", (
            Panel("HTTP responses per second, by status code", (
                q(f"sum by (status_code) (rate(ray_dspark_http_requests_total{MODEL}[{RATE}]))",
                  "{{status_code}} (replicas)"),
                q(f"sum by (status_code) (rate(ray_serve_num_http_requests_total[{RATE}]))",
                  "{{status_code}} (Serve proxy)"),),
                unit="reqps"),
            Panel("HTTP errors per second, by code and route", (
                q(f'sum by (status_code, route) (rate(ray_dspark_http_requests_total{{model=~"$model", '
                  f'status_code=~"[45].."}}[{RATE}]))', "{{status_code}} {{route}} (replicas)"),
                q(f"sum by (error_code, route) (rate(ray_serve_num_http_error_requests_total[{RATE}]))",
                  "{{error_code}} {{route}} (Serve proxy)"),),
                unit="reqps", description="4xx: bad input (no state changed); 503: overloaded, no slots, engine "
                "dead (see Retry-After)."),
            Panel("HTTP error ratio", (
                q(f'sum(rate(ray_dspark_http_requests_total{{model=~"$model", status_code=~"[45].."}}[{RATE}])) / '
                  f"sum(rate(ray_dspark_http_requests_total{MODEL}[{RATE}]))", "errors / requests (replicas)"),
                q(f"sum(rate(ray_serve_num_http_error_requests_total[{RATE}])) / "
                  f"sum(rate(ray_serve_num_http_requests_total[{RATE}]))", "errors / requests (Serve proxy)"),),
                unit="percentunit"),
            Panel("Requests ended by abort or error", (
                q(f'sum by (reason) (rate(ray_dspark_requests_finished_total{{model=~"$model", '
                  f'reason=~"abort|error"}}[{RATE}]))', "{{reason}}"),),
                unit="reqps", description="error: the engine failed them (target or loop); see the replica log."),
        )),
    ),
)

SPECULATION = Dashboard(
    uid="dspark-speculation",
    title="dspark / Speculation",
    description="Draft acceptance (vLLM's counters: drafts, draft tokens, accepted tokens, per position) and the "
                "time spent drafting versus verifying.",
    variable="model",
    rows=(
        Row("Acceptance", (
            Panel("Mean acceptance length", (
                q(f"1 + sum by (model) (rate(ray_dspark_spec_decode_num_accepted_tokens_total{MODEL}[{RATE}])) / "
                  f"sum by (model) (rate(ray_dspark_spec_decode_num_drafts_total{MODEL}[{RATE}]))", "{{model}}"),),
                description="Tokens emitted per verification step: 1 + accepted / drafts (1 = drafts useless, "
                "k + 1 = all accepted)."),
            Panel("Draft acceptance rate", (
                q(f"sum by (model) (rate(ray_dspark_spec_decode_num_accepted_tokens_total{MODEL}[{RATE}])) / "
                  f"sum by (model) (rate(ray_dspark_spec_decode_num_draft_tokens_total{MODEL}[{RATE}]))", "{{model}}"),),
                unit="percentunit"),
            Panel("Acceptance rate per position", (
                q(f"sum by (model, position) "
                  f"(rate(ray_dspark_spec_decode_num_accepted_tokens_per_pos_total{MODEL}[{RATE}])) "
                  f"/ ignoring(position) group_left "
                  f"sum by (model) (rate(ray_dspark_spec_decode_num_drafts_total{MODEL}[{RATE}]))", "position {{position}}"),),
                unit="percentunit", description="Share of drafts accepted at least up to this position (0-based). "
                "A collapse at position 0 with healthy later ratios points at the draft, not the window."),
            Panel("Drafts and tokens per second", (
                q(f"sum(rate(ray_dspark_spec_decode_num_drafts_total{MODEL}[{RATE}]))", "drafts"),
                q(f"sum(rate(ray_dspark_spec_decode_num_draft_tokens_total{MODEL}[{RATE}]))", "draft tokens"),
                q(f"sum(rate(ray_dspark_spec_decode_num_accepted_tokens_total{MODEL}[{RATE}]))", "accepted tokens"))),
        )),
        Row("Adaptive speculation", (
            Panel("Steps by chosen k", (
                q(f"sum by (k) (rate(ray_dspark_spec_k_steps_total{MODEL}[{RATE}])) / ignoring(k) group_left "
                  f"sum(rate(ray_dspark_spec_k_steps_total{MODEL}[{RATE}]))", "k = {{k}}"),),
                unit="percentunit", description="Share of engine steps at each k adaptive speculation chose "
                "(engine/adaptive.py): k falls as the batch grows or acceptance drops; 0 = no draft at all."),
            Panel("Draft tokens per verification (mean k)", (
                q(f"sum by (model) (rate(ray_dspark_spec_decode_num_draft_tokens_total{MODEL}[{RATE}])) / "
                  f"sum by (model) (rate(ray_dspark_spec_decode_num_drafts_total{MODEL}[{RATE}]))", "{{model}}"),),
                description="The k requests actually verified, per request step that carried drafts."),
        )),
        Row("Draft vs verify time", (
            Panel("Engine time share by phase", (
                q(f"sum by (phase) (rate(ray_dspark_step_phase_time_seconds_total{MODEL}[{RATE}]))", "{{phase}}"),),
                unit="percentunit", description="Seconds per second in each phase of the engine loop: propose = "
                "draft, verify = target. The rest of the wall clock the loop was idle."),
            Panel("Propose vs verify per step", percentiles(
                "ray_dspark_step_phase_seconds", labels='{model=~"$model", phase=~"propose|verify"}', by="phase"),
                unit="s"),
        )),
    ),
)

SLOTS = Dashboard(
    uid="dspark-slots",
    title="dspark / Slots",
    description="The application's request-stable slots: occupancy, hold times, stale releases and exhaustion.",
    variable="app",
    rows=(
        Row("Occupancy", (
            Panel("Slot occupancy", (
                q(f"sum by (app) (ray_dspark_slot_in_use{APP}) / sum by (app) (ray_dspark_slot_capacity{APP})",
                  "{{app}}"),),
                unit="percentunit"),
            Panel("Slots held vs requests in flight", (
                q(f"sum(ray_dspark_slot_in_use{APP})", "slots held"),
                q("sum(ray_dspark_requests_running) + sum(ray_dspark_requests_waiting)", "requests in flight"),
                q("sum(ray_dspark_requests_prefilling)", "of them mid-prefill")),
                description="Slots held with no request in flight for minutes is a leak (runbooks/slots.md). A "
                "request mid-prefill holds its slot between its chunks."),
            Panel("Slot hold time", percentiles("ray_dspark_slot_hold_time_seconds", labels=APP), unit="s"),
            Panel("Allocations and releases per second", (
                q(f"sum(rate(ray_dspark_slot_allocations_total{APP}[{RATE}]))", "allocations"),
                q(f"sum(rate(ray_dspark_slot_releases_total{APP}[{RATE}]))", "releases"))),
        )),
        Row("Trouble", (
            Panel("Exhaustion: allocations refused per second", (
                q(f"sum(rate(ray_dspark_slot_exhausted_total{APP}[{RATE}]))", "refused"),),
                description="Admissions waiting for a free slot. Sustained: raise capacity or add replicas."),
            Panel("Stale releases per second", (
                q(f"sum(rate(ray_dspark_slot_stale_releases_total{APP}[{RATE}]))", "stale"),),
                description="Releases of unknown ids or old epochs (retries, late messages). Harmless alone; "
                "a steady stream after a slot-manager restart means owners are out of step."),
        )),
    ),
)

CLUSTER = Dashboard(
    uid="dspark-cluster",
    title="dspark / Cluster",
    description="Tensor-parallel target shards: per-rank step time and the all-reduce (collective) share.",
    variable="model",
    rows=(
        Row("Target ranks", (
            Panel("Target step time per rank (mean)", (
                q(f"sum by (replica, rank) (rate(ray_dspark_target_step_time_seconds_total{MODEL}[{RATE}])) / "
                  f"sum by (replica, rank) (rate(ray_dspark_target_step_seconds_count{MODEL}[{RATE}]))",
                  "{{replica}} rank {{rank}}"),),
                unit="s"),
            Panel("Target step time per rank (p99)", (
                q(f"histogram_quantile(0.99, sum by (le, replica, rank) "
                  f"(rate(ray_dspark_target_step_seconds_bucket{MODEL}[{RATE}])))", "{{replica}} rank {{rank}}"),),
                unit="s"),
            Panel("All-reduce time per step (mean)", (
                q(f"sum by (replica, rank) (rate(ray_dspark_target_collective_time_seconds_total{MODEL}[{RATE}])) / "
                  f"sum by (replica, rank) (rate(ray_dspark_target_collective_seconds_count{MODEL}[{RATE}]))",
                  "{{replica}} rank {{rank}}"),),
                unit="s", description="Includes waiting for the slower rank: equal compute, unequal collective "
                "time means one rank is late."),
            Panel("All-reduce share of the target step", (
                q(f"sum by (replica, rank) (rate(ray_dspark_target_collective_time_seconds_total{MODEL}[{RATE}])) / "
                  f"sum by (replica, rank) (rate(ray_dspark_target_step_time_seconds_total{MODEL}[{RATE}]))",
                  "{{replica}} rank {{rank}}"),),
                unit="percentunit", description="High on two boxes: check the link (runbooks/nccl.md)."),
            Panel("All-reduce time per step (p99)", (
                q(f"histogram_quantile(0.99, sum by (le, replica, rank) "
                  f"(rate(ray_dspark_target_collective_seconds_bucket{MODEL}[{RATE}])))", "{{replica}} rank {{rank}}"),),
                unit="s"),
            Panel("Engine steps per second", (
                q(f"sum by (replica) (rate(ray_dspark_batch_size_count{MODEL}[{RATE}]))", "{{replica}}"),)),
        )),
        Row("Nodes", (
            Panel("Object store memory", (
                q("sum by (NodeAddress, Location) (ray_object_store_memory)", "{{NodeAddress}} {{Location}}"),),
                unit="bytes"),
            Panel("Node CPU utilization", (
                q("avg by (instance) (ray_node_cpu_utilization)", "{{instance}}"),), unit="percent"),
        )),
    ),
)

DASHBOARDS = (SERVING, SPECULATION, SLOTS, CLUSTER)


def _variables(dash: Dashboard) -> list[dict]:
    source = ("ray_dspark_requests_running", "model") if dash.variable == "model" else ("ray_dspark_slot_capacity",
                                                                                        "app")
    definition = f"label_values({source[0]}, {source[1]})"
    return [
        {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
         "current": {"text": "Prometheus (dspark)", "value": PROVISIONED_DATASOURCE_UID}, "hide": 0,
         "refresh": 1, "regex": "", "options": []},
        {"name": dash.variable, "label": dash.variable, "type": "query", "datasource": DATASOURCE,
         "definition": definition, "query": {"query": definition, "refId": dash.variable},
         "includeAll": True, "multi": True, "allValue": ".*", "current": {"text": "All", "value": "$__all"},
         "refresh": 2, "sort": 1, "hide": 0, "options": []},
    ]


def _panel_json(panel: Panel, panel_id: int, x: int, y: int) -> dict:
    return {
        "id": panel_id, "type": "timeseries", "title": panel.title, "description": panel.description,
        "datasource": DATASOURCE, "gridPos": {"h": 8, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": panel.unit, "min": 0}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                    "tooltip": {"mode": "multi", "sort": "none"}},
        "targets": [{"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": query.expr,
                     "legendFormat": query.legend or "__auto", "range": True}
                    for i, query in enumerate(panel.queries)],
    }


def to_json(dash: Dashboard) -> dict:
    """The Grafana dashboard model (schema 39: Grafana 10 and 11) of ``dash``."""
    panels, panel_id, y = [], 1, 0
    for row in dash.rows:
        panels.append({"id": panel_id, "type": "row", "title": row.title, "collapsed": False, "panels": [],
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}})
        panel_id, y, x = panel_id + 1, y + 1, 0
        for panel in row.panels:
            if x + panel.width > 24:
                x, y = 0, y + 8
            panels.append(_panel_json(panel, panel_id, x, y))
            panel_id, x = panel_id + 1, x + panel.width
        y += 8
    return {
        "uid": dash.uid, "title": dash.title, "description": dash.description, "tags": ["dspark"],
        "timezone": "browser", "editable": True, "graphTooltip": 1, "schemaVersion": 39, "version": 1,
        "refresh": "10s", "time": {"from": "now-1h", "to": "now"}, "fiscalYearStartMonth": 0,
        "templating": {"list": _variables(dash)}, "annotations": {"list": []}, "links": [], "panels": panels,
    }


def file_name(dash: Dashboard) -> str:
    return f"{dash.uid.removeprefix('dspark-')}.json"


def render(dash: Dashboard) -> str:
    return json.dumps(to_json(dash), indent=2) + "\n"


def write_all(folder: Path) -> list[Path]:
    """Write every dashboard's JSON into ``folder``; returns the paths."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for dash in DASHBOARDS:
        path = folder / file_name(dash)
        path.write_text(render(dash))
        paths.append(path)
    return paths


def load_all(folder: Path) -> list[dict]:
    """The dashboard JSON files in ``folder`` (what Grafana provisioning would load)."""
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]


_PROMQL_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                    "offset", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression (or a ``label_values(metric, label)`` query) reads."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)  # string literals
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # range selectors
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)  # label lists
    text = re.sub(r"label_values\(\s*([a-zA-Z_:][\w:]*)\s*,\s*\w+\s*\)", r"\1", text)
    names = set()
    for match in re.finditer(r"(?<![\w.$])([a-zA-Z_:][\w:]*)(\s*\()?", text):
        name, call = match.group(1), match.group(2)
        if not call and name not in _PROMQL_KEYWORDS:
            names.add(name)
    return names


def queries(dash: dict) -> list[str]:
    """Every PromQL expression of a dashboard JSON: panel targets and query variables."""
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dash["templating"]["list"] if v["type"] == "query"]
    return exprs

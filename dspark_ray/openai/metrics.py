"""What the HTTP front exports: its requests as Ray metrics, and speculation under vLLM's names.

``HTTPMetrics`` counts the requests a replica's own HTTP server answers
(``http.py``), as Serve's proxy counts those it carries; ``vllm_spec_decode_text``
is ``GET /metrics``: the replica's speculation counters in Prometheus text under
vLLM's names. The engine's and the workers' metrics are the runtime's
(``dspark_ray/runtime/metrics.py``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from ray.util.metrics import Counter, Histogram

from dspark_ray.engine.outputs import SpecCounts

log = logging.getLogger(__name__)


def add_counts(counts: Iterable[SpecCounts]) -> SpecCounts:
    """The sum of some replicas' speculation counters (per position, over the longest list)."""
    total = SpecCounts()
    for c in counts:
        total.add(c)
    return total


def vllm_spec_decode_text(totals: SpecCounts, model: str) -> str:
    """Speculation counters in Prometheus text format under vLLM's names (``vllm:spec_decode_*``).

    Served on the API port at ``GET /metrics`` so that tools written for
    vLLM's OpenAI server (its ``vllm bench serve`` reports acceptance length
    from these) read dspark_ray's speculation too. A replica serving HTTP
    itself counts every replica sharing its port on the machine
    (``balance.LoadBoard``), whichever of them answers; through Serve's proxy,
    the replica that answered. For the whole application, across machines,
    use Ray's exported ``ray_dspark_*`` metrics.
    """
    label = 'model_name="' + model.replace("\\", "\\\\").replace('"', '\\"') + '"'
    lines = []
    for name, doc, value in (
        ("num_drafts", "Verification steps that carried drafts.", totals.drafts),
        ("num_draft_tokens", "Draft tokens proposed.", totals.draft_tokens),
        ("num_accepted_tokens", "Draft tokens accepted.", totals.accepted_tokens),
    ):
        lines += [f"# HELP vllm:spec_decode_{name}_total {doc}", f"# TYPE vllm:spec_decode_{name}_total counter",
                  f"vllm:spec_decode_{name}_total{{{label}}} {value}"]
    name = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    lines += [f"# HELP {name} Drafts accepted at least up to position (0-based).", f"# TYPE {name} counter"]
    lines += [f'{name}{{{label},position="{pos}"}} {n}' for pos, n in enumerate(totals.accepted_per_position)]
    return "\n".join(lines) + "\n"


# The routes HTTP metrics name; any other path is counted as "other" (a client cannot mint tag values).
HTTP_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/stats", "/metrics"})
HTTP_BOUNDARIES = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160]


class HTTPMetrics:
    """Requests a replica's own HTTP server answered (``dspark_ray.openai.http``), by route and status.

    Serve's proxy counts the requests it carries (``ray_serve_num_http_requests``
    and its latency histogram); these are the same for the requests that reach
    the replica directly: ``dspark_http_requests`` (tags ``route``, ``method``,
    ``status_code``) and ``dspark_http_request_latency_seconds`` (arrival to the
    response's last byte, streams included). One increment per request, none
    per streamed chunk.
    """

    def __init__(self, model: str, replica: str) -> None:
        tags = {"model": model, "replica": replica}
        self.requests = Counter("dspark_http_requests", "HTTP requests answered by the replica itself, by route, "
                                "method and status code.", tag_keys=(*tags, "route", "method", "status_code"))
        self.latency = Histogram("dspark_http_request_latency_seconds", "Arrival to the last byte of the response.",
                                 boundaries=HTTP_BOUNDARIES, tag_keys=(*tags, "route"))
        for metric in (self.requests, self.latency):
            metric.set_default_tags(tags)

    def record(self, route: str, method: str, status: int, seconds: float) -> None:
        try:
            self.requests.inc(tags={"route": route, "method": method, "status_code": str(status)})
            self.latency.observe(seconds, tags={"route": route})
        except Exception:  # noqa: BLE001 - metrics must not fail a request
            log.debug("recording HTTP metrics failed", exc_info=True)

    def wrap(self, app):
        """``app`` (ASGI) with every HTTP request recorded when its response ends."""

        async def recorded(scope, receive, send):
            if scope["type"] != "http":
                return await app(scope, receive, send)
            start, status = time.monotonic(), [500]

            async def send_recorded(message):
                if message["type"] == "http.response.start":
                    status[0] = message["status"]
                await send(message)

            try:
                await app(scope, receive, send_recorded)
            finally:
                path = scope.get("path", "")
                self.record(path if path in HTTP_ROUTES else "other", scope.get("method", ""), status[0],
                            time.monotonic() - start)

        return recorded

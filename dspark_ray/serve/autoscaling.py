"""Autoscaling when the replicas serve HTTP themselves (``http_port``, dspark_ray/openai/http.py).

Serve's autoscaler counts the requests that its proxy and handles carry. A
request that reaches a replica's own HTTP server is not among them, so with
``http_port`` Serve would see an idle deployment however busy it is. Each
replica therefore reports the requests its engine holds (running, queued,
and those submitted but not yet taken in) as the custom autoscaling metric
``ONGOING_METRIC`` (``DSparkServer.record_autoscaling_stats``), and
``ongoing_requests_policy`` is Serve's default policy with that count: the
same ``target_ongoing_requests``, delays and smoothing, a request counted
once whichever way it came (the engine holds handle requests too; requests
still queued at a handle count through Serve's own figure, whichever is
larger).
"""

from __future__ import annotations

from typing import Any

from ray.serve.autoscaling_policy import replica_queue_length_autoscaling_policy
from ray.serve.config import AutoscalingContext

ONGOING_METRIC = "dspark_ongoing_requests"
POLICY_PATH = "dspark_ray.serve.autoscaling:ongoing_requests_policy"


def ongoing_requests(aggregated_metrics: dict[str, dict[Any, float]] | None) -> float | None:
    """The replicas' reported requests, summed; None before any replica has reported."""
    held = (aggregated_metrics or {}).get(ONGOING_METRIC)
    return float(sum(held.values())) if held else None


def ongoing_requests_policy(ctx: AutoscalingContext) -> tuple[float, dict[str, Any]]:
    """Serve's default policy, counting the requests the replicas hold (module docstring)."""
    held = ongoing_requests(ctx.aggregated_metrics)
    if held is not None:
        # total_num_requests is a cached property of the context: this is the figure the default
        # policy reads.
        ctx.__dict__["total_num_requests"] = max(ctx.total_num_requests, held)
    return replica_queue_length_autoscaling_policy(ctx)


def with_policy(autoscaling_config: dict[str, Any]) -> dict[str, Any]:
    """``autoscaling_config`` with ``ongoing_requests_policy``, unless it names a policy of its own."""
    if "policy" in autoscaling_config:
        return autoscaling_config
    return {**autoscaling_config, "policy": {"policy_function": POLICY_PATH}}

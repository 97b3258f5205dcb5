"""The Serve application builder: ``import_path: dspark_ray.serve.app:build_app`` in YAML.

``args:`` in the YAML are ``AppConfig`` fields. The builder applies
``@serve.deployment`` (with the config's ``num_replicas`` or
``autoscaling_config``); the FastAPI wrapper comes from ``dspark_ray.serve.server``.
"""

from __future__ import annotations

from ray import serve
from ray.serve import Application
from ray.serve.config import BackpressureConfig

from dspark_ray.serve.autoscaling import with_policy
from dspark_ray.serve.config import AppConfig
from dspark_ray.serve.server import DSparkIngress

HEAD_NODE_RESOURCE = "node:__internal_head__"  # Ray gives the head node this resource (amount 1)


def build_app(args: dict | None = None) -> Application:
    config = AppConfig(**(args or {}))
    # Admission is the replica's: it runs max_num_seqs requests, queues
    # max_queued_requests and answers 503 + Retry-After (an OpenAI error body)
    # beyond that. Serve must therefore let more requests through to a replica
    # than it can hold, or the excess would wait in Serve's router, unbounded,
    # and never be refused. The headroom covers finished streams still
    # flushing and refusals in progress. A burst beyond that waits in Serve's
    # router (which counts simultaneous arrivals as queued while it routes
    # them) for the replica to refuse it, milliseconds each. Only past Serve's
    # own queue limit does Serve refuse, with 503 + Retry-After and a
    # plain-text body, as a backstop. That limit is well above the headroom:
    # at the headroom, most of a burst of a few hundred streams met the
    # backstop instead of an OpenAI error body. A request queued in the router
    # costs the proxy a connection, not its body (the replica reads the body).
    holds = config.max_queued_requests + config.max_num_seqs
    headroom = max(holds, 32)
    # Replicas: a fixed count, or Serve's autoscaler (Serve refuses both at once). Each replica
    # leases from the application's one slot manager; its buffers hold its own share
    # (AppConfig.slots_per_replica, dspark_ray/slots/replica.py).
    if config.autoscaling_config is not None:
        # Requests served by the replicas' own HTTP server never pass Serve's proxy: autoscale on
        # what each replica holds (dspark_ray/serve/autoscaling.py).
        scaling = config.autoscaling_config
        replicas = dict(autoscaling_config=with_policy(scaling) if config.http_port is not None else scaling)
    else:
        replicas = dict(num_replicas=config.num_replicas)
    # A replica that serves HTTP itself (http_port) runs on the head node, as the proxy of the
    # shipped YAMLs did (proxy_location: HeadOnly), so the address clients use does not depend on
    # where Serve happened to place it; the replicas there share the port.
    actor_options: dict = {"num_cpus": 0}
    if config.http_port is not None:
        actor_options["resources"] = {HEAD_NODE_RESOURCE: 0.001}
    deployment = serve.deployment(
        DSparkIngress,
        name="DSparkServer",
        **replicas,
        ray_actor_options=actor_options,
        max_ongoing_requests=holds + headroom,
        max_queued_requests=max(1024, 4 * (holds + headroom)),
        backpressure_config=BackpressureConfig(status_code=503, retry_after_s=1),
        health_check_period_s=10,
        graceful_shutdown_timeout_s=config.graceful_shutdown_timeout_s,
    )
    return deployment.bind(config.model_dump())

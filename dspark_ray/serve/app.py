"""The Serve application builder: ``import_path: dspark_ray.serve.app:build_app`` in YAML.

``args:`` in the YAML are ``AppConfig`` fields. The builder applies
``@serve.deployment``; the FastAPI wrapper comes from ``dspark_ray.serve.server``.
"""

from __future__ import annotations

from ray import serve
from ray.serve import Application

from dspark_ray.serve.config import AppConfig
from dspark_ray.serve.server import DSparkIngress


def build_app(args: dict | None = None) -> Application:
    config = AppConfig(**(args or {}))
    deployment = serve.deployment(
        DSparkIngress,
        name="DSparkServer",
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=config.max_queued_requests + config.max_num_seqs,
        health_check_period_s=10,
    )
    return deployment.bind(config.model_dump())

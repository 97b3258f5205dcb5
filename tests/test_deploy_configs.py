"""The shipped Serve configs are valid: every `args:` key is an AppConfig field, the local ones load."""

from __future__ import annotations

import pytest
import yaml

from conftest import REPO
from dspark_ray.serve.config import AppConfig

DEPLOY = REPO / "deploy"


def app_args(name: str) -> dict:
    config = yaml.safe_load((DEPLOY / name).read_text())
    (app,) = config["applications"]
    assert app["import_path"] == "dspark_ray.serve.app:build_app"
    return app["args"]


@pytest.mark.parametrize("name, tp", [("dspark.yaml", 1), ("dspark-tp2.yaml", 2)])
def test_local_configs_validate_with_the_shipped_pair(name, tp):
    config = AppConfig(**app_args(name))
    assert config.tensor_parallel_size == tp
    assert config.device == "cpu" and config.model_name == "shakespeare-target"


def test_local_configs_differ_only_in_tensor_parallelism():
    one, two = app_args("dspark.yaml"), app_args("dspark-tp2.yaml")
    assert {k for k in one if one[k] != two.get(k)} == {"tensor_parallel_size"}
    assert set(one) == set(two)


def test_two_box_config_uses_only_known_fields():
    args = app_args("dspark-2x-spark.yaml")
    assert set(args) <= set(AppConfig.model_fields), set(args) - set(AppConfig.model_fields)
    assert args["placement_strategy"] == "STRICT_SPREAD" and args["tensor_parallel_size"] == 2

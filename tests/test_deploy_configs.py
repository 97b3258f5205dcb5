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


def test_local_configs_differ_only_in_tensor_parallelism_and_threads():
    """The TP=2 demo runs two shards on the one machine: one thread each and no binding (two processes
    bound by OMP_PROC_BIND would share the first cores), the draft in a worker of its own. The default
    is one process, the draft inside it, its threads bound and spinning between steps, steps of up to
    16 rows on one thread."""
    one, two = app_args("dspark.yaml"), app_args("dspark-tp2.yaml")
    threading = {"torch_threads", "draft_placement", "worker_env_vars", "single_thread_max_rows"}
    assert {k for k in one if one[k] != two.get(k)} == {"tensor_parallel_size", *threading}
    assert set(one) - set(two) == {"draft_placement", "worker_env_vars", "single_thread_max_rows"}
    assert set(two) <= set(one)
    assert two["torch_threads"] == 1 and one["draft_placement"] == "target"
    assert AppConfig(**one).worker_env_vars == {"OMP_PROC_BIND": "true", "OMP_PLACES": "{1},{0}",
                                                "GOMP_SPINCOUNT": "30000000"}
    assert AppConfig(**one).single_thread_max_rows == 16 and AppConfig(**two).single_thread_max_rows == 0
    assert AppConfig(**two).worker_env_vars == {} and AppConfig(**two).draft_placement == "worker"


def test_two_box_config_uses_only_known_fields():
    args = app_args("dspark-2x-spark.yaml")
    assert set(args) <= set(AppConfig.model_fields), set(args) - set(AppConfig.model_fields)
    assert args["placement_strategy"] == "STRICT_SPREAD" and args["tensor_parallel_size"] == 2


def test_step_token_budget_reaches_the_engine():
    """max_num_batched_tokens is an app setting (the two-box config raises it to its context)."""
    args = app_args("dspark.yaml")
    assert AppConfig(**args).engine_config().max_num_batched_tokens == 4096
    assert AppConfig(**{**args, "max_num_batched_tokens": 8192}).engine_config().max_num_batched_tokens == 8192
    assert app_args("dspark-2x-spark.yaml")["max_num_batched_tokens"] == app_args("dspark-2x-spark.yaml")["max_context"]
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        AppConfig(**{**args, "max_num_batched_tokens": 0})


def test_every_config_shows_its_replica_count():
    for name in ("dspark.yaml", "dspark-tp2.yaml", "dspark-2x-spark.yaml"):
        assert app_args(name)["num_replicas"] == 1, name
    config = AppConfig(**app_args("dspark.yaml"))
    assert config.slots_per_replica == config.capacity  # one replica holds the whole capacity


@pytest.mark.parametrize("name", ["dspark.yaml", "dspark-tp2.yaml"])
def test_the_commented_autoscaling_example_is_valid_in_place_of_num_replicas(name):
    (line,) = [ln for ln in (DEPLOY / name).read_text().splitlines() if ln.strip().startswith("# autoscaling_config:")]
    example = yaml.safe_load(line.strip().removeprefix("#"))
    args = {k: v for k, v in app_args(name).items() if k != "num_replicas"}
    config = AppConfig(**args, **example)
    assert config.max_replicas == 2 and config.slots_per_replica == config.capacity // 2
    with pytest.raises(ValueError, match="exclude each other"):  # uncommented beside num_replicas: 2
        AppConfig(**{**args, "num_replicas": 2}, **example)

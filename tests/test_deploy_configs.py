"""The shipped Serve configs are valid: every `args:` key is an AppConfig field, the local ones load."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from conftest import REPO
from dspark_ray.engine.config import EngineConfig
from dspark_ray.serve.config import DERIVED_ENGINE_FIELDS, AppConfig

DEPLOY = REPO / "deploy"


def app_args(name: str) -> dict:
    config = yaml.safe_load((DEPLOY / name).read_text())
    (app,) = config["applications"]
    assert app["import_path"] == "dspark_ray.serve.app:build_app"
    return app["args"]


@pytest.mark.parametrize("name, tp", [("shakespeare.yaml", 1), ("dspark-tp2.yaml", 2)])
def test_local_configs_validate_with_the_shipped_pair(name, tp):
    config = AppConfig(**app_args(name))
    assert config.tensor_parallel_size == tp
    assert config.device == "cpu" and config.model_name == "shakespeare-target"


def test_the_embedded_default_serves_smollm2_from_its_installed_gguf():
    from dspark_ray.model.checkpoint import DEFAULT_MODEL, locate

    args = app_args("dspark.yaml")
    assert args["model"] == DEFAULT_MODEL
    config = AppConfig(**args)
    assert config.model == str(locate(DEFAULT_MODEL)) and config.model.endswith(".gguf")
    assert config.model_name == "smollm2-135m-instruct" and config.device == "cpu"
    assert config.max_context == 2048 and config.memory_plan().fits


def test_local_configs_differ_only_in_tensor_parallelism_replicas_and_binding():
    """The TP=2 demo runs two shards of one replica on the one machine, one thread each, unbound, the
    draft in a worker of its own, eager (compile_model is tensor parallel 1 only). The default is two
    replicas, each one process with the draft inside it, on one torch thread bound to a core of its
    own (bind_cores), no OpenMP settings, its models compiled."""
    one, two = app_args("shakespeare.yaml"), app_args("dspark-tp2.yaml")
    assert {k for k in one if one[k] != two.get(k)} == {"tensor_parallel_size", "num_replicas", "bind_cores",
                                                       "bind_replica", "draft_placement", "compile_model"}
    assert set(one) - set(two) == {"draft_placement", "bind_cores", "bind_replica", "compile_model"}
    assert set(two) <= set(one)
    default, demo = AppConfig(**one), AppConfig(**two)
    assert default.num_replicas == 2 and default.torch_threads == 1 and default.bind_cores and default.bind_replica
    assert default.draft_placement == "target" and default.worker_env_vars == {}
    assert default.single_thread_max_rows == 0  # one thread: nothing to choose
    assert default.engine_config().compile_model and not demo.engine_config().compile_model
    assert demo.torch_threads == 1 and not demo.bind_cores and demo.worker_env_vars == {}
    assert demo.draft_placement == "worker" and demo.num_replicas == 1


def test_two_box_config_uses_only_known_fields():
    args = app_args("dspark-2x-spark.yaml")
    assert set(args) <= set(AppConfig.model_fields), set(args) - set(AppConfig.model_fields)
    assert args["placement_strategy"] == "STRICT_SPREAD" and args["tensor_parallel_size"] == 2


def test_step_token_budget_reaches_the_engine():
    """max_num_batched_tokens is an app setting (the two-box config raises it to its context)."""
    args = app_args("shakespeare.yaml")
    assert AppConfig(**args).engine_config().max_num_batched_tokens == 4096
    assert AppConfig(**{**args, "max_num_batched_tokens": 8192}).engine_config().max_num_batched_tokens == 8192
    assert app_args("dspark-2x-spark.yaml")["max_num_batched_tokens"] == app_args("dspark-2x-spark.yaml")["max_context"]
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        AppConfig(**{**args, "max_num_batched_tokens": 0})


def test_every_engine_field_is_an_app_field_of_the_same_name_or_derived():
    """AppConfig.engine_config() passes every EngineConfig field through by name but the few it
    computes (DERIVED_ENGINE_FIELDS), so a field added to EngineConfig must be added to AppConfig
    (with its description) or listed there; this names the one that is neither."""
    engine = [f.name for f in dataclasses.fields(EngineConfig)]
    assert set(DERIVED_ENGINE_FIELDS) <= set(engine), set(DERIVED_ENGINE_FIELDS) - set(engine)
    missing = [name for name in engine if name not in DERIVED_ENGINE_FIELDS and name not in AppConfig.model_fields]
    assert not missing, f"EngineConfig field(s) {missing} are neither AppConfig fields nor DERIVED_ENGINE_FIELDS"
    # Values other than the defaults reach the engine unchanged; the derived ones as computed.
    args = {**app_args("dspark-tp2.yaml"), "num_speculative_tokens": 3, "adaptive_speculation": False,
            "speculation_max_batch": 5, "confidence_verification": False, "draft_window": 24, "max_context": 384,
            "kv_pool_tokens": 4000, "max_num_seqs": 9, "max_num_batched_tokens": 1000, "draft_dtype": None,
            "quantization": "none", "enable_prefix_caching": False, "memory_utilization": 0.8,
            "cuda_graphs": False, "capacity": 12, "num_replicas": 3, "draft_ahead": True}
    app = AppConfig(**args)
    config = app.engine_config()
    for name in engine:
        if name not in DERIVED_ENGINE_FIELDS:
            assert getattr(config, name) == getattr(app, name), name
    assert (config.capacity, config.pipeline, config.draft_ahead) == (4, True, True)
    target = AppConfig(**{**args, "draft_placement": "target"}).engine_config()
    assert (target.pipeline, target.draft_ahead) == (False, False)


def test_every_config_shows_its_replica_count():
    for name, replicas in (("shakespeare.yaml", 2), ("dspark-tp2.yaml", 1), ("dspark-2x-spark.yaml", 1)):
        assert app_args(name)["num_replicas"] == replicas, name
    config = AppConfig(**app_args("shakespeare.yaml"))
    assert config.slots_per_replica == config.capacity // 2 == config.max_num_seqs  # each replica: half


@pytest.mark.parametrize("name", ["shakespeare.yaml", "dspark-tp2.yaml"])
def test_the_commented_autoscaling_example_is_valid_in_place_of_num_replicas(name):
    (line,) = [ln for ln in (DEPLOY / name).read_text().splitlines() if ln.strip().startswith("# autoscaling_config:")]
    example = yaml.safe_load(line.strip().removeprefix("#"))
    args = {k: v for k, v in app_args(name).items() if k != "num_replicas"}
    config = AppConfig(**args, **example)
    assert config.max_replicas == 2 and config.slots_per_replica == config.capacity // 2
    with pytest.raises(ValueError, match="exclude each other"):  # uncommented beside num_replicas: 2
        AppConfig(**{**args, "num_replicas": 2}, **example)


def test_bind_cores_refuses_an_openmp_binding_beside_it():
    """bind_cores binds each worker's torch thread to CPUs of its own; OpenMP's binding variables in
    worker_env_vars would bind the threads again, by place, ignoring the claims: refused, naming both."""
    args = app_args("shakespeare.yaml")
    assert AppConfig(**args).bind_cores
    for name in ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY", "KMP_AFFINITY"):
        with pytest.raises(ValueError, match=f"bind_cores and worker_env_vars {name}"):
            AppConfig(**{**args, "worker_env_vars": {name: "true", "GOMP_SPINCOUNT": "1000"}})
    # Without bind_cores the variables stay the operator's choice; other variables go with bind_cores.
    assert AppConfig(**{**args, "bind_cores": False, "worker_env_vars": {"OMP_PROC_BIND": "true"}})
    assert AppConfig(**{**args, "worker_env_vars": {"GOMP_SPINCOUNT": "1000"}}).bind_cores



def test_every_replica_service_setting_comes_from_the_app_config():
    """ray_services builds ReplicaServices from AppConfig by name (SERVICE_FIELDS for the few that are
    named otherwise): a setting added to one without the other fails here, not silently at its default."""
    import inspect

    from dspark_ray.runtime.actors import SERVICE_FIELDS, ReplicaServices, service_settings

    keywords = list(inspect.signature(ReplicaServices.__init__).parameters)[2:]
    assert set(SERVICE_FIELDS) <= set(keywords)
    for name in keywords:  # a field, or a property of fields (worker_threads: torch_threads resolved)
        if name not in ("app_name", "replica"):
            source = SERVICE_FIELDS.get(name, name)
            assert source in AppConfig.model_fields or isinstance(getattr(AppConfig, source, None), property), name
    changed = AppConfig(**{**app_args("shakespeare.yaml"), "worker_spin_s": 0.25, "slot_admission_timeout_s": 7.0,
                           "step_timeout_factor": 3.0, "context_path": "replica"})
    got = service_settings(changed)
    assert (got["spin_s"], got["slot_timeout_s"], got["step_timeout_factor"], got["context_path"]) == \
        (0.25, 7.0, 3.0, "replica")
    assert got["slot_capacity"] == changed.capacity and got["bind_cores"] is True


def test_auto_threads_share_the_machines_cpus_among_the_workers(monkeypatch):
    """torch_threads auto: the CPUs this process may use, divided among every replica's worker processes
    (target shards, or one a machine when spread, plus a draft worker of its own), at least one each;
    the workers get the number (service_settings). The shipped default asks for it."""
    import os

    from dspark_ray.runtime.actors import service_settings
    from dspark_ray.serve import config as config_module

    assert app_args("dspark.yaml")["torch_threads"] == "auto"
    assert config_module.usable_cpus() == len(os.sched_getaffinity(0))
    base = {**app_args("shakespeare.yaml"), "torch_threads": "auto"}  # two replicas, the draft in rank 0
    monkeypatch.setattr(config_module, "usable_cpus", lambda: 8)
    assert AppConfig(**base).worker_threads == 4
    assert service_settings(AppConfig(**base))["torch_threads"] == 4
    assert AppConfig(**{**base, "draft_placement": "worker"}).worker_threads == 2  # + a draft worker each
    assert AppConfig(**{**base, "num_replicas": 1, "tensor_parallel_size": 2, "compile_model": False}).worker_threads == 4
    assert AppConfig(**{**base, "num_replicas": 1, "tensor_parallel_size": 2, "compile_model": False,
                        "placement_strategy": "STRICT_SPREAD"}).worker_threads == 8  # a shard a machine
    assert AppConfig(**{**base, "num_speculative_tokens": 0, "draft_placement": "worker"}).worker_threads == 4
    assert AppConfig(**{**base, "num_replicas": 1, "autoscaling_config": {"min_replicas": 1, "max_replicas": 4}}
                     ).worker_threads == 2  # as many as may run at once
    assert AppConfig(**{**base, "num_replicas": 16, "capacity": 64}).worker_threads == 1  # never none
    assert AppConfig(**{**base, "torch_threads": 3}).worker_threads == 3  # a number is kept as given
    for bad in (0, -1, "many"):
        with pytest.raises(ValueError, match="torch_threads"):
            AppConfig(**{**base, "torch_threads": bad})

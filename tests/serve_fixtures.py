"""Fixtures for the serving tests: the model pair, a real Ray cluster and a real `serve run`.

- ``serve_models``: the shipped pair (models/shakespeare-{target,draft}) when
  its weights are there, else a tiny random pair (vocabulary 4096 with the
  shipped tokenizer) saved once per session. The tests pass with either.
- ``start_serve`` / ``stop_serve``: a local Ray head started by this process
  (small object store, no dashboard), then ``serve run <yaml> --address ...``
  as a real subprocess; stopping kills exactly what was started (never
  ``ray stop``, which would take other people's clusters with it).

Test modules import what they use from here by name.
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import REPO, SHIPPED_DRAFT, SHIPPED_TARGET, save_tiny_checkpoint
from dspark_ray.ops.processes import free_port, port_is_free, stop_process, stop_serve_run

VENV_BIN = Path(sys.executable).parent
DEPLOY_YAML = REPO / "deploy" / "shakespeare.yaml"  # the shipped pair's own config
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
OBJECT_STORE_BYTES = 100 * 1024 * 1024
SERVE_NAMESPACE = "serve"  # where Serve replicas (and so the slot manager they start) live

# A random Llama the size the brief asks for: fast on CPU, divisible by TP 2.
TINY_PAIR = dict(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    tie_word_embeddings=True,
    max_position_embeddings=1024,
    eos_token_id=0,  # "<|endoftext|>" in the shipped tokenizer
    bos_token_id=0,
    pad_token_id=0,
)


def shipped_pair_ready() -> bool:
    return all((p / name).is_file() for p in (SHIPPED_TARGET, SHIPPED_DRAFT)
               for name in ("config.json", "model.safetensors", "tokenizer.json"))


@dataclass(frozen=True)
class ServeModels:
    target: Path
    draft: Path
    shipped: bool

    @property
    def name(self) -> str:
        """The served model name (the target folder's name)."""
        return self.target.name


def save_tiny_pair(root: Path) -> tuple[Path, Path]:
    """A random target and a perturbed copy as its draft (partial acceptance), with the shipped tokenizer."""
    import torch

    target, draft = root / "shakespeare-target", root / "shakespeare-draft"
    hf = save_tiny_checkpoint(target, seed=0, **TINY_PAIR)
    near = copy.deepcopy(hf)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in near.parameters():
            p.add_(0.05 * p.std() * torch.randn(p.shape, generator=gen))
    near.save_pretrained(draft)
    for folder in (target, draft):
        for name in TOKENIZER_FILES:
            shutil.copy(SHIPPED_TARGET / name, folder / name)
    return target, draft


@pytest.fixture(scope="session")
def serve_models(tmp_path_factory) -> ServeModels:
    if shipped_pair_ready():
        return ServeModels(SHIPPED_TARGET, SHIPPED_DRAFT, shipped=True)
    target, draft = save_tiny_pair(tmp_path_factory.mktemp("serve_models"))
    return ServeModels(target, draft, shipped=False)


# -- processes -------------------------------------------------------------------------------------


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    return env




def wait_for(predicate, timeout_s: float, interval_s: float = 0.1):
    """Poll ``predicate`` until it returns something truthy or ``timeout_s`` passes; its last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval_s)


def spec_counters(text: str) -> dict[str, int]:
    """``vllm:spec_decode_*_total`` values from Prometheus text, per-position ones keyed ``per_pos:<i>``."""
    out = {}
    for line in text.splitlines():
        if line.startswith("vllm:spec_decode_"):
            name, value = line.rsplit(" ", 1)
            metric = name.split("{")[0].removeprefix("vllm:spec_decode_").removesuffix("_total")
            if 'position="' in name:
                metric = "per_pos:" + name.split('position="')[1].split('"')[0]
            out[metric] = int(value)
    return out


def log_tail(path: Path, chars: int = 6000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "<no log>"


# -- a real `serve run` ------------------------------------------------------------------------


@dataclass
class ServeRun:
    """A running ``serve run`` of one YAML against a Ray head owned by this process."""

    yaml: Path
    port: int
    app_name: str
    model: str
    args: dict
    log: Path
    proc: subprocess.Popen
    gcs_address: str
    extra_apps: list[str] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def http_port(config: dict) -> int:
    """Where a Serve YAML's application answers HTTP: its replicas' own ``http_port``, else Serve's proxy."""
    port = config["applications"][0]["args"].get("http_port")
    return port if port is not None else config["http_options"]["port"]


def set_http_port(config: dict, port: int) -> None:
    if config["applications"][0]["args"].get("http_port") is not None:
        config["applications"][0]["args"]["http_port"] = port
    else:
        config["http_options"]["port"] = port


def serve_yaml(models: ServeModels | None, folder: Path, args: dict | None = None,
               source: Path = DEPLOY_YAML) -> tuple[Path, int]:
    """``source`` (deploy/shakespeare.yaml) itself on the shipped pair; otherwise a copy pointing at the
    tiny pair. ``models`` None: the YAML's own model (deploy/dspark.yaml's real one).

    Only the checkpoint paths change (and the port, should 8000 be taken by
    someone else's server on this shared machine), and the ``args`` given
    (AppConfig fields): everything else is the shipped file. A copy with
    ``args`` always gets a port of its own.
    """
    import yaml

    config = yaml.safe_load(source.read_text())
    port = http_port(config)
    if (models is None or models.shipped) and port_is_free(port) and not args:
        return source, port
    app = config["applications"][0]
    if models is not None:
        app["args"]["model"] = str(models.target)
        app["args"]["draft"] = str(models.draft)
    app["args"].update(args or {})
    if args or not port_is_free(port):
        port = free_port()
        set_http_port(config, port)
    path = folder / source.name
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path, port


def start_serve(models: ServeModels | None, folder: Path, startup_timeout_s: float = 240, args: dict | None = None,
                before_serve: Callable[[], None] | None = None, source: Path = DEPLOY_YAML) -> ServeRun:
    """Start a Ray head here, then ``serve run`` the YAML as a subprocess; wait for /health.

    ``args`` override the YAML's (``serve_yaml``); ``before_serve`` runs once
    Ray is up, before ``serve run`` (to start an actor the replicas will find).
    """
    import httpx
    import ray
    import yaml

    yaml_path, port = serve_yaml(models, folder, args, source)
    config = yaml.safe_load(yaml_path.read_text())
    app = config["applications"][0]
    ray.init(num_cpus=2, object_store_memory=OBJECT_STORE_BYTES, include_dashboard=False,
             namespace="dspark-serve-tests", log_to_driver=False)
    log = folder / "serve-run.log"
    proc = None
    try:
        if before_serve is not None:
            before_serve()
        gcs = ray.get_runtime_context().gcs_address
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [str(VENV_BIN / "serve"), "run", "--address", gcs, str(yaml_path)],
                cwd=REPO, env=child_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )
        name = models.name if models is not None else app["args"]["served_model_name"]
        run = ServeRun(yaml_path, port, app["name"], name, app["args"], log, proc, gcs)
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"serve run exited with {proc.returncode}:\n{log_tail(log)}")
            try:
                if httpx.get(f"{run.base_url}/health", timeout=2).status_code == 200 and ours(run):
                    return run
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"/health not ready after {startup_timeout_s}s:\n{log_tail(log)}")
            time.sleep(0.5)
    except BaseException:
        if proc is not None:
            stop_process(proc)
        ray.shutdown()
        raise


def ours(run: ServeRun) -> bool:
    """The application answering is the one in our cluster: it runs, and the port is held by its
    replicas (their own HTTP server) or by our healthy proxy.

    (A healthy /health alone could come from someone else's server on this
    shared machine had ours failed to bind.)
    """
    import httpx
    from ray import serve
    from ray.serve.schema import ApplicationStatus, ProxyStatus

    try:
        status = serve.status()
    except Exception:  # noqa: BLE001 - Serve not up in our cluster (yet)
        return False
    app = status.applications.get(run.app_name)
    if app is None or app.status != ApplicationStatus.RUNNING:
        return False
    if run.args.get("http_port") is None:
        return bool(status.proxies) and all(p == ProxyStatus.HEALTHY for p in status.proxies.values())
    # The replicas serve HTTP themselves: the port's /stats is a replica of this cluster's (its
    # steps counter is its engine's), and no proxy was started.
    try:
        stats = httpx.get(f"{run.base_url}/stats", timeout=2).json()
    except (httpx.HTTPError, ValueError):
        return False
    return not status.proxies and "steps" in stats and bool(serve_replicas(run.app_name))


def stop_serve(run: ServeRun) -> None:
    """Delete the applications, stop `serve run`, then the Ray head (and with it every worker).

    The HTTP port is waited for (up to 15 s, until nothing listens on it) only
    when it is the shipped YAML's, which the next module may want; a port of
    the run's own (another server had 8000, or the YAML is a variant) is never
    asked for again.
    """
    import yaml

    shipped = run.port == http_port(yaml.safe_load(DEPLOY_YAML.read_text()))
    stop_serve_run(run.proc, run.port, wait_port=shipped)


@dataclass(frozen=True)
class ServeReplica:
    """A live Serve replica actor of an application."""

    name: str  # SERVE_REPLICA::<app>#<deployment>#<replica id>
    pid: int

    @property
    def owner(self) -> str:
        """The replica's id, which its engine uses as the owner of its slot leases."""
        return self.name.rsplit("#", 1)[-1]


def serve_replicas(app_name: str) -> list[ServeReplica]:
    """The live replica actors of an application (class ``ServeReplica:<app>:<deployment>``).

    Read from the GCS actor table: ``ray.util.state.list_actors`` needs the
    dashboard, which the fixtures' Ray head does not run.
    """
    from ray._private import state

    return [ServeReplica(a["Name"], a["Pid"]) for a in state.actors().values()
            if a["State"] == "ALIVE" and a["ActorClassName"].startswith(f"ServeReplica:{app_name}:")]


def app_stats(run: ServeRun, attempts: int = 200) -> dict:
    """``run``'s application's running and waiting requests, and finished ones by reason, summed over its
    replicas: each answers ``GET /stats`` for itself (dspark_ray.runtime.timeline.every_replica)."""
    import httpx

    from dspark_ray.runtime.timeline import every_replica

    def fetch() -> dict:
        r = httpx.get(f"{run.base_url}/stats", timeout=30)  # a new connection each time
        r.raise_for_status()
        return r.json()

    replicas = run.args.get("num_replicas", 1)
    each = every_replica(fetch, replicas, attempts)
    assert each is not None, f"not all {replicas} replicas answered /stats in {attempts} tries"
    total = {"running": 0, "waiting": 0, "finished": {}}
    for st in each.values():
        total["running"] += st["running"]
        total["waiting"] += st["waiting"]
        for reason, n in st["finished"].items():
            total["finished"][reason] = total["finished"].get(reason, 0) + n
    return total


def slot_manager(app_name: str):
    """The application's detached slot-manager actor (started by its replicas in Serve's namespace)."""
    import ray

    from dspark_ray.slots.manager import slot_manager_name

    return ray.get_actor(slot_manager_name(app_name), namespace=SERVE_NAMESPACE)


def slot_snapshot(app_name: str):
    import ray

    return ray.get(slot_manager(app_name).snapshot.remote(), timeout=30)


# The shipped YAML's `serve run`, shared by the modules that ask for ``served``: conftest.py puts those
# modules next to each other and stops the run after the last of them (stop_shared_serve), so the
# suite starts it once instead of once per module (each start is Ray, Serve, two replicas and their
# compiled models: most of a minute on a 2-core box).
_shared: ServeRun | None = None


@pytest.fixture(scope="module")
def served(serve_models, tmp_path_factory) -> ServeRun:
    """``serve run deploy/shakespeare.yaml`` (or its tiny-pair copy), shared by the modules that use it.

    A module must leave the application as it found it: what it deploys beside it, it deletes; what it
    takes (slots, connections), it gives back. Should the run have died (its process ended), the next
    module gets a new one.
    """
    import ray

    global _shared
    if _shared is not None and _shared.proc.poll() is not None:
        stop_shared_serve()
    if _shared is None:
        assert not ray.is_initialized(), "another test left Ray initialised in this process"
        _shared = start_serve(serve_models, tmp_path_factory.mktemp("serve_run"))
    yield _shared


def stop_shared_serve() -> None:
    """Stop the shared run, if one is up (conftest.py, after the last module that uses it)."""
    global _shared
    run, _shared = _shared, None
    if run is not None:
        stop_serve(run)


def uses_shared_serve(item: pytest.Item) -> bool:
    """Whether a test asks for the shared ``served`` (not a module's own fixture of that name)."""
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.get("served", ()) if info is not None else ()
    return bool(defs) and defs[-1].func.__module__ == __name__

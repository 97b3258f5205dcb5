"""Tensor parallel across two Ray nodes: the shards really land on different nodes, output is unchanged.

A two-node local cluster (``ray.cluster_utils.Cluster``: a head and one worker
node, each with its own custom resource) runs one replica's services with
``placement_strategy=STRICT_SPREAD`` and tensor-parallel 2, then again with
tensor-parallel 1; the engine drives both through the Ray facades exactly as a
Serve replica does. Greedy output for a batch of prompts must be token for
token that of the in-process engine (``build_local_engine``).
"""

from __future__ import annotations

import pytest
import ray
from ray.cluster_utils import Cluster

from dspark_ray.engine import Engine, EngineConfig, SamplingParams
from dspark_ray.engine.local import build_local_engine
from dspark_ray.runtime.actors import start_replica_services
from dspark_ray.tokenizer import Tokenizer
from serve_fixtures import OBJECT_STORE_BYTES, serve_models  # noqa: F401 - fixture

pytestmark = [pytest.mark.ray, pytest.mark.slow]

PROMPTS = [
    "ROMEO:\nBut soft, what light",
    "First Citizen:\nBefore we proceed any further, hear me speak.",
    "To be",
    "KING HENRY:\nOnce more unto the breach, dear friends, once more;\nOr close the wall up",
]
MAX_TOKENS = 24
APP = "tp-test"


@pytest.fixture(scope="module")
def two_nodes():
    """A head and a worker node, each 2 CPUs and a custom resource naming it; this process connected."""
    assert not ray.is_initialized(), "another test left Ray initialised in this process"
    cluster = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=2, resources={"dspark_node_head": 1}, object_store_memory=OBJECT_STORE_BYTES))
    try:
        cluster.add_node(num_cpus=2, resources={"dspark_node_worker": 1}, object_store_memory=OBJECT_STORE_BYTES)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace="dspark-tp-tests", log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def engine_config(models) -> EngineConfig:
    return EngineConfig(model=str(models.target), draft=str(models.draft), num_speculative_tokens=4,
                        draft_window=32, capacity=8, max_context=128, max_num_seqs=8)


def greedy(engine: Engine) -> list[tuple[list[int], str]]:
    """All PROMPTS in one batch, greedy; (token ids, finish reason) per prompt."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    ids = [engine.add_request(p, params, f"r{i}") for i, p in enumerate(PROMPTS)]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    reasons: dict[str, str] = {}
    for _ in range(10 * MAX_TOKENS):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            tokens[out.req_id] += out.new_token_ids
            if out.finished:
                reasons[out.req_id] = out.finish_reason
    assert not engine.has_unfinished(), "the engine did not finish"
    return [(tokens[i], reasons[i]) for i in ids]


def node_of(actor_name: str) -> str:
    from ray.util.state import list_actors

    rows = list_actors(filters=[("name", "=", actor_name), ("state", "=", "ALIVE")], raise_on_missing_output=False)
    assert len(rows) == 1, f"expected one live actor {actor_name!r}, found {rows}"
    return rows[0].node_id


def run_replica(models, *, replica: str, tp: int, strategy: str):
    """(greedy results, node id per shard) of one replica's services."""
    config = engine_config(models)
    services = start_replica_services(
        config, app_name=APP, replica=replica, tensor_parallel_size=tp, placement_strategy=strategy,
        cpus_per_shard=0.25, torch_threads=1, slot_timeout_s=30,
    )
    try:
        nodes = [node_of(f"dspark:target:{replica}:rank{r}") for r in range(tp)]
        engine = Engine(config, Tokenizer.from_path(config.model), services.slots, services.target,
                        services.draft, owner=replica)
        return greedy(engine), nodes
    finally:
        services.shutdown()


def test_tp2_strict_spread_on_two_nodes_matches_tp1_and_in_process(two_nodes, serve_models):
    head = two_nodes.head_node.node_id
    worker = next(iter(two_nodes.worker_nodes)).node_id

    out_tp2, nodes_tp2 = run_replica(serve_models, replica="tp2", tp=2, strategy="STRICT_SPREAD")
    assert sorted(nodes_tp2) == sorted([head, worker]), (
        f"the two target shards should be on the head and the worker node, got {nodes_tp2}")
    by_node = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    assert {"dspark_node_head", "dspark_node_worker"} == {
        r for n in nodes_tp2 for r in by_node[n] if r.startswith("dspark_node_")}

    out_tp1, _ = run_replica(serve_models, replica="tp1", tp=1, strategy="PACK")
    out_local = greedy(build_local_engine(engine_config(serve_models)))

    assert all(len(toks) > 0 for toks, _ in out_local)
    for prompt, local, tp1, tp2 in zip(PROMPTS, out_local, out_tp1, out_tp2):
        assert tp1 == local, f"tensor-parallel 1 differs from the in-process engine for {prompt!r}"
        assert tp2 == local, f"tensor-parallel 2 across nodes differs from the in-process engine for {prompt!r}"

    # Both replicas shared the application's slot manager; every slot came back.
    snap = ray.get(ray.get_actor(f"dspark:{APP}:slot-manager").snapshot.remote())
    assert snap.live == ()
    c = snap.counters
    assert c.allocations == c.releases == 2 * len(PROMPTS) and c.stale_releases == 0

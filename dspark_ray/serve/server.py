"""DSparkServer: one Serve replica — its engine loop and services, the OpenAI routes and the handle API.

The builder in ``dspark_ray.serve.app`` applies ``@serve.deployment``; this
class stays a plain class. It puts the runtime together (the engine's
services, the engine, the loop that runs it: ``dspark_ray.runtime``) and
serves it two ways: the OpenAI front's routes (``dspark_ray.openai.routes``),
whose FastAPI app is built per instance (``build_api``, which Serve calls
through ``__serve_build_asgi_app__`` after the constructor), so the same
routes can be served by Ray Serve, by the replica's own HTTP server
(``http_port``) or mounted directly on an ASGI transport in a test; and the
handle API (``generate``, ``complete``, ``stats``, ``drain``) for other Ray
applications, with the plain-data types of ``dspark_ray.serve.protocol``.

The engine's services are injected: ``services`` is a factory
``(AppConfig, app_name, replica) -> EngineServices``. The default starts this
replica's target shards and draft worker on Ray and shares the application's
slot manager with the other replicas (``dspark_ray.runtime.actors.ray_services``);
``dspark_ray.engine.local.LocalServices.build`` runs everything in this
process, with no cluster.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from fastapi import FastAPI
from ray import serve

from dspark_ray.engine import Engine, InvalidRequest, RequestOutput
from dspark_ray.engine.interfaces import DraftService, SlotService, TargetService
from dspark_ray.engine.outputs import SpecCounts
from dspark_ray.openai.choices import Choice, ChoiceStreams, check_fan_out, fan_out, request_deadline
from dspark_ray.openai.http import ReplicaHTTP
from dspark_ray.openai.metrics import HTTPMetrics, add_counts
from dspark_ray.openai.protocol import Speculation, Usage, new_id
from dspark_ray.openai.routes import OpenAIRoutes
from dspark_ray.runtime.actors import ray_services
from dspark_ray.runtime.engine_loop import EngineDead, EngineLoop
from dspark_ray.runtime.metrics import ServingMetrics
from dspark_ray.serve.autoscaling import ONGOING_METRIC
from dspark_ray.serve.config import AppConfig
from dspark_ray.serve.protocol import GenerateChunk, GenerateRequest, Logprob
from dspark_ray.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class EngineServices(Protocol):
    """What one replica's engine runs on: a slot service, a target, maybe a draft."""

    slots: SlotService
    target: TargetService
    draft: DraftService | None

    def rebuild_target(self) -> TargetService:
        """A fresh, empty target after the old one failed."""
        ...

    def shutdown(self) -> None: ...


ServicesFactory = Callable[[AppConfig, str, str], EngineServices]  # (config, app name, replica id)


def services_timeline(services: EngineServices) -> dict:
    """The services' own phases (transport vs compute), where they keep a timeline."""
    timeline = getattr(services, "timeline", None)
    return timeline.snapshot() if timeline is not None else {}


def _replica_identity() -> tuple[str, str]:
    """(app name, replica id) inside a Serve replica; ("dspark", "local") outside one."""
    try:
        ctx = serve.get_replica_context()
    except Exception:  # noqa: BLE001 - RayServeException outside a replica
        return "dspark", "local"
    return ctx.replica_id.deployment_id.app_name or "dspark", ctx.replica_id.unique_id


class DSparkServer:
    def __init__(self, config: dict | AppConfig, services: ServicesFactory | None = None) -> None:
        self.config = config if isinstance(config, AppConfig) else AppConfig(**config)
        cfg = self.config
        self.http: ReplicaHTTP | None = None
        app_name, replica = _replica_identity()
        self.app_name, self.replica = app_name, replica
        engine_config = cfg.engine_config()
        self.tokenizer = Tokenizer.from_path(cfg.model)
        self.services = s = (services or ray_services)(cfg, app_name, replica)
        engine = Engine(engine_config, self.tokenizer, s.slots, s.target, s.draft, owner=replica)
        self.loop = EngineLoop(engine, cfg.max_queued_requests, rebuild_target=self._rebuild_target,
                               metrics=ServingMetrics(engine, cfg.model_name, replica),
                               target_recovery_timeout_s=cfg.target_recovery_timeout_s)
        if cfg.http_port is not None:  # the replica's own listener (dspark_ray/openai/http.py says why)
            self.http = ReplicaHTTP(self.build_api(), cfg.http_host, cfg.http_port,
                                    HTTPMetrics(cfg.model_name, replica), app_name=app_name,
                                    balance=cfg.balance_connections)
            self.loop.metrics.spec_sink = self.http.board.publish_speculation
        self._bind_to_worker()
        log.info("dspark replica %s ready: tp=%d, k=%d", replica, cfg.tensor_parallel_size, engine_config.spec_tokens)

    def _rebuild_target(self):
        """The services' target rebuilt after a failure; with bind_replica this process follows the new
        rank 0 to the CPUs it claimed."""
        target = self.services.rebuild_target()
        self._bind_to_worker()
        return target

    def _bind_to_worker(self) -> None:
        """AppConfig.bind_replica: this process's threads onto the CPUs target rank 0 claimed (none: unbound).
        On the 2-core box, served: 0.98x / 1.06x / 1.02x of the replicas unbound at concurrency 1 / 8 / 32
        (README, Performance): between two steps the worker waits for its replica, and the replica's work
        then takes that idle core instead of preempting the other replica's worker."""
        shards = getattr(self.services, "shards", None)
        if not (self.config.bind_cores and self.config.bind_replica and shards):
            return
        import ray

        from dspark_ray.runtime.cores import bind_process

        try:
            cores = tuple(ray.get(shards[0].bound_cores.remote(), timeout=60))
        except Exception:  # noqa: BLE001 - binding is an optimisation; a failed worker shows up on its next step
            log.warning("bind_replica: target rank 0 did not say which CPUs it holds; this replica stays as it is",
                        exc_info=True)
            return
        if cores:
            log.info("bind_replica: %d threads bound to CPU %s", bind_process(cores), ",".join(map(str, cores)))

    def build_api(self, echo_request_id: bool = True) -> FastAPI:
        """This replica's HTTP routes as a FastAPI app (Serve mounts it, the replica's own HTTP server
        serves it, tests can too). ``echo_request_id``: put ``X-Request-Id`` on every completion
        response (not under Serve's proxy, which does it already)."""
        return OpenAIRoutes(self).build_api(echo_request_id)

    def __serve_build_asgi_app__(self) -> FastAPI:
        # Serve's proxy puts an X-Request-Id on every request (the client's, or one it makes) and
        # sends it back on the response; a second copy from here would duplicate the header.
        return self.build_api(echo_request_id=False)

    def shutdown(self) -> None:
        """Stop accepting HTTP, then the engine loop and the services (idempotent)."""
        http, self.http = getattr(self, "http", None), None
        if http is not None:  # its requests are not among those Serve waited for: they get the grace here
            http.stop(grace_s=max(1.0, self.config.graceful_shutdown_timeout_s - 2))
        loop, self.loop = getattr(self, "loop", None), None
        if loop is not None:
            loop.shutdown()
        services, self.services = getattr(self, "services", None), None
        if services is not None:
            services.shutdown()

    def __del__(self) -> None:
        self.shutdown()

    def check_health(self) -> None:
        """Serve's replica health check: a dead engine loop gets the replica replaced."""
        if not self.loop.alive:
            raise EngineDead(f"engine loop stopped: {self.loop.error!r}")

    async def drain(self, draining: bool = True) -> dict:
        """The drain switch (also through a Serve handle: ``handle.drain.remote()``). On: every replica
        of the application stops admitting (503 ``draining`` with Retry-After, ``/health`` 503)
        within ``sync_interval_s`` (this one at once) and finishes what it holds; off: they admit again.
        A graceful redeploy (Serve's) also finishes the streams in flight (runbooks/drain-and-restart.md)."""
        await self.loop.set_draining(draining)
        return self.drain_status()

    def drain_status(self) -> dict:
        """``draining`` as this replica last heard it; the requests it still holds."""
        return {"draining": self.loop.engine.app_draining, "requests_in_flight": len(self.loop.engine.requests)}

    def port_speculation(self) -> SpecCounts:
        """This replica's speculation counters, plus those of the replicas sharing its HTTP port on this
        machine (a client's next connection may reach any of them; openai/balance.py)."""
        own, http = self.loop.metrics.spec_totals(), self.http
        if http is None:
            return own
        return add_counts([own, *http.board.peer_speculation().values()])

    # -- handle API ------------------------------------------------------------

    async def generate(self, request: GenerateRequest | dict) -> AsyncIterator[GenerateChunk]:
        """Stream a generation: ``handle.options(stream=True).generate.remote(GenerateRequest(...))``.

        With n > 1 the samples' chunks interleave; ``index`` tells them apart.
        """
        req = request if isinstance(request, GenerateRequest) else GenerateRequest(**request)
        prompt = req.prompt_token_ids if req.prompt_token_ids is not None else req.prompt
        req_id = req.request_id or new_id("gen")
        params = req.params()
        check_fan_out("n", params.n, self.config.slots_per_replica)
        ids = self.loop.engine.check(prompt, dataclasses.replace(params, n=1))
        streams = ChoiceStreams(self.loop, fan_out([ids], params, req_id),
                                request_deadline(req.timeout_s, self.config.request_timeout_s))
        await streams.start()
        merged = streams.merged()
        try:
            async for c, out in merged:
                yield _chunk(c, out)
        finally:
            await merged.aclose()

    async def complete(self, request: GenerateRequest | dict) -> GenerateChunk:
        """The whole generation in one response: ``handle.complete.remote(GenerateRequest(...))`` (n = 1)."""
        n = request.n if isinstance(request, GenerateRequest) else request.get("n", 1)
        if n != 1:
            raise InvalidRequest("n", "complete returns one sample; stream generate for n > 1")
        text, ids, logprobs, prompt_logprobs, last = [], [], [], None, None
        async for chunk in self.generate(request):
            text.append(chunk.text)
            ids += chunk.token_ids
            logprobs += chunk.logprobs or []
            prompt_logprobs = chunk.prompt_logprobs or prompt_logprobs
            last = chunk
        return last.model_copy(update={"text": "".join(text), "token_ids": ids, "prompt_logprobs": prompt_logprobs,
                                       "logprobs": logprobs if last.logprobs is not None else None})

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metric: the requests this replica's engine holds (running, queued,
        submitted), whichever way they came (dspark_ray/serve/autoscaling.py)."""
        engine = self.loop.engine
        return {ONGOING_METRIC: float(len(engine.scheduler.running) + self.loop.num_waiting())}

    async def stats(self) -> dict:
        """Replica state for operators and tests: engine counters, KV pool, queue lengths."""
        engine = self.loop.engine
        return {
            "replica": self.replica,  # each replica answers for itself (a new connection reaches any one)
            # Responses that asked the client to reconnect, to even out the replicas (openai/balance.py).
            "rebalanced": 0 if self.http is None else self.http.board.closed,
            "running": len(engine.scheduler.running),
            "waiting": self.loop.num_waiting(),
            "kv_capacity": engine.target.kv_capacity(),
            "finished": dict(engine.counters.finished),
            "steps": engine.counters.steps,
            "spec_k_steps": {str(k): n for k, n in sorted(engine.counters.spec_k_steps.items())},
            # Adaptive speculation's step-time table per batch bucket (engine/adaptive.py); {} without it.
            "adaptive_ms": {} if engine.spec_controller is None else
            {str(b): row for b, row in engine.spec_controller.table_ms().items()},
            "draft_failures": engine.counters.draft_failures,
            "target_failures": engine.counters.target_failures,
            "resumed_after_target_failure": engine.counters.resumed_after_target_failure,
            "worker_timeouts": dict(getattr(getattr(self.services, "timeouts", None), "counts", {})),
            # Cumulative seconds per phase (dspark_ray.runtime.timeline): diff two reads for ms per step.
            "timeline": {**self.loop.timeline.snapshot(), **services_timeline(self.services)},
        }


def _chunk(c: Choice, out: RequestOutput) -> GenerateChunk:
    """A handle API chunk of one sample's output."""
    return GenerateChunk(
        request_id=c.req_id, index=c.index, text=out.new_text, token_ids=out.new_token_ids, finished=out.finished,
        finish_reason=out.finish_reason, error=out.error, error_code=out.error_code,
        usage=Usage.of(out) if out.finished else None, speculation=Speculation.of(out.spec),
        logprobs=None if out.logprobs is None else [Logprob.of(lp) for lp in out.logprobs],
        prompt_logprobs=None if out.prompt_logprobs is None else [Logprob.of(lp) for lp in out.prompt_logprobs],
    )


# The app is late-bound: Serve calls ``__serve_build_asgi_app__`` on each replica after the constructor.
DSparkIngress = serve.ingress()(DSparkServer)

"""DSparkServer: one Serve replica — the OpenAI HTTP routes, the handle API and one engine loop.

The builder in ``dspark_ray.serve.app`` applies ``@serve.deployment``; this
class stays a plain class. Its FastAPI app is built per instance
(``build_api``, which Serve calls through ``__serve_build_asgi_app__`` after
the constructor), so the same routes can be served by Ray Serve or mounted
directly on an ASGI transport in a test.

The engine's services are injected: ``services`` is a factory
``(AppConfig, app_name, replica) -> EngineServices``. The default starts this
replica's target shards and draft worker on Ray and shares the application's
slot manager with the other replicas (``actors.ray_services``);
``dspark_ray.engine.local.LocalServices.build`` runs everything in this
process, with no cluster.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from fastapi import FastAPI, Request
from ray import serve
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from dspark_ray.engine import Engine, InvalidRequest, RequestOutput, SamplingParams
from dspark_ray.engine.interfaces import DraftService, SlotService, TargetService
from dspark_ray.engine.request import ErrorCode
from dspark_ray.serve.actors import SlotServiceUnavailable, WorkerTimeout, ray_services
from dspark_ray.serve.autoscaling import ONGOING_METRIC
from dspark_ray.serve.config import AppConfig
from dspark_ray.serve.engine_loop import Draining, EngineDead, EngineLoop, Overloaded
from dspark_ray.serve.http import APP_HEADER, ReplicaHTTP
from dspark_ray.serve.metrics import HTTPMetrics, ServingMetrics, vllm_spec_decode_text
from dspark_ray.serve.choices import Choice, ChoiceStreams, fan_out
from dspark_ray.serve.protocol import (
    PromptTokensDetails,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateChunk,
    GenerateRequest,
    Logprob,
    Speculation,
    Usage,
    new_id,
    now,
)
from dspark_ray.serve.reasoning import make_reasoning_parser
from dspark_ray.serve.responses import ChatView, CompletionView, ToolMode
from dspark_ray.serve.tool_parsers import make_tool_parser
from dspark_ray.tokenizer import ChatTemplateError, Tokenizer

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


class APIError(Exception):
    """An error with an OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 err_type: str = "invalid_request_error", headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.err_type, self.headers = err_type, headers or {}

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.err_type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)

    def sse(self) -> str:
        return _sse({"error": {"message": self.message, "type": self.err_type, "param": self.param,
                               "code": self.code}})


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _api_error(exc: BaseException) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequest):
        return APIError(400, str(exc), param=exc.field)  # "field: what is wrong"
    if isinstance(exc, Overloaded):
        return APIError(503, str(exc), code="overloaded", err_type="server_error",
                        headers={"Retry-After": str(exc.retry_after_s)})
    if isinstance(exc, Draining):
        return APIError(503, str(exc), code="draining", err_type="server_error",
                        headers={"Retry-After": str(exc.retry_after_s)})
    # Server-side failures: a short message for the client, the exception (Ray actor ids,
    # pids, paths, tracebacks) only in the log.
    if isinstance(exc, SlotServiceUnavailable):
        log.warning("slot service unavailable: %s", exc)
        return APIError(503, "the slot manager is not answering (it may be restarting); retry in a few seconds",
                        code="slots_unavailable", err_type="server_error", headers={"Retry-After": "1"})
    if isinstance(exc, EngineDead):
        log.error("engine dead: %s", exc)
        return APIError(503, "this replica's engine has stopped and the replica is being replaced; retry the "
                        "request", code="engine_dead", err_type="server_error", headers={"Retry-After": "5"})
    log.error("unexpected error", exc_info=exc)
    return APIError(500, f"internal error ({type(exc).__name__}); the server log has the details",
                    err_type="server_error")


def _generation_error(out: RequestOutput) -> APIError:
    """The error of a request the engine ended, by its ``error_code``: its grammar could not go on
    (the request's own constraint: a 400), its deadline passed (504), or a failure on the server's
    side (503: retry)."""
    if out.error_code == ErrorCode.STRUCTURED_OUTPUT:
        return APIError(400, out.error, code=out.error_code)
    if out.error_code == ErrorCode.TIMEOUT:
        return APIError(504, out.error, err_type="timeout_error", code=out.error_code)
    return APIError(503, out.error or "generation failed", err_type="server_error", code="engine_error")


REQUEST_ID_HEADER = "X-Request-Id"
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def _request_id(request: Request, prefix: str) -> str:
    """The client's ``X-Request-Id`` (echoed back, used as the engine's request id, so it is the
    id in the server's log lines), or a new id; one that is malformed is a 400."""
    given = request.headers.get(REQUEST_ID_HEADER)
    if given is None:
        return new_id(prefix)
    if not _REQUEST_ID.fullmatch(given):
        raise APIError(400, f"the {REQUEST_ID_HEADER} header must be 1-128 characters of letters, digits and "
                       "'._:-'", param=REQUEST_ID_HEADER)
    return given


# Names pydantic puts in an error's location for the member of a union it tried
# ("prompt.str", "stop.list[str]"): not part of the request's field path.
_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "bytes", "none"}
_FIELD_PREFIX = re.compile(r"^(?:Value error, )?([A-Za-z_][\w.]*): (.+)$", re.S)


def _field_path(loc: tuple) -> str | None:
    """The request field an error is about, e.g. ``messages.0.role``; None for the body as a whole."""
    parts = [str(p) for p in loc if isinstance(p, int) or (str(p).isidentifier() and str(p) not in _UNION_TAGS)]
    return ".".join(parts) or None


def _validation_error(exc: ValidationError) -> APIError:
    err = exc.errors()[0]
    param = _field_path(err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        msg = f"unsupported option {param!r}"
    elif param is None and (m := _FIELD_PREFIX.match(msg)):  # a model validator's "field: message"
        param, msg = m.group(1), m.group(2)
    return APIError(400, f"{param}: {msg}" if param else msg, param=param)


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
        if cfg.http_port is not None:  # the replica's own listener (dspark_ray/serve/http.py says why)
            self.http = ReplicaHTTP(self.build_api(), cfg.http_host, cfg.http_port,
                                    HTTPMetrics(cfg.model_name, replica), app_name=app_name,
                                    balance=cfg.balance_connections)
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

        from dspark_ray.serve.cores import bind_process

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
        api = FastAPI(title="dspark_ray", description="Speculative-decoding LLM serving (OpenAI-compatible)")
        api.state.echo_request_id = echo_request_id
        api.get("/health")(self.health)
        api.get("/v1/models")(self.models)
        api.post("/v1/completions")(self.completions)
        api.post("/v1/chat/completions")(self.chat_completions)
        api.get("/stats")(self.stats_route)
        api.get("/admin/drain")(self.drain_route)
        api.post("/admin/drain")(self.drain_route)
        api.post("/admin/resume")(self.drain_route)
        api.get("/metrics")(self.metrics_route)
        return api

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

    # -- HTTP ----------------------------------------------------------------

    async def health(self, request: Request) -> JSONResponse:
        app = {APP_HEADER: self.app_name}  # which application answers (http.shared_socket reads it)
        if not self.loop.alive:
            log.error("health check: the engine loop stopped: %r", self.loop.error)
            return JSONResponse({"status": "unhealthy", "error": "the engine loop stopped"}, status_code=503,
                                headers=app)
        failure = self.loop.engine.target_error
        if failure is not None:
            what = str(failure) if isinstance(failure, WorkerTimeout) else "the target failed"
            return JSONResponse({"status": "unhealthy", "error": f"{what}; it is being rebuilt and the requests in "
                                 "flight wait for it"}, status_code=503, headers=app)
        if self.loop.engine.app_draining:  # load balancers take it out; Serve's own check (check_health) does not
            return JSONResponse({"status": "draining", "requests_in_flight": self._in_flight()}, status_code=503,
                                headers=app)
        return JSONResponse({"status": "ok"}, headers=app)

    async def drain_route(self, request: Request) -> JSONResponse:
        """``POST /admin/drain`` turns the application's drain switch on, ``POST /admin/resume`` off,
        ``GET /admin/drain`` reads it (the API key applies): ``drain_status``."""
        try:
            self._authorize(request)
            if request.method == "POST":
                await self.drain(not request.url.path.endswith("/resume"))
        except APIError as err:
            return err.response()
        except Exception as exc:  # noqa: BLE001 - e.g. the slot manager is restarting
            return _api_error(exc).response()
        return JSONResponse(self.drain_status())

    async def drain(self, draining: bool = True) -> dict:
        """The drain switch (also through a Serve handle: ``handle.drain.remote()``). On: every replica
        of the application stops admitting (503 ``draining`` with Retry-After, ``/health`` 503)
        within ``sync_interval_s`` (this one at once) and finishes what it holds; off: they admit again.
        A graceful redeploy (Serve's) also finishes the streams in flight (runbooks/drain-and-restart.md)."""
        await self.loop.set_draining(draining)
        return self.drain_status()

    def drain_status(self) -> dict:
        """``draining`` as this replica last heard it; the requests it still holds."""
        return {"draining": self.loop.engine.app_draining, "requests_in_flight": self._in_flight()}

    def _in_flight(self) -> int:
        return len(self.loop.engine.requests)

    async def models(self, request: Request) -> JSONResponse:
        try:
            self._authorize(request)
        except APIError as err:
            return err.response()
        return JSONResponse({"object": "list", "data": [
            {"id": self.config.model_name, "object": "model", "created": 0, "owned_by": "dspark_ray"}]})

    async def completions(self, request: Request):
        try:
            req = await self._parse(request, CompletionRequest)
            runs = self._check_fan_out("best_of" if req.best_of else "n", req.best_of or req.n)
            params = req.params(n=runs)
            prompts = [self._check_prompt(p, dataclasses.replace(params, n=1)) for p in req.prompt_inputs()]
            req_id = _request_id(request, "cmpl")
            choices = fan_out([ids for ids, _ in prompts], params, req_id)
            view = CompletionView(self._token_text, [t for _, t in prompts] if req.echo else None,
                                  req.logprobs is not None)
            return await self._respond(request, req, req_id, choices, view, keep=req.n)
        except Exception as exc:  # noqa: BLE001 - every error becomes an OpenAI error body
            return _api_error(exc).response()

    async def chat_completions(self, request: Request):
        try:
            req = await self._parse(request, ChatCompletionRequest)
            try:
                messages = [m.rendered() for m in req.messages]
            except ValueError as exc:
                raise APIError(400, str(exc), param="messages") from exc
            mode = req.tool_mode()
            if mode == "auto" and self.config.tool_call_parser is None:
                raise APIError(400, "tool_choice: auto needs a tool_call_parser in the server's config; use "
                                    "required or a named function, or leave tools out", param="tool_choice")
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if mode != "none" else None
            try:
                text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools,
                                                          **(req.chat_template_kwargs or {}))
            except ChatTemplateError as exc:
                raise APIError(400, f"messages: {exc}", param="messages") from exc
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            room = max(1, self.config.max_context - len(ids))
            params = req.params(default_max_tokens=room, n=self._check_fan_out("n", req.n))
            try:
                ids = self.loop.engine.check(ids, dataclasses.replace(params, n=1))
            except InvalidRequest as exc:  # the engine's "prompt" is the rendered messages here
                if exc.field != "prompt":
                    raise
                raise APIError(400, f"messages: {exc.message}", param="messages") from exc
            echo = (messages[-1]["content"] or "") if req.echo and messages[-1]["role"] == "assistant" else ""
            tool_mode = None
            if mode != "none":
                parser = self.config.tool_call_parser
                tool_mode = ToolMode(mode, (lambda: make_tool_parser(parser)) if mode == "auto" else None,
                                     req.tool_choice.function.name if mode == "named" else None)
            reasoning = self.config.reasoning_parser
            view = ChatView(self._token_text, echo, bool(req.logprobs), tool_mode,
                            (lambda: make_reasoning_parser(reasoning)) if reasoning else None)
            req_id = _request_id(request, "chatcmpl")
            return await self._respond(request, req, req_id, fan_out([ids], params, req_id), view, keep=req.n)
        except Exception as exc:  # noqa: BLE001
            return _api_error(exc).response()

    async def stats_route(self, request: Request) -> JSONResponse:
        """``GET /stats``: this replica's ``stats()`` (the API key applies)."""
        try:
            self._authorize(request)
        except APIError as err:
            return err.response()
        return JSONResponse(await self.stats())

    async def metrics_route(self, request: Request) -> Response:
        """``GET /metrics``: this replica's speculation counters under vLLM's names (Prometheus text)."""
        try:
            self._authorize(request)
        except APIError as err:
            return err.response()
        text = vllm_spec_decode_text(self.loop.metrics.spec_totals(), self.config.model_name)
        return Response(text, media_type="text/plain; version=0.0.4")

    # -- handle API ------------------------------------------------------------

    async def generate(self, request: GenerateRequest | dict) -> AsyncIterator[GenerateChunk]:
        """Stream a generation: ``handle.options(stream=True).generate.remote(GenerateRequest(...))``.

        With n > 1 the samples' chunks interleave; ``index`` tells them apart.
        """
        req = request if isinstance(request, GenerateRequest) else GenerateRequest(**request)
        prompt = req.prompt_token_ids if req.prompt_token_ids is not None else req.prompt
        req_id = req.request_id or new_id("gen")
        params = req.params()
        self._check_fan_out("n", params.n)
        ids = self.loop.engine.check(prompt, dataclasses.replace(params, n=1))
        streams = ChoiceStreams(self.loop, fan_out([ids], params, req_id), self._deadline(req))
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
            # Responses that asked the client to reconnect, to even out the replicas (serve/balance.py).
            "rebalanced": 0 if self.http is None or self.http.board is None else self.http.board.closed,
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
            # Cumulative seconds per phase (dspark_ray.serve.timeline): diff two reads for ms per step.
            "timeline": {**self.loop.timeline.snapshot(), **services_timeline(self.services)},
        }

    # -- helpers -----------------------------------------------------------------

    def _authorize(self, request: Request) -> None:
        key = self.config.api_key
        # Constant time, so response timing does not reveal how much of a guess matched; bytes,
        # because compare_digest refuses non-ASCII str (a client's header must not make a 500).
        sent = request.headers.get("authorization", "").encode()
        if key and not hmac.compare_digest(sent, f"Bearer {key}".encode()):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    async def _parse(self, request: Request, model: type[BaseModel]) -> Any:
        self._authorize(request)
        limit = self.config.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"request body over {limit} bytes", code="request_too_large")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise APIError(413, f"request body over {limit} bytes", code="request_too_large")
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise APIError(400, f"the body is not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise APIError(400, "the body must be a JSON object")
        try:
            req = model.model_validate(data)
        except ValidationError as exc:
            raise _validation_error(exc) from exc
        if req.model != self.config.model_name:
            raise APIError(400, f"model {req.model!r} is not served here; use {self.config.model_name!r}",
                           param="model", code="model_not_found")
        return req

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _deadline(self, req) -> float | None:
        """When this request ends if unfinished: its timeout_s or the server's request_timeout_s,
        the shorter, from now (None: neither is set)."""
        limits = [t for t in (req.timeout_s, self.config.request_timeout_s) if t is not None]
        return time.monotonic() + min(limits) if limits else None

    def _check_fan_out(self, field: str, runs: int) -> int:
        """Choices per prompt run at once, on this replica: at most its slots (each holds one)."""
        most = self.config.slots_per_replica
        if runs > most:
            raise InvalidRequest(field, f"at most {most} (the slots one replica holds), got {runs}")
        return runs

    def _check_prompt(self, prompt: str | list[int], params: SamplingParams) -> tuple[list[int], str]:
        """(token ids, text to echo) of one prompt, validated by the engine (InvalidRequest names the field)."""
        ids = self.loop.engine.check(prompt, params)
        keep_text = isinstance(prompt, str) and params.truncate_prompt_tokens is None
        return ids, prompt if keep_text else self.tokenizer.decode(ids)

    async def _respond(self, request: Request, req, req_id: str, choices: list[Choice], view, keep: int):
        """Run the choices and answer: one body, or an SSE stream. ``keep``: choices returned per prompt."""
        id_header = {REQUEST_ID_HEADER: req_id} if request.app.state.echo_request_id else {}
        streams = ChoiceStreams(self.loop, choices, self._deadline(req))
        await streams.start()  # errors surface here, before any response is sent
        if req.stream:
            return StreamingResponse(self._sse(req, req_id, streams, view), media_type="text/event-stream",
                                     headers=id_header)
        try:
            await streams.gather()
        finally:
            await streams.close()
        failed = next((c.last for c in choices if c.last.finish_reason == "error"), None)
        if failed is not None:
            raise _generation_error(failed)
        shown = _best(choices, keep)
        specs = [c.last.spec for c in choices if c.last.spec]
        body = {
            "id": req_id, "object": view.object, "created": now(), "model": self.config.model_name,
            "choices": [view.choice(c) for c in shown], "usage": _total_usage(choices).model_dump(),
            "speculation": Speculation.of(specs[0]).model_dump() if len(specs) == 1 else None,
        }
        return JSONResponse(body, headers=id_header)

    async def _sse(self, req, req_id: str, streams: ChoiceStreams, view) -> AsyncIterator[str]:
        choices = streams.choices
        base = {"id": req_id, "object": view.chunk_object, "created": now(), "model": self.config.model_name}
        options = req.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = bool(options and options.continuous_usage_stats)
        for c in choices:
            if (head := view.head(c)) is not None:
                yield _sse({**base, "choices": [head]})
        started: set[int] = set()
        merged = streams.merged()
        try:
            async for c, out in merged:
                if out.finish_reason == "error":
                    yield _generation_error(out).sse()
                    break
                entry = view.chunk(c, out, first=c.index not in started)
                started.add(c.index)
                if entry is None:
                    continue
                chunk = {**base, "choices": [entry]}
                if out.finished and out.spec is not None:
                    chunk["speculation"] = Speculation.of(out.spec).model_dump()
                if continuous:
                    chunk["usage"] = _usage(out).model_dump()
                yield _sse(chunk)
            else:
                if include_usage:
                    yield _sse({**base, "choices": [], "usage": _total_usage(choices).model_dump()})
        except Exception as exc:  # noqa: BLE001 - reported in the stream
            yield _api_error(exc).sse()
        finally:
            await merged.aclose()
        yield "data: [DONE]\n\n"


def _chunk(c: Choice, out: RequestOutput) -> GenerateChunk:
    """A handle API chunk of one sample's output."""
    return GenerateChunk(
        request_id=c.req_id, index=c.index, text=out.new_text, token_ids=out.new_token_ids, finished=out.finished,
        finish_reason=out.finish_reason, error=out.error, error_code=out.error_code,
        usage=_usage(out) if out.finished else None, speculation=Speculation.of(out.spec),
        logprobs=None if out.logprobs is None else [Logprob.of(lp) for lp in out.logprobs],
        prompt_logprobs=None if out.prompt_logprobs is None else [Logprob.of(lp) for lp in out.prompt_logprobs],
    )


def _best(choices: list[Choice], keep: int) -> list[Choice]:
    """Per prompt, the ``keep`` choices of highest cumulative log-probability (best_of), renumbered."""
    if len({c.prompt for c in choices}) * keep == len(choices):
        return choices
    shown = []
    for p in sorted({c.prompt for c in choices}):
        ranked = sorted((c for c in choices if c.prompt == p), key=lambda c: -c.cumulative_logprob)[:keep]
        for i, c in enumerate(sorted(ranked, key=lambda c: c.index)):
            c.index = p * keep + i
            shown.append(c)
    return shown


def _total_usage(choices: list[Choice]) -> Usage:
    """Each prompt counted once, every generated token counted."""
    prompt = sum({c.prompt: c.last.num_prompt_tokens for c in choices}.values())
    cached = sum({c.prompt: c.last.num_cached_tokens for c in choices}.values())
    completion = sum(c.last.num_output_tokens for c in choices)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=min(cached, prompt)))


def _usage(out: RequestOutput) -> Usage:
    return Usage(prompt_tokens=out.num_prompt_tokens, completion_tokens=out.num_output_tokens,
                 total_tokens=out.num_prompt_tokens + out.num_output_tokens,
                 prompt_tokens_details=PromptTokensDetails(
                     cached_tokens=min(out.num_cached_tokens, out.num_prompt_tokens)))


# The app is late-bound: Serve calls ``__serve_build_asgi_app__`` on each replica after the constructor.
DSparkIngress = serve.ingress()(DSparkServer)

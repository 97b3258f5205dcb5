"""OpenAIRoutes: one replica's HTTP routes, OpenAI's and the operator's, as a FastAPI app.

``/v1/completions``, ``/v1/chat/completions`` (both streaming as SSE),
``/v1/models``; and for operators ``/health``, ``/stats``, ``/metrics``
(speculation under vLLM's names) and ``/admin/drain``. The routes validate a
request into the types of ``protocol.py``, fan it out into engine requests
(``choices.py``), run them on the replica's engine loop and render the
outputs (``responses.py``); every failure is an OpenAI error body
(``errors.py``).

They serve a ``Replica``: its engine loop (the runtime's interface,
``dspark_ray.runtime.engine_loop``), tokenizer and settings, and its
replica-wide answers (stats, the drain switch). ``dspark_ray.serve.server.
DSparkServer`` is the one Serve runs; the same routes are served by Serve's
proxy, by the replica's own HTTP server (``http.py``) or, in a test, on an
ASGI transport.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import logging
import re
from collections.abc import AsyncIterator
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from dspark_ray.engine import InvalidRequest, SamplingParams
from dspark_ray.engine.outputs import SpecCounts
from dspark_ray.openai.choices import (
    Choice,
    ChoiceStreams,
    best_of,
    check_fan_out,
    fan_out,
    request_deadline,
    total_usage,
)
from dspark_ray.openai.errors import APIError, api_error, generation_error, validation_error
from dspark_ray.openai.http import APP_HEADER
from dspark_ray.openai.metrics import vllm_spec_decode_text
from dspark_ray.openai.protocol import ChatCompletionRequest, CompletionRequest, Speculation, Usage, new_id, now
from dspark_ray.openai.reasoning import make_reasoning_parser
from dspark_ray.openai.responses import ChatView, CompletionView, ToolMode
from dspark_ray.openai.tool_parsers import make_tool_parser
from dspark_ray.runtime.engine_loop import EngineLoop
from dspark_ray.runtime.errors import WorkerTimeout
from dspark_ray.tokenizer import ChatTemplateError, Tokenizer

log = logging.getLogger(__name__)


class RouteSettings(Protocol):
    """The settings the routes read (``dspark_ray.serve.config.AppConfig`` has them all)."""

    @property
    def model_name(self) -> str: ...  # what clients put in ``model``
    @property
    def api_key(self) -> str | None: ...
    @property
    def max_request_bytes(self) -> int: ...
    @property
    def max_context(self) -> int: ...
    @property
    def slots_per_replica(self) -> int: ...  # the most choices one request runs at once
    @property
    def request_timeout_s(self) -> float | None: ...
    @property
    def tool_call_parser(self) -> str | None: ...
    @property
    def reasoning_parser(self) -> str | None: ...


class Replica(Protocol):
    """What the routes serve: one replica (``dspark_ray.serve.server.DSparkServer``)."""

    config: RouteSettings
    loop: EngineLoop
    tokenizer: Tokenizer
    app_name: str

    async def stats(self) -> dict:
        """Replica state for operators (``GET /stats``)."""
        ...

    async def drain(self, draining: bool = True) -> dict:
        """Turn the application's drain switch on or off; returns ``drain_status()``."""
        ...

    def port_speculation(self) -> SpecCounts:
        """Speculation counters of this replica and of the replicas sharing its HTTP port (``GET /metrics``)."""
        ...

    def drain_status(self) -> dict:
        """``draining`` as this replica last heard it; the requests it still holds."""
        ...


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


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class OpenAIRoutes:
    """The routes of one replica (module docstring); ``build_api`` mounts them on a FastAPI app."""

    def __init__(self, replica: Replica) -> None:
        self.replica = replica

    @property
    def config(self) -> RouteSettings:
        return self.replica.config

    @property
    def loop(self) -> EngineLoop:
        return self.replica.loop

    @property
    def tokenizer(self) -> Tokenizer:
        return self.replica.tokenizer

    def build_api(self, echo_request_id: bool = True) -> FastAPI:
        """The routes as a FastAPI app. ``echo_request_id``: put ``X-Request-Id`` on every completion
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

    # -- routes ----------------------------------------------------------------

    async def health(self, request: Request) -> JSONResponse:
        app = {APP_HEADER: self.replica.app_name}  # which application answers (http.shared_socket reads it)
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
            return JSONResponse({"status": "draining", "requests_in_flight": len(self.loop.engine.requests)},
                                status_code=503, headers=app)
        return JSONResponse({"status": "ok"}, headers=app)

    async def drain_route(self, request: Request) -> JSONResponse:
        """``POST /admin/drain`` turns the application's drain switch on, ``POST /admin/resume`` off,
        ``GET /admin/drain`` reads it (the API key applies): ``drain_status``."""
        try:
            self._authorize(request)
            if request.method == "POST":
                await self.replica.drain(not request.url.path.endswith("/resume"))
        except APIError as err:
            return err.response()
        except Exception as exc:  # noqa: BLE001 - e.g. the slot manager is restarting
            return api_error(exc).response()
        return JSONResponse(self.replica.drain_status())

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
            runs = check_fan_out("best_of" if req.best_of else "n", req.best_of or req.n, self.config.slots_per_replica)
            params = req.params(n=runs)
            prompts = [self._check_prompt(p, dataclasses.replace(params, n=1)) for p in req.prompt_inputs()]
            req_id = _request_id(request, "cmpl")
            choices = fan_out([ids for ids, _ in prompts], params, req_id)
            view = CompletionView(self._token_text, [t for _, t in prompts] if req.echo else None,
                                  req.logprobs is not None)
            return await self._respond(request, req, req_id, choices, view, keep=req.n)
        except Exception as exc:  # noqa: BLE001 - every error becomes an OpenAI error body
            return api_error(exc).response()

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
            params = req.params(default_max_tokens=room,
                                n=check_fan_out("n", req.n, self.config.slots_per_replica))
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
            return api_error(exc).response()

    async def stats_route(self, request: Request) -> JSONResponse:
        """``GET /stats``: the replica's ``stats()`` (the API key applies)."""
        try:
            self._authorize(request)
        except APIError as err:
            return err.response()
        return JSONResponse(await self.replica.stats())

    async def metrics_route(self, request: Request) -> Response:
        """``GET /metrics``: speculation counters under vLLM's names (Prometheus text), of every replica
        sharing the port this request came in on (``vllm_spec_decode_text``)."""
        try:
            self._authorize(request)
        except APIError as err:
            return err.response()
        text = vllm_spec_decode_text(self.replica.port_speculation(), self.config.model_name)
        return Response(text, media_type="text/plain; version=0.0.4")

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
            raise validation_error(exc) from exc
        if req.model != self.config.model_name:
            raise APIError(400, f"model {req.model!r} is not served here; use {self.config.model_name!r}",
                           param="model", code="model_not_found")
        return req

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _check_prompt(self, prompt: str | list[int], params: SamplingParams) -> tuple[list[int], str]:
        """(token ids, text to echo) of one prompt, validated by the engine (InvalidRequest names the field)."""
        ids = self.loop.engine.check(prompt, params)
        keep_text = isinstance(prompt, str) and params.truncate_prompt_tokens is None
        return ids, prompt if keep_text else self.tokenizer.decode(ids)

    async def _respond(self, request: Request, req, req_id: str, choices: list[Choice], view, keep: int):
        """Run the choices and answer: one body, or an SSE stream. ``keep``: choices returned per prompt."""
        id_header = {REQUEST_ID_HEADER: req_id} if request.app.state.echo_request_id else {}
        streams = ChoiceStreams(self.loop, choices, request_deadline(req.timeout_s, self.config.request_timeout_s))
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
            raise generation_error(failed)
        shown = best_of(choices, keep)
        specs = [c.last.spec for c in choices if c.last.spec]
        body = {
            "id": req_id, "object": view.object, "created": now(), "model": self.config.model_name,
            "choices": [view.choice(c) for c in shown], "usage": total_usage(choices).model_dump(),
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
                    yield _sse(generation_error(out).body())
                    break
                entry = view.chunk(c, out, first=c.index not in started)
                started.add(c.index)
                if entry is None:
                    continue
                chunk = {**base, "choices": [entry]}
                if out.finished and out.spec is not None:
                    chunk["speculation"] = Speculation.of(out.spec).model_dump()
                if continuous:
                    chunk["usage"] = Usage.of(out).model_dump()
                yield _sse(chunk)
            else:
                if include_usage:
                    yield _sse({**base, "choices": [], "usage": total_usage(choices).model_dump()})
        except Exception as exc:  # noqa: BLE001 - reported in the stream
            yield _sse(api_error(exc).body())
        finally:
            await merged.aclose()
        yield "data: [DONE]\n\n"

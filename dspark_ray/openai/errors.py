"""OpenAI error bodies: ``APIError``, and what each failure becomes (status, code, Retry-After).

Every error a route answers is an ``APIError``: an OpenAI error body
(``{"error": {"message", "type", "param", "code"}}``) with its HTTP status.
Bad input is a 4xx naming the field; the runtime's refusals and failures are
503s that say when to retry; anything unforeseen is a 500 whose details stay
in the server's log.
"""

from __future__ import annotations

import logging
import re

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from dspark_ray.engine import InvalidRequest, RequestOutput
from dspark_ray.engine.request import ErrorCode
from dspark_ray.runtime.engine_loop import Draining, EngineDead, Overloaded
from dspark_ray.runtime.errors import SlotServiceUnavailable

log = logging.getLogger(__name__)


class APIError(Exception):
    """An error with an OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 err_type: str = "invalid_request_error", headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.err_type, self.headers = err_type, headers or {}

    def body(self) -> dict:
        """The OpenAI error body (also a stream's error event)."""
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def api_error(exc: BaseException) -> APIError:
    """The ``APIError`` a route answers for ``exc``."""
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


def generation_error(out: RequestOutput) -> APIError:
    """The error of a request the engine ended, by its ``error_code``: its grammar could not go on
    (the request's own constraint: a 400), its deadline passed (504), or a failure on the server's
    side (503: retry)."""
    if out.error_code == ErrorCode.STRUCTURED_OUTPUT:
        return APIError(400, out.error, code=out.error_code)
    if out.error_code == ErrorCode.TIMEOUT:
        return APIError(504, out.error, err_type="timeout_error", code=out.error_code)
    return APIError(503, out.error or "generation failed", err_type="server_error", code="engine_error")


# Names pydantic puts in an error's location for the member of a union it tried
# ("prompt.str", "stop.list[str]"): not part of the request's field path.
_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "bytes", "none"}
_FIELD_PREFIX = re.compile(r"^(?:Value error, )?([A-Za-z_][\w.]*): (.+)$", re.S)


def _field_path(loc: tuple) -> str | None:
    """The request field an error is about, e.g. ``messages.0.role``; None for the body as a whole."""
    parts = [str(p) for p in loc if isinstance(p, int) or (str(p).isidentifier() and str(p) not in _UNION_TAGS)]
    return ".".join(parts) or None


def validation_error(exc: ValidationError) -> APIError:
    """A request body that does not validate: a 400 naming the first field at fault."""
    err = exc.errors()[0]
    param = _field_path(err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        msg = f"unsupported option {param!r}"
    elif param is None and (m := _FIELD_PREFIX.match(msg)):  # a model validator's "field: message"
        param, msg = m.group(1), m.group(2)
    return APIError(400, f"{param}: {msg}" if param else msg, param=param)

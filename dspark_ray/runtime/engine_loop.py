"""EngineLoop: runs an Engine's steps on a dedicated thread for asyncio callers.

The engine is synchronous and single-threaded; Serve handlers are coroutines.
Handlers put commands (add, abort) in an inbox; the loop thread applies them
between steps, so the engine is only ever touched by that thread. Each
request's outputs flow back through its own asyncio queue. An add is answered
through a future, so a request the engine rejects (InvalidRequest) fails its
caller at once and never enters the engine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence

from dspark_ray.engine import Engine, RequestOutput, SamplingParams
from dspark_ray.engine.engine import ENGINE_FAILED, TARGET_FAILED
from dspark_ray.engine.request import ErrorCode
from dspark_ray.engine.interfaces import TargetService
from dspark_ray.runtime.metrics import ServingMetrics
from dspark_ray.runtime.timeline import StepTimeline

log = logging.getLogger(__name__)


class Overloaded(RuntimeError):
    """Too many requests are waiting; the caller should retry later."""

    def __init__(self, waiting: int, retry_after_s: int = 1) -> None:
        super().__init__(f"{waiting} requests are already waiting; retry in {retry_after_s}s")
        self.retry_after_s = retry_after_s


class Draining(RuntimeError):
    """The application's drain switch is on: no new requests; the ones running finish."""

    def __init__(self, retry_after_s: int = 5) -> None:
        super().__init__("the server is draining (maintenance or a redeploy): it takes no new requests and finishes "
                         f"the ones it has; retry in {retry_after_s}s or on another server")
        self.retry_after_s = retry_after_s


class EngineDead(RuntimeError):
    """The engine thread stopped; the replica cannot serve."""


class EngineLoop:
    """Owns the engine thread.

    Besides stepping, the thread sends the slot heartbeat every
    ``sync_interval_s`` (``Engine.sync_slots``); while a step or a target rebuild
    keeps it busy longer than that (a slow step, a stalled worker before its
    deadline, a model load), a second thread tells the slot service the owner
    is alive (``keepalive``), so its leases are never reclaimed as a dead
    owner's. When a target step failed,
    rebuilds the target through ``rebuild_target`` before stepping again. The
    requests in flight wait for it and resume (Engine docstring); a rebuild that
    fails is retried every ``REBUILD_RETRY_S``, and once
    ``target_recovery_timeout_s`` has passed since the failure the requests
    that waited end with an error (the next ones get a new window). Without
    ``rebuild_target`` they end at once and the same target is tried again.
    """

    REBUILD_RETRY_S = 1.0
    # While no step runs, the metrics' gauges are reported again this often: Ray (2.60) exports a
    # gauge only when it was set since the last export and drops a series not exported for two
    # report intervals (20 s by default), so an idle replica's gauges would vanish from Prometheus.
    GAUGE_REFRESH_S = 1.0

    def __init__(self, engine: Engine, max_queued_requests: int, idle_wait_s: float = 0.05,
                 metrics: ServingMetrics | None = None,
                 rebuild_target: Callable[[], TargetService] | None = None,
                 sync_interval_s: float = 1.0, target_recovery_timeout_s: float = 300.0) -> None:
        self.engine = engine
        self.rebuild_target = rebuild_target
        self.target_recovery_timeout_s = target_recovery_timeout_s
        self._next_rebuild = 0.0
        self.sync_interval_s = sync_interval_s
        self._next_sync = 0.0
        self.metrics = metrics or ServingMetrics.for_engine(engine)
        self._reported_at = -math.inf  # time.monotonic() of the last metrics report
        self.max_queued_requests = max_queued_requests
        self.idle_wait_s = idle_wait_s
        self.timeline = StepTimeline()
        self._inbox: deque[Callable[[], None]] = deque()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = False
        self.error: BaseException | None = None
        self._busy_since: float | None = None  # time.monotonic() when the current step or rebuild began
        self._thread = threading.Thread(target=self._run, name="dspark-engine", daemon=True)
        self._thread.start()
        self._keepalive = threading.Thread(target=self._keep_alive, name="dspark-keepalive", daemon=True)
        self._keepalive.start()

    # -- asyncio side ----------------------------------------------------------

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop

    def num_waiting(self) -> int:
        """Requests the engine holds waiting, plus commands not yet done (admissions among them)."""
        return len(self.engine.scheduler.waiting) + len(self._inbox)

    async def generate(
        self, prompt: str | Sequence[int], params: SamplingParams, req_id: str, deadline: float | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; the request is aborted if the caller stops listening.
        ``deadline``: a ``time.monotonic()`` reading past which it ends with a timeout error."""
        if not self.alive:
            raise EngineDead(f"the engine loop is not running: {self.error!r}")
        if self.engine.app_draining:
            raise Draining()
        waiting = self.num_waiting()
        if waiting >= self.max_queued_requests:
            raise Overloaded(waiting)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        accepted: concurrent.futures.Future = concurrent.futures.Future()
        submitted = time.monotonic()

        def add() -> None:
            try:
                self.engine.add_request(prompt, params, req_id, deadline=deadline)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                accepted.set_exception(exc)
                return
            self.metrics.submitted(req_id, submitted)
            self._streams[req_id] = (loop, queue)
            accepted.set_result(None)

        self._submit(add)
        await asyncio.wrap_future(accepted)
        finished = False
        try:
            while not finished:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort(req_id)

    async def set_draining(self, draining: bool) -> bool:
        """Turn the application's drain switch on or off (on its slot manager, so every replica hears
        of it with its next heartbeat; this one at once). Returns the switch."""
        done: concurrent.futures.Future = concurrent.futures.Future()

        def switch() -> None:  # on the engine thread, the only one that calls the slot service
            try:
                self.engine.app_draining = self.engine.slots.set_draining(draining)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                done.set_exception(exc)
                return
            done.set_result(self.engine.app_draining)

        self._submit(switch)
        return await asyncio.wrap_future(done)

    def abort(self, req_id: str) -> None:
        def abort() -> None:
            self.engine.abort(req_id)

        self._submit(abort)

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)
        self.metrics.close()

    def _submit(self, command: Callable[[], None]) -> None:
        self._inbox.append(command)
        self._wake.set()

    # -- engine thread ---------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop:
                loop_start = time.perf_counter()
                while self._inbox:
                    # Run first, then take it off: an admission counts as waiting (num_waiting) until the
                    # engine holds it, so two requests arriving together cannot both pass a full queue.
                    try:
                        self._inbox[0]()
                    finally:
                        self._inbox.popleft()
                self._busy_since = time.monotonic()
                self._maintain()
                self._busy_since = None
                if self.engine.target_error is not None:  # waiting for a rebuilt target
                    self._wake.wait(self.idle_wait_s)
                    self._wake.clear()
                    continue
                if not self.engine.has_unfinished():
                    self._wake.wait(self.idle_wait_s)
                    self._wake.clear()
                    continue
                t0 = time.perf_counter()
                steps = self.engine.counters.steps
                self._busy_since = time.monotonic()
                try:
                    outputs = self.engine.step()
                except Exception as exc:  # the engine broke: fail everything in flight, keep serving
                    log.exception("engine step failed")
                    outputs = self._fail_all(exc)
                finally:
                    self._busy_since = None
                t1 = time.perf_counter()
                self._deliver(outputs)
                t2 = time.perf_counter()
                self._report(outputs)
                if self.engine.counters.steps != steps:
                    self._record_step(loop_start, t0, t1, t2)
        except BaseException as exc:  # noqa: BLE001 - recorded, reported by /health
            self.error = exc
            log.exception("engine loop died")
            for loop, queue in self._streams.values():
                loop.call_soon_threadsafe(queue.put_nowait, EngineDead(str(exc)))

    def _keep_alive(self) -> None:
        """While the engine thread is busy past a heartbeat interval, tell the slot service its owner
        is alive (``keepalive``: no state read, safe from this thread)."""
        keepalive = getattr(self.engine.slots, "keepalive", None)
        if keepalive is None:  # an in-process registry keeps no owners' clocks
            return
        while not self._stop:
            time.sleep(self.sync_interval_s)
            since = self._busy_since
            if since is not None and time.monotonic() - since >= self.sync_interval_s:
                try:
                    keepalive(self.engine.owner)
                except Exception:  # noqa: BLE001 - the next beat tries again
                    log.warning("slot keepalive failed", exc_info=True)

    def _record_step(self, loop_start: float, t0: float, t1: float, t2: float) -> None:
        timings, timeline = self.engine.timings, self.timeline
        timeline.add("step", t1 - t0)
        for phase in ("schedule", "propose", "verify", "commit"):
            timeline.add(phase, getattr(timings, phase))
        timeline.add("deliver", t2 - t1)
        timeline.add("loop", time.perf_counter() - loop_start)

    def _report(self, outputs: list) -> None:
        self._reported_at = time.monotonic()
        self.metrics.after_step(outputs, self.num_waiting())

    def _maintain(self) -> None:
        """Between steps: the slot heartbeat, a target rebuild after a failure, and the metrics'
        gauges while no step reports them."""
        now = time.monotonic()
        if now - self._reported_at >= self.GAUGE_REFRESH_S:
            self._report([])
        if now >= self._next_sync:
            self._next_sync = now + self.sync_interval_s
            try:
                self.engine.sync_slots()
            except Exception as exc:  # noqa: BLE001 - the manager may be restarting; next beat retries
                log.warning("slot heartbeat failed: %r", exc)
        if self.engine.target_error is not None:
            if self.engine.expire(now):  # steps do this; none runs while the target is rebuilt
                expired = self.engine.take_pending()
                self._deliver(expired)
                self._report(expired)
            if now >= self._next_rebuild:
                self._recover_target(now)

    def _recover_target(self, now: float) -> None:
        """Rebuild the failed target; past the recovery deadline, end the requests that waited."""
        engine = self.engine
        if self.rebuild_target is None or now - engine.target_failed_at > self.target_recovery_timeout_s:
            log.error("target not rebuilt within %.0fs of its failure; ending the requests in flight",
                      now - engine.target_failed_at)
            engine.fail_all(TARGET_FAILED, ErrorCode.TARGET_FAILED)
            failed = engine.take_pending()
            self._deliver(failed)
            self._report(failed)
            engine.target_failed_at = now  # requests from now on get a window of their own
            if self.rebuild_target is None:
                engine.reset_target(engine.target)
                return
        log.warning("rebuilding the target after: %r", engine.target_error)
        try:
            target = self.rebuild_target()
        except Exception:  # noqa: BLE001 - retried; the requests keep waiting until the deadline
            log.exception("target rebuild failed; retrying in %.0fs", self.REBUILD_RETRY_S)
            self._next_rebuild = now + self.REBUILD_RETRY_S
            return
        engine.reset_target(target)
        log.warning("target rebuilt; %d requests resume", len(engine.scheduler.waiting))

    def _fail_all(self, exc: Exception) -> list[RequestOutput]:
        """End every request with ENGINE_FAILED (``exc`` itself is in the log, not in the replies)."""
        self.engine.fail_all(ENGINE_FAILED)
        return self.engine.take_pending()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.req_id)
            if stream is None:
                continue
            loop, queue = stream
            if out.finished:
                del self._streams[out.req_id]
            try:
                loop.call_soon_threadsafe(queue.put_nowait, out)
            except RuntimeError:  # the caller's event loop is gone
                pass

"""The runtime's failures, as the engine and the serving front see them.

Raised by the facades over the worker actors (``actors.py``): the engine
handles them (a failed target is rebuilt, a missing draft means a step
without speculation) and the OpenAI front reports them (``SlotServiceUnavailable``
is a 503 with Retry-After, a ``WorkerTimeout`` names the worker in ``/health``).
"""

from __future__ import annotations

from dspark_ray.runtime.channel import ChannelTimeout


class TensorParallelDivergence(RuntimeError):
    """Two tensor-parallel ranks verified differently: their KV is no longer consistent."""


class SlotServiceUnavailable(RuntimeError):
    """The slot manager did not answer within the admission timeout."""


class DraftUnavailable(RuntimeError):
    """The draft worker is down or restarting; the engine runs this step without speculation."""


class WorkerTimeout(ChannelTimeout):
    """A worker did not answer a step within its deadline (``StepDeadline``): hung, wedged in a
    collective, or unreachable. Handled as a crash of that worker."""

    def __init__(self, worker: str, limit_s: float) -> None:
        super().__init__(f"the {worker} did not answer a step within {limit_s:.1f} s (hung, wedged in a "
                         "collective, or unreachable)")
        self.worker, self.limit_s = worker, limit_s

"""InvalidRequest: the error a caller gets for bad input, before the request changes anything.

Raised by ``SamplingParams`` and ``StructuredOutput`` as they are built and by
``Engine.add_request`` / ``Engine.check``; the serving layer answers it with an
HTTP 400 whose ``param`` is ``field``.
"""

from __future__ import annotations


class InvalidRequest(ValueError):
    """A request parameter is out of range. ``field`` names the offending input."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

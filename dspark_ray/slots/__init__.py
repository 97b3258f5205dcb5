"""Request-stable slots and the per-slot state indexed by them.

Three levels, as in SGLang's memory pool:

- ``SlotRegistry`` (plain Python) maps a request id to a slot and an epoch;
  ``SlotManager`` is the Ray actor around it, one per application.
- ``ReqToTokenTable`` maps each slot's positions to token indices in the
  target's KV pool; ``TokenKVAllocator`` hands those indices out.
- ``DraftWindowCache`` holds the draft model's sliding-window K/V per slot.

Slots are the application's, shared by its replicas; each replica's buffers
have rows for what that replica holds, and ``ReplicaSlots`` gives every lease
it takes a row of its own (``replica.py`` says why).

Names are resolved lazily so that bookkeeping code importing the registry
pays for neither torch nor ray.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "PADDING_SLOT": "registry",
    "LiveLease": "registry",
    "SlotConflict": "registry",
    "SlotCounters": "registry",
    "SlotError": "registry",
    "SlotLease": "registry",
    "SlotRegistry": "registry",
    "SlotSnapshot": "registry",
    "SlotsExhausted": "registry",
    "UnknownRequest": "registry",
    "SyncResult": "registry",
    "SlotManager": "manager",
    "SlotsRecovering": "manager",
    "get_slot_manager": "manager",
    "slot_manager_name": "manager",
    "start_slot_manager": "manager",
    "ReplicaSlots": "replica",
    "KVPoolExhausted": "req_to_token",
    "ReqToTokenTable": "req_to_token",
    "TokenKVAllocator": "req_to_token",
    "DraftWindowCache": "window_cache",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from .manager import SlotManager, SlotsRecovering, get_slot_manager, slot_manager_name, start_slot_manager
    from .replica import ReplicaSlots
    from .registry import (
        PADDING_SLOT,
        LiveLease,
        SlotConflict,
        SlotCounters,
        SlotError,
        SlotLease,
        SlotRegistry,
        SlotSnapshot,
        SlotsExhausted,
        SyncResult,
        UnknownRequest,
    )
    from .req_to_token import KVPoolExhausted, ReqToTokenTable, TokenKVAllocator
    from .window_cache import DraftWindowCache


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__

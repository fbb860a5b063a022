"""``reduce``: one event in, the state changed in place and the plans out.

The composition of the defrag and transfer reducers over one :class:`State`: transfers
resolve GPU ids through the defrag mapping and pin what they touch; defrag skips pinned
blocks. ``reduce`` runs ``validate_event`` first, then the event's reducer, which validates
against the state before it changes anything, so a refused event leaves the state (and its
digest) exactly as it was.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvlog.errors import NotConfigured
from kvlog.events import (
    BlocksAllocated,
    BlocksReleased,
    CacheConfigured,
    Event,
    LoadRequested,
    Plan,
    RequestFinished,
    RequestPreempted,
    StepEnded,
    StoreRequested,
    SwapPlan,
    TransferFinished,
    TransferSubmitted,
    validate_event,
)
from kvlog.reducers import defrag, transfers
from kvlog.reducers.state import State

__all__ = ["reduce", "validate"]

_REDUCERS: dict[type, Callable[[State, Any], list[Plan]]] = {
    BlocksAllocated: defrag.allocate,
    RequestFinished: defrag.release,
    RequestPreempted: defrag.release,
    StepEnded: defrag.end_step,
    StoreRequested: transfers.submit,
    LoadRequested: transfers.submit,
    TransferFinished: transfers.finish,
    TransferSubmitted: transfers.submitted,
    BlocksReleased: defrag.release_blocks,
}


_CHECKS: dict[type, Callable[[State, Any], object]] = {
    BlocksAllocated: defrag.check_allocate,
    RequestFinished: lambda state, event: None,
    RequestPreempted: lambda state, event: None,
    StepEnded: lambda state, event: None,
    StoreRequested: transfers.check_submit,
    LoadRequested: transfers.check_submit,
    TransferFinished: transfers.check_finish,
    TransferSubmitted: transfers.check_submitted,
    BlocksReleased: defrag.check_release_blocks,
}


def validate(state: State, event: Event) -> None:
    """Raise what ``reduce`` would raise for this event, changing nothing (for callers that
    log an event before reducing it)."""
    validate_event(event)
    if isinstance(event, CacheConfigured):
        defrag.check_configure(state, event)
    elif state.config is None:
        raise NotConfigured("the first event must be CacheConfigured", event)
    else:
        _CHECKS[type(event)](state, event)


def reduce(state: State, event: Event) -> tuple[State, list[Plan]]:
    """Apply one event: raise an ``InvalidEvent`` subclass (state untouched) or return the
    same state object, changed, with the event's plans."""
    validate_event(event)
    reducer = _REDUCERS.get(type(event))
    if reducer is not None and state.config is not None:
        plans = reducer(state, event)
    elif isinstance(event, CacheConfigured):
        plans = defrag.configure(state, event)
    elif state.config is None:
        raise NotConfigured("the first event must be CacheConfigured", event)
    else:
        plans = _REDUCERS[type(event)](state, event)
    state.last_swap = plans[0] if plans and isinstance(plans[0], SwapPlan) else None
    return state, plans

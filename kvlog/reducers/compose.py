"""``reduce``: one event in, the state changed in place and the plans out.

The composition of the defrag and transfer reducers over one :class:`State`: transfers
resolve GPU ids through the defrag mapping and pin what they touch; defrag skips pinned
blocks. ``check`` runs ``validate_event``, then the event's check against the state, and
keeps what the check found; ``commit`` applies it, once, using those findings. A refused
event leaves the state (and its digest) exactly as it was. ``reduce`` is the two in a row;
the Engine appends the event to its log between them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple, cast

from kvlog.errors import NotConfigured
from kvlog.events import (
    TIER_EVENTS,
    WHOLE_STEPS,
    BlocksAllocated,
    BlocksReleased,
    CacheConfigured,
    Event,
    LoadRequested,
    Plan,
    RequestFinished,
    RequestPreempted,
    StepEnded,
    StepPacked,
    StepScheduled,
    StoreRequested,
    SwapPlan,
    TierBatch,
    TransferBatch,
    TransferFinished,
    TransferSubmitted,
    validate_event,
)
from kvlog.events.validate import DECODED_VALIDATORS, VALIDATORS, scheduled_ids
from kvlog.reducers import defrag, step, transfer_batch, transfers
from kvlog.reducers.state import State

__all__ = ["Checked", "check", "check_decoded", "commit", "recorded", "reduce"]

_Check = Callable[[State, Any], Any]
_Apply = Callable[[State, Any, Any], list[Plan]]


def _unchecked(state: State, event: Event) -> None:
    """Events with nothing to check against the state."""
    return None


def _tier_only(state: State, event: Event) -> list[Plan]:
    """The CPU tier's events change nothing in the GPU books (``reducers/cpu_tier.py``)."""
    return []


def _no_check(apply: Callable[[State, Any], list[Plan]]) -> _Apply:
    return lambda state, event, checked: apply(state, event)


_PAIRS: dict[type, tuple[_Check, _Apply]] = {
    CacheConfigured: (defrag.check_configure, defrag.apply_configure),
    BlocksAllocated: (defrag.check_allocate, defrag.apply_allocate),
    RequestFinished: (_unchecked, _no_check(defrag.release)),
    RequestPreempted: (_unchecked, _no_check(defrag.release)),
    StepEnded: (_unchecked, _no_check(defrag.end_step)),
    StoreRequested: (transfers.check_submit, transfers.apply_submit),
    LoadRequested: (transfers.check_submit, transfers.apply_submit),
    TransferFinished: (transfers.check_finish, transfers.apply_finish),
    TransferSubmitted: (transfers.check_submitted, transfers.apply_submitted),
    BlocksReleased: (defrag.check_release_blocks, defrag.apply_release_blocks),
    StepScheduled: (step.check_step, step.apply_step),
    StepPacked: (step.check_step, step.apply_step),
    **{tier_event: (_unchecked, _no_check(_tier_only)) for tier_event in TIER_EVENTS},
    TierBatch: (_unchecked, _no_check(_tier_only)),
    TransferBatch: (transfer_batch.check_batch, transfer_batch.apply_batch),
}
"""Per event type: its check against the state and its apply."""
_STEPS: dict[type, tuple[Callable[[Any], Any], _Check, _Apply]] = {
    event_type: (VALIDATORS[event_type], check_event, apply_event)
    for event_type, (check_event, apply_event) in _PAIRS.items()
}
_STEPS[StepScheduled] = (scheduled_ids, step.check_step, step.apply_step)
"""Per event type: its stateless validation, its check against the state, its apply. A
``StepScheduled``'s validation returns the block ids it read, which its check takes
(``_check``); every other validation returns None."""
_DECODED_STEPS: dict[type, tuple[Callable[[Any], Any], _Check, _Apply]] = {
    event_type: (DECODED_VALIDATORS[event_type], check_event, apply_event)
    for event_type, (_, check_event, apply_event) in _STEPS.items()
}
"""``_STEPS`` with the validation of events the log's typed decoder produced."""
_COUNTED_STEPS = {**_DECODED_STEPS}
for _whole in WHOLE_STEPS:
    _COUNTED_STEPS[_whole] = (DECODED_VALIDATORS[_whole], step.check_step, step.apply_step_counted)
"""``_DECODED_STEPS`` for a machine that counts a step's defrag moves instead of listing
them (``step.apply_step_counted``)."""


class Checked(NamedTuple):
    """An event ``check`` accepted, with what its reducer found while checking it. Commit
    it to the same, unchanged state (the check's findings describe that state)."""

    event: Event
    apply: _Apply
    found: Any


_checked: Callable[[tuple[Event, _Apply, Any]], Checked] = functools.partial(tuple.__new__, Checked)
"""``Checked`` from a plain tuple without the NamedTuple constructor's Python frame."""


def check(state: State, event: Event) -> Checked:
    """Raise what ``reduce`` would raise for this event (an ``InvalidEvent`` subclass or
    ``NotConfigured``), changing nothing; else the event, checked, ready for ``commit``."""
    return _check(state, event, _STEPS.get(type(event)))  # exact types: no subclass decodes


def check_decoded(state: State, event: Event, counted: bool = False) -> Checked:
    """``check`` for an event the log's typed decoder produced (a replay's): the same
    verdict, without checking again the types msgspec made exact (``DECODED_VALIDATORS``).
    ``counted``: its commit counts a whole step's defrag moves in ``state.counted_pairs``
    instead of returning their ``SwapPlan`` (``step.apply_step_counted``)."""
    steps = _COUNTED_STEPS if counted else _DECODED_STEPS
    return _check(state, event, steps.get(type(event)))


def _check(
    state: State, event: Event, steps: tuple[Callable[[Any], Any], _Check, _Apply] | None
) -> Checked:
    if steps is None:
        validate_event(event)  # raises: not a kvlog event
        raise AssertionError(f"{type(event).__name__} validates but has no reducer")
    validate, check_event, apply_event = steps
    ids = validate(event)  # None but for a StepScheduled: the ids its validation read
    if state.config is None and type(event) is not CacheConfigured:
        raise NotConfigured("the first event must be CacheConfigured", event)
    if ids is None:
        return _checked((event, apply_event, check_event(state, event)))
    return _checked((event, apply_event, step.check_step(state, cast(StepScheduled, event), ids)))


def recorded(checked: Checked, pool: int = 0) -> Event:
    """The record a log keeps for a checked event (``step.log_form``: a whole step checked
    in bulk in its packed form, every other event itself); ``pool``: the checked state's
    ``num_gpu_blocks``, if known (0: not)."""
    return step.log_form(checked.event, checked.found, pool)


def commit(state: State, checked: Checked) -> list[Plan]:
    """Change the state by a checked event, once; its plans (cannot refuse)."""
    plans = checked.apply(state, checked.event, checked.found)
    state.last_swap = plans[-1] if plans and type(plans[-1]) is SwapPlan else None
    return plans


def reduce(state: State, event: Event) -> tuple[State, list[Plan]]:
    """Apply one event: raise an ``InvalidEvent`` subclass (state untouched) or return the
    same state object, changed, with the event's plans."""
    return state, commit(state, check(state, event))

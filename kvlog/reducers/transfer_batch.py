"""``TransferBatch``: several transfer events applied as one, exactly as one after another.

The check validates each event and runs its own check against the state as it is, once,
and proves that
the events of the batch cannot change one another's outcome:

- requests (``StoreRequested`` / ``LoadRequested``) have strictly increasing job ids;
- no two loads of the batch write one physical GPU block, no store and load of the batch
  share a CPU sub-block, and the batch's requests fit under ``MAX_JOBS_IN_FLIGHT``;
- ``TransferSubmitted`` names a job in flight or one the batch requested before it;
- ``TransferFinished`` (which unpins) comes only in batches of finishes of distinct jobs.

Requests read only the defrag mapping, pins and jobs, which no transfer event of the batch
changes in a way its checks would see under those conditions; so what each check found
stays true and the commit applies the events in order with it. A batch outside these
conditions (or one an event refuses) is checked exactly instead: its events reduced one
by one on a copy of the state, and the first refusal raised; the commit then rechecks each
event on the state. Either way a refused batch changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from kvlog.errors import InvalidEvent
from kvlog.events import (
    LoadRequested,
    Plan,
    StoreRequested,
    TransferBatch,
    TransferEvent,
    TransferFinished,
    TransferSubmitted,
)
from kvlog.events.validate import VALIDATORS
from kvlog.reducers import digest, transfers
from kvlog.reducers.state import MAX_JOBS_IN_FLIGHT, State

__all__ = ["BatchFound", "apply_batch", "check_batch"]


class BatchFound(NamedTuple):
    """What the check found: each event's own finding (``None`` where the commit looks the
    job up), or ``exact`` when the commit rechecks every event in order."""

    found: list[Any]
    exact: bool


def _independent(state: State, batch: TransferBatch) -> list[Any] | None:
    """Each event's finding against the state as it is, or None if the batch's events may
    interact (or one is refused): then only the exact path decides."""
    events = batch.events
    kinds = [type(event) for event in events]
    try:
        for kind, event in zip(kinds, events, strict=True):
            VALIDATORS[kind](event)
    except InvalidEvent:
        return None
    if TransferFinished in kinds:
        if kinds.count(TransferFinished) != len(kinds):
            return None
        if len({e.job_id for e in events}) != len(events):
            return None
        try:
            return [transfers.check_finish(state, e) for e in events if type(e) is TransferFinished]
        except InvalidEvent:
            return None
    found: list[Any] = []
    requested: set[int] = set()
    last = state.last_job_id
    loads: list[np.ndarray] = []
    cpu: dict[str, list[np.ndarray]] = {"store": [], "load": []}
    for event in events:
        if isinstance(event, TransferSubmitted):
            if event.job_id not in requested and state.job(event.job_id) is None:
                return None
            found.append(None)
            continue
        assert isinstance(event, (StoreRequested, LoadRequested)), "validated batch"
        if event.job_id <= last:
            return None
        last = event.job_id
        try:
            checked = transfers.check_submit(state, event)
        except InvalidEvent:
            return None
        physical, subs, _ = checked
        requested.add(event.job_id)
        if type(event) is LoadRequested:
            loads.append(physical)
        cpu["store" if type(event) is StoreRequested else "load"].append(subs)
        found.append(checked)
    if loads and len(requested) > 1 and not _disjoint(loads, cpu):  # stores alone: no clash
        return None
    if len(state.store_jobs) + len(state.load_jobs) + len(requested) > MAX_JOBS_IN_FLIGHT:
        return None
    return found


def _disjoint(loads: list[np.ndarray], cpu: dict[str, list[np.ndarray]]) -> bool:
    """No GPU block written by two loads, no CPU sub-block used by a store and a load."""
    if sum(map(len, loads)) + sum(map(len, cpu["store"])) + sum(map(len, cpu["load"])) <= 256:
        return _disjoint_few(loads, cpu)  # a step's few jobs: sets beat numpy's set-up
    if len(loads) > 1:
        written = np.concatenate(loads)
        if np.unique(written).size != written.size:
            return False
    if cpu["store"] and cpu["load"]:
        stored, loaded = np.concatenate(cpu["store"]), np.concatenate(cpu["load"])
        if np.isin(stored, loaded).any():
            return False
    return True


def _disjoint_few(loads: list[np.ndarray], cpu: dict[str, list[np.ndarray]]) -> bool:
    """``_disjoint`` over Python sets."""
    written: set[int] = set()
    for ids in loads:  # each load's own ids are distinct (validated)
        listed = ids.tolist()
        if not written.isdisjoint(listed):
            return False
        written.update(listed)
    if cpu["store"] and cpu["load"]:
        stored = {s for ids in cpu["store"] for s in ids.tolist()}
        return all(stored.isdisjoint(ids.tolist()) for ids in cpu["load"])
    return True


_MEMBERS: dict[type, tuple[Callable[[State, Any], Any], Callable[[State, Any, Any], list[Plan]]]]
_MEMBERS = {
    StoreRequested: (transfers.check_submit, transfers.apply_submit),
    LoadRequested: (transfers.check_submit, transfers.apply_submit),
    TransferFinished: (transfers.check_finish, transfers.apply_finish),
    TransferSubmitted: (transfers.check_submitted, transfers.apply_submitted),
}
"""A batch member's check and apply: the same pairs the composed reducer uses for them."""


def _one_by_one(state: State, events: list[TransferEvent]) -> list[Plan]:
    """Validate, check and apply each event in turn on ``state``; raise the first refusal
    (the state then holds the events before it: callers use a copy, or a batch checked)."""
    plans: list[Plan] = []
    for event in events:
        VALIDATORS[type(event)](event)
        check_event, apply_event = _MEMBERS[type(event)]
        plans += apply_event(state, event, check_event(state, event))
    return plans


def _exact(state: State, batch: TransferBatch) -> None:
    """Reduce the events one by one on a copy of the state; raise the first refusal."""
    _one_by_one(digest.restore(digest.snapshot(state)), batch.events)


def check_batch(state: State, batch: TransferBatch) -> BatchFound:
    """Refuse the batch as its first refused event would be refused; else its findings."""
    found = _independent(state, batch)
    if found is not None:
        return BatchFound(found, False)
    _exact(state, batch)
    return BatchFound([], True)


def apply_batch(state: State, batch: TransferBatch, checked: BatchFound) -> list[Plan]:
    """Apply the checked batch's events in order; their plans, concatenated."""
    plans: list[Plan] = []
    if checked.exact:
        return _one_by_one(state, batch.events)
    for event, found in zip(batch.events, checked.found, strict=True):
        if isinstance(event, TransferSubmitted):
            job = state.job(event.job_id)
            if job is None:
                raise AssertionError(f"job {event.job_id} checked in flight: batch bug")
            plans += transfers.apply_submitted(state, event, None if job.submitted else job)
        elif isinstance(event, TransferFinished):
            plans += transfers.apply_finish(state, event, found)
        else:
            plans += transfers.apply_submit(state, event, found)
    return plans

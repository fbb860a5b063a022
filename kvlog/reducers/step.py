"""``StepScheduled``: one whole scheduler step, checked at once and applied in one call.

The step stands for the fine-grained events of ``StepScheduled``'s docstring (releases,
allocations, ``StepEnded``) and leaves exactly their state, plans and digest. What makes it
cheaper is that it is one event: one dispatch, one log record, one check of every block of
the step against the state as the step's own releases leave it, then one apply.

The check never changes the state. It walks the step's requests in order, keeping only
what the step itself changes on the way: which requests' tables are gone (``released``),
which physical blocks those tables referenced (``dropped``, counted only when a block being
given still has references, i.e. rarely), and which physical blocks earlier requests of the
step took (``taken``). An allocation is refused exactly where its ``BlocksAllocated`` would
be, at that point of the sequence: a block out of range, a block an unfinished load writes,
or (without prefix caching) a block some table still holds. The apply then cannot refuse.

Cost: O(blocks named in the step) with per-block work in plain loops over ``array.array``
buffers for small allocations and numpy for large ones; never O(pool).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from kvlog.errors import BlockInUse, BlockOutOfRange
from kvlog.events import BlocksAllocated, Plan, StepScheduled
from kvlog.reducers import defrag
from kvlog.reducers.blockset import SCALAR_LIMIT
from kvlog.reducers.state import State

__all__ = ["StepFound", "apply_step", "check_step"]


class StepFound(NamedTuple):
    """What ``check_step`` found: the requests to release first (finished, then preempted,
    in order) and, per allocation in order, whether the request is released just before it
    (resumed), its physical ids and whether they were all free and unpinned."""

    releases: list[str]
    allocations: list[tuple[str, list[int], bool, list[int], bool]]


def check_step(state: State, event: StepScheduled) -> StepFound:
    """Refuse the step if any of its events would be refused where it stands; else what
    the apply needs."""
    config = state.config
    assert config is not None, "reduce() dispatches only configured states here"
    size = config.num_gpu_blocks
    tables = state.tables
    releases: list[str] = []
    released: set[str] = set()
    for req_id in (*event.finished, *event.preempted):
        if req_id in tables and req_id not in released:
            releases.append(req_id)
            released.add(req_id)
    resumed = set(event.resumed) if event.resumed else ()
    scan = _Scan(state, config.prefix_caching)
    scan.released = released
    allocations = []
    for req_id, block_ids in event.allocated.items():
        if not block_ids:
            continue
        again = req_id in resumed and req_id in tables and req_id not in released
        if again:
            released.add(req_id)
            scan.forget_dropped()
        if max(block_ids) >= size:
            bad = next(b for b in block_ids if b >= size)
            raise BlockOutOfRange(
                f"allocated[{req_id!r}] holds block id {bad}, outside [0, {size})",
                _sub_event(req_id, block_ids),
            )
        physical, free = scan.allocate(req_id, block_ids)
        allocations.append((req_id, block_ids, again, physical, free))
    return StepFound(releases, allocations)


def _sub_event(req_id: str, block_ids: list[int]) -> BlocksAllocated:
    return BlocksAllocated(req_id=req_id, block_ids=block_ids)


class _Scan:
    """The check's view: the state plus what the step has released and taken so far."""

    def __init__(self, state: State, prefix_caching: bool) -> None:
        self.state = state
        self.prefix_caching = prefix_caching
        self.released: set[str] = set()
        self.taken: dict[int, int] = {}  # physical -> references the step added
        self._dropped: dict[int, int] | None = None

    def forget_dropped(self) -> None:
        """The released set grew: recount the references it drops when next asked."""
        self._dropped = None

    def dropped(self, physical: int) -> int:
        """References to ``physical`` that the step's releases so far drop."""
        if self._dropped is None:
            counts: dict[int, int] = {}
            fwd = self.state.fwd_buffer
            for req_id in self.released:
                for b in self.state.tables.get(req_id, ()):
                    p = fwd[b]
                    counts[p] = counts.get(p, 0) + 1
            self._dropped = counts
        return self._dropped.get(physical, 0)

    def allocate(self, req_id: str, block_ids: list[int]) -> tuple[list[int], bool]:
        """Check one allocation where it stands; its physical ids and whether all were
        free and unpinned (no reference left, none taken earlier in the step)."""
        state = self.state
        fwd = state.fwd_buffer
        physical = [fwd[b] for b in block_ids]
        if len(physical) > SCALAR_LIMIT:
            ids = np.asarray(physical, dtype=np.int64)
            busy = bool((state.refs[ids] | state.load_pins[ids] | state.store_pins[ids]).any())
        else:
            refs, loads, stores = state.refs_buffer, state.load_pins_buffer, state.store_pins_buffer
            busy = any(refs[p] or loads[p] or stores[p] for p in physical)
        taken = self.taken
        if busy or (taken and not taken.keys().isdisjoint(physical)):
            self._check_busy(req_id, block_ids, physical)
            free = False
        else:
            free = True
        for p in physical:
            taken[p] = taken.get(p, 0) + 1
        return physical, free

    def _check_busy(self, req_id: str, block_ids: list[int], physical: list[int]) -> None:
        """Refuse what ``BlocksAllocated`` would: a block being loaded into, or (without
        prefix caching) a block a table still holds after the step's releases."""
        state = self.state
        loads, refs = state.load_pins_buffer, state.refs_buffer
        for b, p in zip(block_ids, physical, strict=True):
            if loads[p]:
                raise BlockInUse(
                    f"block {b} (physical {p}) is still being written by an unfinished load",
                    _sub_event(req_id, block_ids),
                )
            if self.prefix_caching:
                continue
            held = refs[p] - self.dropped(p) + self.taken.get(p, 0)
            if held > 0:
                raise BlockInUse(
                    f"block {b} (physical {p}) is held by a live request and prefix caching is off",
                    _sub_event(req_id, block_ids),
                )


def apply_step(state: State, event: StepScheduled, found: StepFound) -> list[Plan]:
    """The step's releases, allocations and defrag decision, in order; their plans."""
    plans: list[Plan] = []
    for req_id in found.releases:
        defrag.release_request(state, req_id)
    for req_id, block_ids, again, physical, free in found.allocations:
        if again:
            defrag.release_request(state, req_id)
        flushed = defrag.allocate_blocks(state, req_id, block_ids, physical, free)
        if flushed:
            plans += flushed
    plans += defrag.end_step_at(state, event.step)
    return plans

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

The usual step skips that walk: one compiled pass (``kernels.step_allocation``) finds every
block in range, free, unpinned and given once, and the step commits in bulk. A step whose
releases free blocks it then gives again (a full pool hands a finished request's blocks
straight to the next), or that shares blocks under prefix caching, takes a second compiled
pass that takes the blocks as the step's events would (``kernels.step_allocation_after``),
and is bulk too unless a block needs a flush or a refusal, or it releases a resumed request
that still holds a table (between the allocations). A resumed request without one (every
new request, where the Gaudi switch passes whole tables) changes nothing.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any, NamedTuple, NoReturn

import numpy as np

from kvlog.errors import BlockInUse, BlockOutOfRange, DuplicateBlock
from kvlog.events import (
    BlocksAllocated,
    Event,
    Plan,
    RequestFinished,
    RequestPreempted,
    StepEnded,
    StepPacked,
    StepScheduled,
    packed_counts,
    packed_ids,
    packed_step,
)
from kvlog.events.int_lists import int_lists
from kvlog.reducers import defrag, kernels, transfers
from kvlog.reducers.blockset import SCALAR_LIMIT
from kvlog.reducers.state import State

__all__ = [
    "Step",
    "StepFound",
    "apply_step",
    "apply_step_counted",
    "check_step",
    "expand",
    "held_by_receiver",
    "log_form",
]


Step = StepScheduled | StepPacked
"""A whole scheduler step, in either of its forms (``StepPacked``: its ids as arrays)."""


class StepFound(NamedTuple):
    """What ``check_step`` found: the requests to release first (finished, then preempted,
    in order, each once, each holding a table); per allocation in order, whether the
    request is released just before it (resumed), its physical ids and whether they were
    all free and unpinned; when the step commits in bulk, all of its logical and physical
    ids in two arrays (``bulk``, else None); and then, per allocation that reuses blocks
    an unfinished store still reads, in order, those physical blocks (``flushes``: each
    list flushed before the step's defrag decision, as its ``BlocksAllocated`` would)."""

    releases: list[str]
    allocations: list[tuple[str, list[int], bool, list[int] | None, bool]] | None
    bulk: tuple[np.ndarray, np.ndarray] | None
    flushes: list[list[int]]


_found: Callable[[tuple[Any, Any, Any, Any]], StepFound] = functools.partial(
    tuple.__new__, StepFound
)
"""``StepFound`` from a plain tuple without the NamedTuple constructor's Python frame."""


def check_step(state: State, event: Step, ids: np.ndarray | None = None) -> StepFound:
    """Refuse the step if any of its events would be refused where it stands; else what
    the apply needs. One compiled pass over all of the step's blocks settles the usual
    step (every block free), a second one a step that reuses its own releases' blocks or
    shares blocks under prefix caching (``_after_releases``); a step with a block that
    needs a flush or a refusal checks block by block. ``ids``: a ``StepScheduled``'s
    block ids as its validation just read them (``validate.scheduled_ids``), or None."""
    config = state.config
    assert config is not None, "reduce() dispatches only configured states here"
    tables = state.running.slots  # the requests holding a table (membership only)
    releases: list[str] = []
    released: set[str] = set()
    for req_id in (*event.finished, *event.preempted) if event.preempted else event.finished:
        if req_id in tables and req_id not in released:
            releases.append(req_id)
            released.add(req_id)
    if isinstance(event, StepPacked):  # the ids as one array already
        logical = packed_ids(event).astype(np.int64)
        count = logical.size
    elif ids is not None:  # read by the validation just now
        logical, count = ids, ids.size
    else:
        allocated = event.allocated
        count = sum(map(len, allocated.values()))
        if count:
            logical = _logical(event, tables, released, count, config.num_gpu_blocks)
    if not count:
        none = np.zeros(0, dtype=np.int64)
        return StepFound(releases, [], (none, none), [])
    physical = np.empty(count, dtype=np.int64)
    status = kernels.step_allocation(
        state.fwd, state.refs, state.store_pins, state.load_pins, logical, physical
    )
    flushes: list[list[int]] = []
    again = bool(event.resumed) and _releases_between(event, tables, released)
    if status == 1 and not again:
        status, flushes = _after_releases(state, event, releases, logical, physical)
    if status == 0:
        allocations = _allocations(event, tables, released) if again else None
        return _found((releases, allocations, (logical, physical), flushes))
    allocations = _allocations(event, tables, released)
    if status == 2:
        _refuse_range(allocations, config.num_gpu_blocks)
    return StepFound(releases, _scan(state, allocations, released), None, [])


def _releases_between(event: Step, tables: Any, released: set[str]) -> bool:
    """Whether a resumed request of the step still holds a table and is given blocks: it is
    released just before them, between the step's allocations. (A resumed request without
    a table, such as every new request a runner passes whole, changes nothing.)"""
    holding = [r for r in event.resumed if r in tables and r not in released]
    if not holding:
        return False
    if isinstance(event, StepPacked):
        given = {r for r, n in zip(event.req_ids, packed_counts(event), strict=True) if n}
        return any(r in given for r in holding)
    return any(event.allocated.get(r) for r in holding)


def _after_releases(
    state: State, event: Step, releases: list[str], logical: Any, physical: Any
) -> tuple[int, list[list[int]]]:
    """``kernels.step_allocation``'s verdict taken as the step's events take its blocks
    (``kernels.step_allocation_after``; 0: the step commits in bulk), with the blocks each
    allocation must flush first (``StepFound.flushes``). The step's releases drop their
    tables first, a block may be shared under prefix caching (with a live table, or
    between two of the step's requests), and a freed block an unfinished store still
    reads is taken once its allocation's stores are flushed. So a step that hands a
    finished or preempted request's blocks straight to another (a full pool's usual
    step), that shares cached prefix blocks, or that reuses blocks being stored, stays in
    bulk. Not for a step that releases a resumed request between its allocations
    (``_releases_between``)."""
    slots = state.running.slots
    rows = np.fromiter(map(slots.__getitem__, releases), np.int64, len(releases))
    if isinstance(event, StepPacked):
        counts = np.asarray(packed_counts(event), dtype=np.int64)
    else:
        counts = np.fromiter(map(len, event.allocated.values()), np.int64, len(event.allocated))
    arena, config = state.running.arena, state.config
    assert config is not None, "reduce() dispatches only configured states here"
    flush_at = np.empty(len(logical), dtype=np.int64)
    status, num_flushes = kernels.step_allocation_after(
        state.fwd, state.refs, state.store_pins, state.load_pins, logical, physical,
        arena.ids, arena.starts, arena.lengths, rows, counts, config.prefix_caching, flush_at,
    )  # fmt: skip
    if status or not num_flushes:
        return int(status), []
    at = flush_at[:num_flushes]
    owner = np.searchsorted(np.cumsum(counts), at, side="right")  # each one's allocation
    cuts = np.flatnonzero(np.diff(owner)) + 1
    return 0, [part.tolist() for part in np.split(physical[at], cuts)]


def _logical(
    event: StepScheduled, tables: Any, released: set[str], count: int, size: int
) -> np.ndarray:
    """All of the step's ``count`` allocated ids, concatenated, as int64."""
    lists = list(event.allocated.values())
    ids = int_lists(lists, count)  # msgspec's pass over the ints, read back compiled
    if ids is not None:
        return ids
    try:  # an id beyond int64 (refused below), or an int msgpack does not carry
        return np.fromiter(itertools.chain.from_iterable(lists), np.int64, count)
    except OverflowError:  # an int beyond int64
        _refuse_range(_allocations(event, tables, released), size)


def _allocations(
    event: Step, tables: Any, released: set[str]
) -> list[tuple[str, list[int], bool, list[int] | None, bool]]:
    """Per non-empty allocation in order: its request, ids, and whether the request is
    released just before it (resumed while holding a table)."""
    resumed = event.resumed
    again_released = set(released)  # grows in the step's order, for the resumed rule only
    return [
        (
            req_id,
            block_ids,
            bool(resumed) and _resumed_again(req_id, resumed, tables, again_released),
            None,
            True,
        )
        for req_id, block_ids in event.allocated.items()
        if block_ids
    ]


def _resumed_again(req_id: str, resumed: list[str], tables: Any, released: set[str]) -> bool:
    """A resumed request that still holds a table is released just before its blocks."""
    if req_id in resumed and req_id in tables and req_id not in released:
        released.add(req_id)
        return True
    return False


def _refuse_range(allocations: list[Any], size: int) -> NoReturn:
    """``BlockOutOfRange`` naming the first id of the step outside ``[0, size)``."""
    for req_id, block_ids, *_ in allocations:
        bad = next((b for b in block_ids if not 0 <= b < size), None)
        if bad is not None:
            raise BlockOutOfRange(
                f"allocated[{req_id!r}] holds block id {bad}, outside [0, {size})",
                _sub_event(req_id, block_ids),
            )
    raise AssertionError("_refuse_range found no id out of range: check_step bug")


def _scan(
    state: State, allocations: list[Any], released: set[str]
) -> list[tuple[str, list[int], bool, list[int] | None, bool]]:
    """Each allocation checked where it stands (``_Scan``), with its physical ids."""
    assert state.config is not None, "reduce() dispatches only configured states here"
    scan = _Scan(state, state.config.prefix_caching, set(released))
    out: list[tuple[str, list[int], bool, list[int] | None, bool]] = []
    for req_id, block_ids, again, _, _ in allocations:
        if again:  # released just before its own blocks, after the earlier allocations
            scan.release(req_id)
        physical, free = scan.allocate(req_id, block_ids)
        out.append((req_id, block_ids, again, physical, free))
    return out


def _sub_event(req_id: str, block_ids: list[int]) -> BlocksAllocated:
    return BlocksAllocated(req_id=req_id, block_ids=block_ids)


class _Scan:
    """The check's view: the state plus what the step has released and taken so far."""

    def __init__(self, state: State, prefix_caching: bool, released: set[str]) -> None:
        self.state = state
        self.prefix_caching = prefix_caching
        self.released = released  # the step's releases so far
        self.taken: dict[int, int] = {}  # physical -> references the step added
        self._dropped: dict[int, int] | None = None

    def release(self, req_id: str) -> None:
        """``req_id``'s table is released here, between two allocations."""
        self.released.add(req_id)
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
        if len(set(block_ids)) != len(block_ids):
            seen: set[int] = set()
            dup = next(b for b in block_ids if b in seen or seen.add(b))  # type: ignore[func-returns-value]
            raise DuplicateBlock(
                f"allocated[{req_id!r}] holds block id {dup} twice", _sub_event(req_id, block_ids)
            )
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


def apply_step(state: State, event: Step, found: StepFound) -> list[Plan]:
    """The step's releases, allocations and defrag decision, in order; their plans."""
    state.counted_pairs = 0
    if found.bulk is None:
        return _apply_scanned(state, event, found)
    walked, num_pairs = _commit_bulk(state, event, found)
    plans = _flushed(state, found.flushes) if found.flushes else []
    if walked:
        return plans + defrag.end_step_moved(state, event.step, num_pairs)
    return plans + defrag.end_step_at(state, event.step)


def _flushed(state: State, flushes: list[list[int]]) -> list[Plan]:
    """The flushes of a step committed in bulk, allocation by allocation in order (what
    each one's ``BlocksAllocated`` plans): they change only the jobs, which the step's
    commit and defrag move do not read."""
    plans: list[Plan] = []
    for reused in flushes:
        plans += transfers.flush(state, reused)
    return plans


def apply_step_counted(state: State, event: Step, found: StepFound) -> list[Plan]:
    """``apply_step`` for a machine that executes nothing and only counts its defrag
    moves (a replay's tallied lanes, ``Machine.counted_swaps``): the same state change and
    decision, but a step whose one compiled commit walked and moved returns no
    ``SwapPlan``: its pairs stay in ``state.pair_sources`` / ``pair_destinations`` and
    their number in ``state.counted_pairs`` (listing and freeing 512 pairs as tuples is
    a fifth of a heavy step). Any other step returns ``apply_step``'s plans (count 0)."""
    state.counted_pairs = 0
    if found.bulk is None:
        return _apply_scanned(state, event, found)
    if found.flushes:  # its plans are more than its swaps
        return apply_step(state, event, found)
    walked, num_pairs = _commit_bulk(state, event, found)
    if walked:
        state.step, state.counted_pairs = event.step, num_pairs
        state.lift_quarantine()
        return []
    return defrag.end_step_at(state, event.step)


def _commit_bulk(state: State, event: Step, found: StepFound) -> tuple[bool, int]:
    """A step the check took in bulk (``check_step``), in one compiled commit
    (``State.commit_step``): whether it also took the defrag decision and moved, and the
    pairs it moved (possibly none; in the state's pair scratch)."""
    assert found.bulk is not None, "only a step checked in bulk commits in bulk"
    if found.allocations is None:  # no release between allocations: the step's lists
        releases = found.releases
        req_ids, counts = _requests_and_counts(event)
    else:
        releases = found.releases + [a[0] for a in found.allocations if a[2]]
        req_ids = [a[0] for a in found.allocations]
        counts = [len(a[1]) for a in found.allocations]
    walk = defrag.walks_in_step(state)
    freed, num_pairs = state.commit_step(releases, req_ids, counts, found.bulk, walk)
    if len(freed):
        defrag.quarantine_freed(state, freed)
    return walk, num_pairs


def _requests_and_counts(event: Step) -> tuple[list[str], list[int]]:
    """The step's requests given blocks, in order, and how many each."""
    if type(event) is StepPacked:
        req_ids, counts = event.req_ids, packed_counts(event)
    else:
        req_ids, counts = list(event.allocated), list(map(len, event.allocated.values()))
    if 0 in counts:
        req_ids = [r for r, n in zip(req_ids, counts, strict=True) if n]
        counts = [n for n in counts if n]
    return req_ids, counts


def _apply_scanned(state: State, event: Step, found: StepFound) -> list[Plan]:
    """A step ``check_step`` scanned allocation by allocation: its events' reducers."""
    for req_id in found.releases:
        defrag.release_request(state, req_id)
    plans: list[Plan] = []
    assert found.allocations is not None, "check_step lists the allocations it scans"
    for req_id, block_ids, again, found_ids, free in found.allocations:
        if again:
            defrag.release_request(state, req_id)
        assert found_ids is not None, "check_step scans every allocation it does not bulk"
        flushed = defrag.allocate_blocks(state, req_id, block_ids, found_ids, free)
        if flushed:
            plans += flushed
    plans += defrag.end_step_at(state, event.step)
    return plans


PACKED_LIMIT = 1 << 22
"""The most block ids a step the log records packed holds (a larger one, far past any
real step, is recorded as it came: the log's size refusal stays that of the step)."""


def log_form(event: Event, found: Any, pool: int = 0) -> Event:
    """What the log records for ``event``, checked with ``found``: a ``StepScheduled`` the
    check took in bulk as its ``StepPacked`` (the ids from the check's array: no second
    pass over them), anything else as it is. Both replay to the same state, plans and
    digest. ``pool``: the checked state's ``num_gpu_blocks`` (0: unknown), which bounds a
    checked step's ids (``packed_step``)."""
    if type(event) is StepScheduled and found.bulk is not None:
        logical = found.bulk[0]
        if logical.size <= PACKED_LIMIT:
            return packed_step(event, logical, pool=pool or 1 << 31)  # checked: in the pool
    return event


def held_by_receiver(state: State, allocated: dict[str, list[int]], released: set[str]) -> bool:
    """Whether some request is given a block (in range: check the step first) that its own
    table, not released by the step, already holds: under prefix caching the step is
    valid, but the runner's call then hides a preemption (see the Gaudi facade's books).
    Only a block with references can be held: O(blocks given to live requests)."""
    tables = state.tables
    fwd, refs = state.fwd_buffer, state.refs_buffer
    for req_id, block_ids in allocated.items():
        table = tables.get(req_id)
        if table is None or req_id in released:
            continue
        for b in block_ids:
            if refs[fwd[b]] and b in table:
                return True
    return False


def expand(state: State, event: Step) -> list[Event]:
    """The fine-grained events ``event`` stands for when applied to ``state`` (the last is
    its ``StepEnded``): what the differential tests compare it with, and what the facade
    applies when a step it prepared must be split."""
    tables = state.tables
    out: list[Event] = []
    released: set[str] = set()
    for kind, req_ids in ((RequestFinished, event.finished), (RequestPreempted, event.preempted)):
        for req_id in req_ids:
            out.append(kind(req_id=req_id))
            released.add(req_id)
    for req_id, block_ids in event.allocated.items():
        if not block_ids:
            continue
        if req_id in event.resumed and req_id in tables and req_id not in released:
            out.append(RequestPreempted(req_id=req_id))
            released.add(req_id)
        out.append(BlocksAllocated(req_id=req_id, block_ids=block_ids))
    out.append(StepEnded(step=event.step))
    return out

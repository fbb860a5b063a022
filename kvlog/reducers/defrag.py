"""Request tables and online defragmentation: the seed ``OnlineDefragmenter``, incrementally.

Bookkeeping (kept whether or not ``defrag`` is on):

- ``BlocksAllocated`` appends logical ids to the request's table (a new table for a request
  without one, e.g. after preemption) and adds one reference to each resolved physical
  block. An empty list is a no-op. With prefix caching a block may be shared (its count goes
  up; the seed's ``use_block``); without it a block with refs > 0 is refused.
- ``RequestFinished`` / ``RequestPreempted`` drop the table and one reference per entry; a
  request without blocks is a no-op.

The defrag decision at ``StepEnded`` (only when ``defrag``; else no plan ever, and ``resolve``
stays the identity):

That is the default ``policy="seed"``; other named policies (``policies.py``) change the
trigger, the first destination and the cap, never the rest.

1. Trigger, exactly as the seed, over ALL blocks with refs > 0, pinned or not: fire when
   ``max_used - threshold > num_used``.
2. Sources: blocks with refs > 0, from the highest down, skipping pinned ones.
3. Destinations: blocks with refs == 0, from block 1 up (block 0 is never a destination),
   skipping pinned ones.
4. Pair source i with destination i; stop before ``max_swaps`` pairs would be exceeded, when
   either sequence ends, or when the next destination is above the next source.

A block is pinned while an unfinished transfer reads or writes it (see ``transfers.py``),
including a block whose request finished while its store is in flight (refs 0, pinned: not
a destination). With no pins this is exactly the seed; with pins a triggered step may find
no pair, and then yields no plan. The plan is ``SwapPlan(step, pairs, padded_to, mode)``
with ``padded_to`` the smallest pad size >= len(pairs) (else the largest) and ``mode``
``"swap"`` under prefix caching (free blocks may hold cached data) else ``"move"``. Each
pair then swaps the two blocks' ref counts and the mappings of both original logical ids
(the seed's ``swap_refs`` and ``update_mapping``).

Cost, none of it proportional to the pool: an event costs O(its blocks) (a Python-int loop
over ``array.array`` buffers for up to ``SCALAR_LIMIT`` ids, a compiled loop beyond); the
trigger is O(1) (``num_used`` and ``max_used`` are kept incrementally; ``max_used`` is
searched again only when its block is freed or moved, downward through the summary bitmap);
pairing is one compiled loop (``kernels.py``) that walks the ``used`` bitmap from both ends a
word at a time, skipping 4096-block runs through the summaries, and costs O(pairs) plus the
words it passes; the move is one compiled loop over the pairs.
"""

from __future__ import annotations

import bisect

import numpy as np

from kvlog.errors import AlreadyConfigured, BlockInUse, InvalidEvent
from kvlog.events import (
    BlocksAllocated,
    BlocksReleased,
    CacheConfigured,
    Plan,
    RequestFinished,
    RequestPreempted,
    StepEnded,
    SwapPlan,
    swap_mode,
)
from kvlog.reducers import kernels, policies, transfers
from kvlog.reducers.blockset import SCALAR_LIMIT, IdArray
from kvlog.reducers.ranges import check_block_range
from kvlog.reducers.state import State

__all__ = [
    "Allocation",
    "allocate_blocks",
    "apply_allocate",
    "apply_configure",
    "apply_release_blocks",
    "check_allocate",
    "check_block_range",
    "check_configure",
    "end_step",
    "end_step_at",
    "end_step_moved",
    "pad_bucket",
    "release",
    "quarantine_freed",
    "release_request",
    "walks_in_step",
]


def check_configure(state: State, event: CacheConfigured) -> None:
    """A second CacheConfigured is refused."""
    if state.config is not None:
        raise AlreadyConfigured("the cache is already configured", event)


def apply_configure(state: State, event: CacheConfigured, checked: None) -> list[Plan]:
    """Take the geometry and policy."""
    state.configure(event)
    return []


Allocation = tuple["IdArray | list[int]", bool]
"""What ``check_allocate`` found: the physical ids, and whether it found all of them free
and unpinned (then the apply takes them: no flush, no reuse check; False is always safe)."""


def check_allocate(state: State, event: BlocksAllocated) -> Allocation:
    """Refuse a bad allocation; return the physical ids it references (a list when small)
    and whether it found them all free and unpinned.

    Refused: a block an unfinished load writes (always), a block a live request holds
    (without prefix caching). A block an unfinished store reads is accepted: the apply
    flushes the store first (see ``transfers.flush``)."""
    config = state.config
    assert config is not None, "reduce() dispatches only configured states here"
    block_ids = event.block_ids
    if len(block_ids) <= SCALAR_LIMIT:  # a decode step's block, or a few
        if block_ids and max(block_ids) >= config.num_gpu_blocks:
            check_block_range(event, "block_ids", block_ids, config.num_gpu_blocks)
        found = _small_allocation(state, block_ids, config.prefix_caching)
        if found is not None:
            return found
    logical = check_block_range(event, "block_ids", block_ids, config.num_gpu_blocks)
    physical = np.empty(logical.size, dtype=np.int64)
    status = kernels.allocation(
        state.fwd, state.refs, state.store_pins, state.load_pins, logical,
        config.prefix_caching, physical,
    )  # fmt: skip
    if status == _REFUSED:
        _refuse_allocation(state, event, logical, physical)
    return physical, status == _FREE


_FREE, _REFUSED = 0, 2
"""``kernels.allocation``'s verdicts: all free and unpinned; refused."""


def _small_allocation(
    state: State, block_ids: list[int], prefix_caching: bool
) -> Allocation | None:
    """``check_allocate`` for a few in-range ids when nothing refuses them (plain loops:
    the decode step's path, with ``kernels.allocation``'s verdicts); None when something
    might (the compiled check decides and names it)."""
    fwd, refs = state.fwd_buffer, state.refs_buffer
    loads, stores = state.load_pins_buffer, state.store_pins_buffer
    physical = [fwd[b] for b in block_ids]
    free = True
    for p in physical:
        if loads[p] or (refs[p] and not prefix_caching):
            return None
        if refs[p] or stores[p]:
            free = False
    return physical, free


def apply_allocate(state: State, event: BlocksAllocated, checked: Allocation) -> list[Plan]:
    """Append blocks to a request's table and reference their physical blocks."""
    if not event.block_ids:
        return []
    physical, free = checked
    return allocate_blocks(state, event.req_id, event.block_ids, physical, free)


def allocate_blocks(
    state: State,
    req_id: str,
    block_ids: list[int],
    physical: IdArray | list[int],
    free: bool,
) -> list[Plan]:
    """Append checked, non-empty ``block_ids`` to ``req_id``'s table and reference their
    ``physical`` blocks (``free``: the check found them all unreferenced and unpinned). A
    free block that an unfinished store still reads is being reused, and will be written:
    flush those stores first (a shared, live block is only read)."""
    state.extend_table(req_id, block_ids)
    if free:
        state.take_free(physical)
        return []
    if isinstance(physical, list):
        refs, stores = state.refs_buffer, state.store_pins_buffer
        reused = [p for p in physical if stores[p] and not refs[p]]
    else:
        reused = physical[(state.store_pins[physical] > 0) & (state.refs[physical] == 0)].tolist()
    state.add_refs(physical)
    return transfers.flush(state, reused) if reused else []


def _refuse_allocation(
    state: State, event: BlocksAllocated, logical: IdArray, physical: IdArray
) -> None:
    """Raise the refusal of an allocation ``kernels.allocation`` refused: a block an
    unfinished load writes, or (without prefix caching) a block in use. (The kernel stops
    at the first refused block: ``physical`` is resolved again here, whole.)"""
    physical = state.fwd[logical].astype(np.int64)
    written = np.flatnonzero(state.load_pins[physical] > 0)
    if written.size:
        p = int(physical[written[0]])
        job = next((j for j, s in state.load_jobs.items() if p in s.gpu_block_ids), -1)
        raise BlockInUse(
            f"block {int(logical[written[0]])} (physical {p}) is still being written by "
            f"unfinished load job {job}",
            event,
        )
    taken = np.flatnonzero(state.refs[physical] > 0)
    assert taken.size, "kernels.allocation refused an allocation that nothing refuses"
    assert state.config is not None and not state.config.prefix_caching, (
        "kernels.allocation refused a shared block under prefix caching"
    )
    b = int(logical[taken[0]])
    owner = next((r for r, t in sorted(state.tables.items()) if b in t), "?")
    raise BlockInUse(
        f"block {b} (physical {int(physical[taken[0]])}) is held by live request "
        f"{owner!r} and prefix caching is off",
        event,
    )


def release(state: State, event: RequestFinished | RequestPreempted) -> list[Plan]:
    """Drop a request's table (``release_request``)."""
    release_request(state, event.req_id)
    return []


def release_request(state: State, req_id: str) -> None:
    """Drop a request's table; its blocks lose one reference each (and, with
    ``quarantine_released``, those it freed are no destination at the next StepEnded).
    A request without a table is a no-op."""
    freed = state.release_table(req_id)
    if freed is not None and len(freed):
        quarantine_freed(state, freed)


def check_release_blocks(state: State, event: BlocksReleased) -> list[int]:
    """The physical ids of the released blocks; every one must be in the request's table."""
    table = state.tables.get(event.req_id)
    held = set(table) if table is not None else set()
    missing = [b for b in event.block_ids if b not in held]
    if missing:
        raise InvalidEvent(
            f"request {event.req_id!r} does not hold block {missing[0]}: it cannot release it",
            event,
        )
    fwd = state.fwd_buffer
    return [fwd[b] for b in event.block_ids]


def apply_release_blocks(state: State, event: BlocksReleased, physical: list[int]) -> list[Plan]:
    """Drop some blocks of a request's table (one reference each); the rest stay in order."""
    if not physical:
        return []
    gone = set(event.block_ids)  # one copy each: under prefix caching a table may repeat one
    kept = []
    for b in state.tables[event.req_id]:
        if b in gone:
            gone.discard(b)
        else:
            kept.append(b)
    state.replace_table(event.req_id, kept)
    quarantine_freed(state, state.drop_refs(physical))
    return []


def quarantine_freed(state: State, freed: IdArray | list[int]) -> None:
    """With ``quarantine_released``, blocks freed now are no destination until StepEnded."""
    assert state.config is not None, "reduce() dispatches only configured states here"
    if state.config.quarantine_released and len(freed):
        state.quarantine(freed if isinstance(freed, list) else freed.tolist())


def end_step(state: State, event: StepEnded) -> list[Plan]:
    """Record the step and take the defrag decision (``end_step_at``)."""
    return end_step_at(state, event.step)


def end_step_at(state: State, step: int) -> list[Plan]:
    """Record step ``step`` and take the defrag decision."""
    config = state.config
    assert config is not None, "reduce() dispatches only configured states here"
    state.step = step
    if not config.defrag:
        state.lift_quarantine()
        return []
    sources, destinations = policies.walk(state)
    state.lift_quarantine()
    if not len(sources):
        return []
    state.move_blocks(sources, destinations)
    pairs = list(zip(sources.tolist(), destinations.tolist(), strict=True))
    padded_to = pad_bucket(len(pairs), config.pad_sizes)
    return [SwapPlan(step=step, pairs=pairs, padded_to=padded_to, mode=swap_mode(config))]


def walks_in_step(state: State) -> bool:
    """Whether a step's one compiled commit takes the defrag decision as well
    (``State.commit_step``): under the seed rule without a byte cap. With
    ``quarantine_released`` the commit pins the blocks its releases free before it walks
    (those freed earlier are pinned already), and ``end_step_moved`` lifts the quarantine
    after the move, where ``end_step_at`` lifts it between its walk and its move: the
    same, as a move reads no pins and touches no quarantined block (free and pinned, it is
    neither a source nor a destination)."""
    config = state.config
    assert config is not None, "reduce() dispatches only configured states here"
    return config.defrag and config.policy == "seed" and not config.max_bytes_per_step


def end_step_moved(state: State, step: int, num_pairs: int) -> list[Plan]:
    """``end_step_at`` once ``State.commit_step`` has walked and moved ``num_pairs`` pairs
    (in the state's pair scratch): record the step, lift the quarantine, the plan of the
    pairs."""
    state.step = step
    state.lift_quarantine()
    if not num_pairs:
        return []
    config = state.config
    assert config is not None, "reduce() dispatches only configured states here"
    sources = state.pair_sources[:num_pairs].tolist()
    pairs = list(zip(sources, state.pair_destinations[:num_pairs].tolist(), strict=True))
    padded_to = pad_bucket(num_pairs, config.pad_sizes)
    return [SwapPlan(step=step, pairs=pairs, padded_to=padded_to, mode=swap_mode(config))]


def pad_bucket(num_pairs: int, pad_sizes: tuple[int, ...]) -> int:
    """Smallest pad size >= num_pairs, else the largest (the seed's ``to_swap_pad``)."""
    index = bisect.bisect_left(pad_sizes, num_pairs)  # pad sizes ascend (validated)
    return pad_sizes[index] if index < len(pad_sizes) else pad_sizes[-1]

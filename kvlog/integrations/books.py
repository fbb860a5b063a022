"""What the runner's ``update_state`` does not say, inferred only where it is provable.

vllm-gaudi's runner calls ``update_state(new | cached, finished_req_ids)``: no preempted
requests, and a resumed request's whole new table looks like any running request's newly
appended blocks. vLLM frees a preempted request's blocks at once and may hand them to other
requests, or back to the request itself, as new blocks or in its resumed table. One fact
is provable: a block the scheduler gives away is free, so whoever kvlog thinks holds it was
preempted after the allocation (the *batch*) that brought it, and every block that request
received up to and including that batch is free too. Later batches may be a resumed table
that the runner's call made look like an append: they stay. The holder is the receiving
request itself (a table never repeats a block, prefix caching or not), or, without prefix
caching, any other request (with it, sharing a block is legal and proves nothing).

A block the runner never says was freed stays counted, which is safe: an over-counted block
is never a defrag destination. The caller may pass ``preempted`` and ``resumed`` (vLLM's V2
runner output has ``preempted_req_ids``, the V1 output ``resumed_req_ids``): a resumed
request's list is then its whole new table.

``RequestBooks.plan`` checks everything first and returns the steps (events, and claims
of blocks that loads hold) in order; ``commit`` keeps the books once they ran. Its cost is
O(blocks named in the call), never O(pool).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvlog.errors import BlockInUse, BlockOutOfRange, DuplicateBlock
from kvlog.events import (
    BlocksAllocated,
    BlocksReleased,
    Event,
    RequestFinished,
    RequestPreempted,
    StepScheduled,
    validate_event,
)
from kvlog.reducers.view import BooksView

__all__ = ["Claim", "RequestBooks", "Step", "fold"]


@dataclass(frozen=True)
class Claim:
    """A request is about to be given these blocks: release the load holds on them."""

    block_ids: list[int]


Step = Event | Claim


Batches = list[list[int]]
"""One request's blocks as the runner gave them, one list per allocation, in order (a table
never repeats a block)."""


def fold(plan: list[Step], step: int) -> StepScheduled | None:
    """``plan`` (from :meth:`RequestBooks.plan`) as one ``StepScheduled`` numbered ``step``,
    its claims left to the caller; None where no step states it: a partial release
    (``BlocksReleased``), a request released after blocks the plan gives it, or given
    blocks twice. Releases move before the allocations: a release only frees blocks, so
    every allocation the plan checked stays valid and the step leaves the plan's state."""
    finished: list[str] = []
    preempted: list[str] = []
    allocated: dict[str, list[int]] = {}
    for item in plan:
        if isinstance(item, Claim):
            continue
        if isinstance(item, BlocksAllocated):
            if item.req_id in allocated:
                return None
            allocated[item.req_id] = item.block_ids
        elif isinstance(item, (RequestFinished, RequestPreempted)):
            if item.req_id in allocated:
                return None
            released = finished if isinstance(item, RequestFinished) else preempted
            released.append(item.req_id)
        else:
            return None
    return StepScheduled(step=step, allocated=allocated, finished=finished, preempted=preempted)


class RequestBooks:
    """The facade's per-request batches. Keeping them costs O(1) per request per step (the
    batch lists are kept as given); the block owners an inference needs (without prefix
    caching) are looked up from them only then."""

    def __init__(self) -> None:
        self._tables: dict[str, Batches] = {}
        self._pending: list[tuple[str, str, list[int]]] = []

    def plan(
        self,
        view: BooksView,
        new_blocks: dict[str, list[int]],
        finished: list[str],
        preempted: list[str],
        resumed: set[str],
    ) -> list[Step]:
        """The steps for one call, checked; raises (changing nothing) on bad input."""
        assert view.config is not None, "the session starts the Engine configured"
        planner = _Planner(self, view, view.config.prefix_caching)
        for req_id in finished:
            planner.release(RequestFinished(req_id=req_id))
        for req_id in preempted:
            planner.release(RequestPreempted(req_id=req_id))
        for req_id, block_ids in new_blocks.items():
            if block_ids:
                planner.allocate(req_id, block_ids, req_id in resumed)
        planner.check()
        self._pending = planner.changes
        return planner.steps

    def record_step(
        self, new_blocks: dict[str, list[int]], released: set[str], prefix_caching: bool
    ) -> None:
        """Keep the books of a step that needed no inference and ran: ``released`` lost
        their tables, then every request with new blocks gained a batch (the list itself:
        the caller hands over lists nobody changes later)."""
        tables = self._tables
        for req_id in released:
            tables.pop(req_id, None)
        for req_id, block_ids in new_blocks.items():
            if block_ids:
                batches = tables.get(req_id)
                if batches is None:
                    tables[req_id] = [block_ids]
                else:
                    batches.append(block_ids)

    def holds(self, req_id: str, block_id: int) -> bool:
        """Whether the runner gave ``block_id`` to ``req_id`` (as far as the books know)."""
        batches = self._tables.get(req_id)
        return batches is not None and any(block_id in batch for batch in batches)

    def evict(self, view: BooksView, block_ids: list[int]) -> list[Step]:
        """The releases that giving ``block_ids`` to another request's load proves (without
        prefix caching: their holders were preempted); ``commit`` once they ran."""
        assert view.config is not None, "the session starts the Engine configured"
        planner = _Planner(self, view, view.config.prefix_caching)
        if not planner.prefix_caching:
            planner._evict_stale_owners("", block_ids)
        planner.check()
        self._pending = planner.changes
        return planner.steps

    def commit(self) -> None:
        """Keep the books of the last ``plan`` (its steps ran)."""
        for kind, req_id, block_ids in self._pending:
            if kind == "drop":
                self._tables.pop(req_id, None)
            else:
                self._tables.setdefault(req_id, []).append(block_ids)
        self._pending = []


class _Planner:
    """One call's plan over a read-only view of the books plus this call's changes."""

    def __init__(self, books: RequestBooks, view: BooksView, prefix_caching: bool) -> None:
        self.books = books
        self.view = view
        self.prefix_caching = prefix_caching
        self.steps: list[Step] = []
        self.changes: list[tuple[str, str, list[int]]] = []
        self.dropped: set[str] = set()
        self.added: dict[str, list[list[int]]] = {}
        self.taken: dict[int, str] = {}
        self.given: dict[int, str] = {}  # blocks the runner gave in this call, to whom
        self._owners: dict[int, str] | None = None

    # -- the view -------------------------------------------------------------------------
    def _old(self, req_id: str) -> Batches | None:
        return None if req_id in self.dropped else self.books._tables.get(req_id)

    def _batches(self, req_id: str) -> list[list[int]]:
        """The request's batches now: its old ones (unless released) and this call's."""
        old = self._old(req_id)
        return (old if old is not None else []) + self.added.get(req_id, [])

    def _batch_of(self, req_id: str, block_id: int) -> int | None:
        """Which of ``_batches(req_id)`` holds the block (None: none of them)."""
        for i, batch in enumerate(self._batches(req_id)):
            if block_id in batch:
                return i
        return None

    def _owner(self, block_id: int) -> str | None:
        """The request holding ``block_id`` now (without prefix caching, at most one):
        this call's allocations first, then the books' tables not released in this call.
        The map of the books' blocks is built once per call that needs it: O(live blocks),
        paid only by a step that infers a preemption."""
        owner = self.taken.get(block_id)
        if owner is not None:
            return owner
        if self._owners is None:
            self._owners = {
                b: req_id
                for req_id, batches in self.books._tables.items()
                for batch in batches
                for b in batch
            }
        owner = self._owners.get(block_id)
        return owner if owner is not None and self._old(owner) is not None else None

    # -- the changes ----------------------------------------------------------------------
    def release(self, event: RequestFinished | RequestPreempted) -> None:
        self.steps.append(event)
        self._drop(event.req_id)

    def _drop(self, req_id: str) -> None:
        for batch in self.added.pop(req_id, []):
            for b in batch:
                self.taken.pop(b, None)
        self.dropped.add(req_id)
        self.changes.append(("drop", req_id, []))

    def allocate(self, req_id: str, block_ids: list[int], resumed: bool) -> None:
        if len(set(block_ids)) != len(block_ids):
            event = BlocksAllocated(req_id=req_id, block_ids=block_ids)
            raise DuplicateBlock(f"request {req_id!r} is given a block twice", event)
        known = self._old(req_id) is not None or req_id in self.added
        if known and resumed:
            self.release(RequestPreempted(req_id=req_id))
        self._evict_stale_owners(req_id, block_ids)
        self.steps.append(Claim(block_ids))
        self._add(req_id, block_ids)
        self.given.update(dict.fromkeys(block_ids, req_id))

    def _add(self, req_id: str, block_ids: list[int]) -> None:
        """One batch for ``req_id`` (after a release, a fresh table: ``dropped`` keeps
        hiding the old one from the view)."""
        self.steps.append(BlocksAllocated(req_id=req_id, block_ids=block_ids))
        self.added.setdefault(req_id, []).append(block_ids)
        self.taken.update(dict.fromkeys(block_ids, req_id))
        self.changes.append(("add", req_id, block_ids))

    def _keep(self, req_id: str, block_ids: list[int]) -> None:
        """A batch that stays with ``req_id`` after a partial release (no event)."""
        self.added.setdefault(req_id, []).append(block_ids)
        self.taken.update(dict.fromkeys(block_ids, req_id))
        self.changes.append(("add", req_id, block_ids))

    def _evict_stale_owners(self, req_id: str, block_ids: list[int]) -> None:
        """A block being given away was freed, so its holder (``req_id`` itself, or without
        prefix caching any request) was preempted after the batch that brought it: release
        the holder's batches up to the last such one, and give it back the later ones."""
        cut: dict[str, int] = {}
        for b in block_ids:
            other = self.given.get(b)
            if other is not None and other != req_id and not self.prefix_caching:
                event = BlocksAllocated(req_id=req_id, block_ids=block_ids)
                raise BlockInUse(f"block {b} is given to {other!r} and {req_id!r} at once", event)
            index = self._batch_of(req_id, b)
            owner = req_id
            if index is None and not self.prefix_caching:
                found = self._owner(b)
                if found is not None:
                    owner, index = found, self._batch_of(found, b)
            if index is not None:
                cut[owner] = max(cut.get(owner, -1), index)
        for owner, index in sorted(cut.items()):
            batches = self._batches(owner)
            if index + 1 == len(batches):
                self.release(RequestPreempted(req_id=owner))
                continue
            freed = [b for batch in batches[: index + 1] for b in batch]
            self.steps.append(BlocksReleased(req_id=owner, block_ids=freed))
            self._drop(owner)  # the books keep the later batches, one by one
            for batch in batches[index + 1 :]:
                self._keep(owner, batch)

    # -- the check ------------------------------------------------------------------------
    def check(self) -> None:
        """Every event valid on its own, every block in range and not being loaded into."""
        size = self.view.num_gpu_blocks
        for step in self.steps:
            if isinstance(step, Claim):
                continue
            validate_event(step)
            if isinstance(step, BlocksAllocated):
                self._check_blocks(step, size)

    def _check_blocks(self, event: BlocksAllocated, size: int) -> None:
        ids = np.asarray(event.block_ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= size):
            bad = next(b for b in event.block_ids if not 0 <= b < size)
            raise BlockOutOfRange(f"block_ids holds block id {bad}, outside [0, {size})", event)
        loading = self.view.being_loaded(ids)
        if loading.size:
            b = event.block_ids[int(loading[0])]
            raise BlockInUse(f"block {b} is still being written by an unfinished load", event)

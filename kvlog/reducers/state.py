"""The whole bookkeeping state of one engine, and the primitives that keep it consistent.

Per-block state lives in numpy arrays sized ``num_gpu_blocks`` (physical space unless said):

- ``refs`` (int32): how many live request tables hold the block.
- ``fwd`` / ``bwd`` (int32): logical -> physical and physical -> logical; inverse
  permutations, the identity until defrag moves something.
- ``store_pins`` / ``load_pins`` (int32): how many unfinished stores read the block and how
  many unfinished loads write it. ``pinned`` is the uint64 bitmap of ``store + load > 0``.
- ``used``: the :class:`BlockSet` of blocks with ``refs > 0``; ``max_used`` is kept with it.

Each array is a numpy view of an ``array.array`` (``refs_buffer``, ``fwd_buffer``, ...; see
``buffers.py``): per-block loops index the buffer with Python ints, vectorized code and the
compiled loops (``kernels.py``) the view; they share memory, so either may write. Assign
into them (``refs[:] = ...``), never rebind the attributes.

Everything else is per request (``tables``: logical block ids) or per job (``store_jobs``,
``load_jobs``: in submit order). The reducers change the arrays only through the primitives
here, so the bitmaps never disagree with the counts; each costs O(blocks it is given).
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping

import numpy as np
import numpy.typing as npt

from kvlog.events import CacheConfigured, SwapPlan
from kvlog.reducers import kernels, running
from kvlog.reducers.blockset import SCALAR_LIMIT, BlockSet, IdArray, clear_bits, set_bits
from kvlog.reducers.buffers import Int32Array, int32_buffer, uint64_buffer
from kvlog.reducers.jobs import Job
from kvlog.reducers.ranges import check_id_dtype

__all__ = ["MAX_JOBS_IN_FLIGHT", "State", "initial_state"]

MAX_JOBS_IN_FLIGHT = 1 << 16
"""Bound on unfinished transfer jobs (stores and loads together)."""


class State:
    """The engine state: configuration, per-block arrays, request tables and jobs.

    Mutable; the reducers change it in place after validating an event. Read it through the
    query methods (``resolve``, ``request_blocks``, ...), which are the module contract.
    """

    def __init__(self) -> None:
        self.config: CacheConfigured | None = None
        self.step = -1
        self.last_job_id = -1
        self.running = running.RunningDigest()
        """The running digest's sums (``running.py``), told of every change below; its
        rows hold the request tables (``arena.py``)."""
        self.tables: Mapping[str, list[int]] = running.Tables(self.running)
        """Per live request, its logical block ids (a read-only view: a new list at each
        lookup). Changed only through the primitives below."""
        self.store_jobs: dict[int, Job] = {}
        self.load_jobs: dict[int, Job] = {}
        self.quarantined: set[int] = set()
        """Physical blocks released since the last StepEnded, pinned until it (only with
        ``config.quarantine_released``)."""
        self.last_swap: SwapPlan | None = None
        """The SwapPlan of the last accepted event if that was a StepEnded that moved
        blocks, else None (for ``check_invariants``; not part of the digest)."""
        self.num_moves = 0
        """Defrag moves applied to this State object (not part of the digest or snapshot):
        a cache of the mapping, such as the Gaudi facade's lookup list, is current while
        this has not changed."""
        self.counted_pairs = 0
        """The pairs the last ``StepScheduled`` moved without listing them in a plan (a
        counted machine's, ``step.apply_step_counted``, which leaves ``last_swap`` None;
        0 after any other step's apply); like ``num_moves``, not part of the digest or
        snapshot."""
        self._allocate_arrays(0)
        self.pair_sources = self.pair_destinations = np.zeros(0, dtype=np.int64)

    def _allocate_arrays(self, num_gpu_blocks: int) -> None:
        identity = np.arange(num_gpu_blocks, dtype=np.int32)
        zeros = np.zeros(num_gpu_blocks, dtype=np.int32)
        self.refs_buffer, self.refs = int32_buffer(zeros)
        self.fwd_buffer, self.fwd = int32_buffer(identity)
        self.bwd_buffer, self.bwd = int32_buffer(identity)
        self.store_pins_buffer, self.store_pins = int32_buffer(zeros)
        self.load_pins_buffer, self.load_pins = int32_buffer(zeros)
        self.used = BlockSet(num_gpu_blocks)
        self.pinned_buffer, self.pinned = uint64_buffer(self.used.words.size)
        self._max_used = -1

    def configure(self, config: CacheConfigured) -> None:
        """Take the geometry (called once, by the CacheConfigured reducer)."""
        self.config = config
        self._allocate_arrays(config.num_gpu_blocks)
        self.pair_sources = np.zeros(config.max_swaps, dtype=np.int64)
        self.pair_destinations = np.zeros(config.max_swaps, dtype=np.int64)
        """Scratch for the defrag walk's pairs (at most ``max_swaps``: preallocated)."""
        kernels.load()

    def adopt_policy(self, config: CacheConfigured) -> None:
        """Run on under ``config``'s policy from here: a what-if that starts at a snapshot
        (a log directory whose oldest segments retention removed). Only policy fields may
        differ from the configuration the state has; the pair scratch follows
        ``max_swaps``."""
        assert self.config is not None, "adopt_policy() on a configured state only"
        geometry = ("num_gpu_blocks", "block_size", "num_cpu_blocks", "block_size_factor")
        assert all(getattr(config, f) == getattr(self.config, f) for f in geometry), (
            "adopt_policy() changes the geometry: a what-if may override policy fields only"
        )
        self.config = config
        self.pair_sources = np.zeros(config.max_swaps, dtype=np.int64)
        self.pair_destinations = np.zeros(config.max_swaps, dtype=np.int64)

    # -- queries (module contract) -----------------------------------------------------
    @property
    def num_gpu_blocks(self) -> int:
        """Pool size (0 before CacheConfigured)."""
        return int(self.refs.size)

    @property
    def num_used(self) -> int:
        """Physical blocks with ref count > 0."""
        return self.used.count

    @property
    def max_used(self) -> int:
        """Highest physical block with ref count > 0, or -1."""
        return self._max_used

    def resolve(self, block_id: int) -> int:
        """Logical -> physical; ids outside the pool (pad entries) are returned unchanged."""
        if 0 <= block_id < len(self.fwd_buffer):
            return self.fwd_buffer[block_id]
        return block_id

    def unresolve(self, physical: int) -> int:
        """Physical -> logical; ids outside the pool are returned unchanged."""
        if 0 <= physical < len(self.bwd_buffer):
            return self.bwd_buffer[physical]
        return physical

    def resolve_array(self, block_ids: npt.NDArray[np.integer]) -> npt.NDArray[np.integer]:
        """Vectorized ``resolve``: a new array of the same shape and dtype. ``InvalidEvent``
        for ids that are not integers or whose dtype cannot hold every id of the pool."""
        ids = np.asarray(block_ids)
        check_id_dtype(ids.dtype, self.refs.size)
        inside = (ids >= 0) & (ids < self.refs.size)
        if inside.all():
            return self.fwd[ids].astype(ids.dtype, copy=False)
        out = ids.copy()
        out[inside] = self.fwd[ids[inside]]
        return out

    def request_blocks(self, req_id: str) -> list[int]:
        """Logical block table of a live request ([] if it has none)."""
        return list(self.tables.get(req_id, ()))

    def live_requests(self) -> list[str]:
        """Requests that hold blocks, sorted."""
        return sorted(self.tables)

    def jobs_in_flight(self) -> list[int]:
        """Unfinished job ids in submit order (job ids are strictly increasing)."""
        return sorted([*self.store_jobs, *self.load_jobs])

    def job(self, job_id: int) -> Job | None:
        """The unfinished job ``job_id``, or None."""
        return self.store_jobs.get(job_id) or self.load_jobs.get(job_id)

    def is_pinned(self, physical: int) -> bool:
        """Whether an unfinished transfer reads or writes this physical block."""
        if not 0 <= physical < len(self.refs_buffer):
            return False
        return bool(self.store_pins_buffer[physical] or self.load_pins_buffer[physical])

    # -- primitives (keep arrays, bitmaps, max_used and the running digest consistent) ----
    def extend_table(self, req_id: str, block_ids: list[int]) -> None:
        """Append logical ids to a request's table (a new table if it has none)."""
        digest = self.running
        slot = digest.slots.get(req_id)
        if slot is None:
            slot = digest.add_request(req_id)
        arena = digest.arena
        length = arena.lengths_buffer[slot]
        if len(block_ids) == 1 and length < arena.capacities_buffer[slot]:  # a decode step's
            arena.ids_buffer[arena.starts_buffer[slot] + length] = block_ids[0]  # growth
            arena.lengths_buffer[slot] = length + 1
            digest.table_extended(slot, length, block_ids)
            return
        arena.append(slot, block_ids)
        if len(block_ids) > SCALAR_LIMIT:  # hashed from the arena: no list conversion
            digest.table_extended(slot, length, arena.ids_of(slot)[length:])
        else:
            digest.table_extended(slot, length, block_ids)

    def load_tables(self, tables: dict[str, list[int]]) -> None:
        """Tables for a state restored without any (a snapshot's, in its order); the
        caller reseats the running digest afterwards (``checkpoint.reseat``)."""
        digest = self.running
        assert not digest.slots, "load_tables() on a state without tables only"
        for req_id, block_ids in tables.items():  # an empty one stays, for the check to refuse
            digest.arena.append(digest.add_request(req_id), block_ids)  # sums: reseat's

    def commit_step(
        self,
        releases: list[str],
        req_ids: list[str],
        counts: list[int],
        ids: tuple[IdArray, IdArray],
        walk: bool,
    ) -> tuple[IdArray, int]:
        """A checked step's bookkeeping in one compiled call: ``releases`` (distinct, each
        holding a table) drop their tables, then each of ``req_ids`` (distinct, released
        ones getting a fresh table) gets its ``counts`` (each at least 1) of ``ids``
        appended; ``ids``: all of those ids, concatenated, logical and physical, whose physical
        blocks the check found takeable in bulk (``step.check_step``: free and given once, or,
        under prefix caching, shared; none an unfinished load writes or a flush must free
        first). The running digest follows.
        ``walk``: the same call then takes the seed rule's defrag decision and moves (only
        where ``defrag.walks_in_step``); the pairs are the first of ``pair_sources`` /
        ``pair_destinations``. Returns the blocks the releases freed and the number of
        pairs moved. The per-request work is a dict lookup or two each (C-level ``map``
        passes where it can), the new requests' rows added in one call
        (``RunningDigest.add_requests``); the ids go into the tables' arena in the kernel."""
        digest = self.running
        slots, arena = digest.slots, digest.arena
        rows: list[int] = list(map(slots.pop, releases))
        num_released = len(rows)
        num_dropped = sum(map(arena.lengths_buffer.__getitem__, rows))
        new = [req_id for req_id in req_ids if req_id not in slots]
        if new:  # new tables (new, or released by this step)
            digest.add_requests(new)
        rows += map(slots.__getitem__, req_ids)
        rows += counts
        row_array = np.frombuffer(array("q", rows), dtype=np.int64)  # (cheaper than np.array)
        freed = np.empty(num_dropped, dtype=np.int64)
        config, used = self.config, self.used
        assert config is not None, "a step commits to a configured state only"
        while True:
            need, top, garbage, num_freed, self._max_used, change, num_pairs, delta, fresh = (
                kernels.step_commit(
                    used.words, used.nonempty, used.notfull, self.pinned, self.refs, self.fwd,
                    self.bwd, arena.ids, arena.starts, arena.lengths, arena.capacities,
                    arena.top, ids[1], ids[0], row_array, num_released, digest.keys,
                    digest.sums, freed, self.pair_sources, self.pair_destinations,
                    self._max_used, used.count, config.threshold,
                    config.max_swaps if walk else 0, config.quarantine_released,
                )
            )  # fmt: skip
            if not need:
                break
            arena.reserve(need)  # nothing changed yet: again, with room for the step
        arena.top = top
        arena.garbage += garbage
        used.count += fresh - num_freed
        digest.tables_changed(int(change))
        if num_released:
            digest.release_slots(rows[:num_released])
        if num_pairs:
            self.num_moves += 1
            digest.mapping_moved(int(delta))
        return freed[:num_freed], num_pairs

    def pop_table(self, req_id: str) -> list[int] | None:
        """Remove and return a request's table (None if it has none)."""
        slot = self.running.slots.get(req_id)
        if slot is None:
            return None
        table = self.running.arena.table(slot)
        self.running.table_removed(req_id)
        return table

    def release_table(self, req_id: str) -> IdArray | list[int] | None:
        """Remove a request's table and drop one reference per id (``drop_logical``); the
        blocks this freed, or None if it has no table."""
        digest = self.running
        slot = digest.slots.get(req_id)
        if slot is None:
            return None
        arena = digest.arena
        if arena.lengths_buffer[slot] <= SCALAR_LIMIT:
            freed = self.drop_logical(arena.table(slot))
        else:
            freed = self.drop_logical(arena.ids_of(slot))
        digest.table_removed(req_id)
        return freed

    def replace_table(self, req_id: str, block_ids: list[int]) -> None:
        """A request's table becomes ``block_ids`` (removed when empty)."""
        self.pop_table(req_id)
        if block_ids:
            self.extend_table(req_id, block_ids)

    def add_job(self, job: Job) -> None:
        """A new unfinished job."""
        (self.store_jobs if job.kind == "store" else self.load_jobs)[job.job_id] = job
        self.running.job_added(job)

    def mark_submitted(self, job: Job) -> None:
        """The job's plan is handed to the executor."""
        if not job.submitted:
            job.submitted = True
            self.running.job_submitted(job.job_id)

    def remove_job(self, job: Job) -> None:
        """A job finished."""
        del (self.store_jobs if job.kind == "store" else self.load_jobs)[job.job_id]
        self.running.job_removed(job)

    def take_free(self, physical: IdArray | list[int]) -> None:
        """``add_refs`` for distinct blocks the caller has checked are unreferenced."""
        if not isinstance(physical, list):
            self.add_refs(physical)
            return
        refs = self.refs_buffer
        if len(physical) == 1:  # the decode step's usual allocation
            top = physical[0]
            refs[top] = 1
            self.used.set_word_bits(top >> 6, 1 << (top & 63))
        else:
            for p in physical:
                refs[p] = 1
            self.used.add_ids(physical)
            top = max(physical)
        if top > self._max_used:
            self._max_used = top

    def add_refs(self, physical: IdArray | list[int]) -> None:
        """One more reference to each of ``physical`` (distinct ids): a Python loop over a
        short list, ``kernels.add_refs`` over an array."""
        if not isinstance(physical, list):
            used = self.used
            fresh, top = kernels.add_refs(
                used.words, used.nonempty, used.notfull, self.refs, physical
            )
            used.count += fresh
            self._max_used = max(self._max_used, int(top))
            return
        refs, fresh_ids = self.refs_buffer, []
        for p in physical:
            count = refs[p] + 1
            refs[p] = count
            if count == 1:
                fresh_ids.append(p)
        if fresh_ids:
            self.used.add_ids(fresh_ids)
            self._max_used = max(self._max_used, *fresh_ids)

    def drop_refs(self, physical: list[int]) -> list[int]:
        """One reference fewer to each of ``physical`` (repeats drop one each); the blocks
        this freed."""
        refs = self.refs_buffer
        if self.config is not None and not self.config.prefix_caching:
            for p in physical:  # no sharing: every count is 1 and no table repeats a block
                refs[p] = 0
            freed = physical
        else:
            freed = []
            for p in physical:
                count = refs[p] - 1
                refs[p] = count
                if not count:
                    freed.append(p)
        if freed:
            self.used.remove_ids(freed)
            self._refresh_max_used()
        return freed

    def drop_logical(self, block_ids: list[int] | Int32Array) -> IdArray | list[int]:
        """``drop_refs`` of the physical blocks of logical ``block_ids`` (a table: a list,
        or an int32 array): a Python loop over a short list, ``kernels.drop_refs`` for
        more. The blocks this freed."""
        if isinstance(block_ids, list) and len(block_ids) <= SCALAR_LIMIT:
            fwd = self.fwd_buffer
            return self.drop_refs([fwd[b] for b in block_ids])
        used, count = self.used, len(block_ids)
        freed = np.empty(count, dtype=np.int64)
        logical = (
            np.fromiter(block_ids, np.int64, count) if isinstance(block_ids, list) else block_ids
        )
        count = kernels.drop_refs(
            used.words, used.nonempty, used.notfull, self.refs, self.fwd, logical, freed
        )
        used.count -= count
        if count:
            self._refresh_max_used()
        return freed[:count]

    def move_blocks(self, sources: IdArray, destinations: IdArray) -> None:
        """Defrag: each source's refs go to its (free) destination; both mappings, the used
        bitmap and the running digest follow (``kernels.move``: one compiled loop)."""
        used = self.used
        self.num_moves += 1
        delta, self._max_used = kernels.move(
            used.words, used.nonempty, used.notfull, self.refs, self.fwd, self.bwd,
            sources, destinations, self._max_used,
        )  # fmt: skip
        self.running.mapping_moved(int(delta))

    def _refresh_max_used(self) -> None:
        if self._max_used >= 0 and not self.used.contains(self._max_used):
            self._max_used = self.used.highest_at_most(self._max_used)

    def pin(self, kind: str, physical: IdArray) -> None:
        """Pin distinct ``physical`` blocks (int64) for one more unfinished job of ``kind``
        (one compiled loop: numpy's per-call cost would be most of a job's few blocks)."""
        kernels.pin(self.store_pins if kind == "store" else self.load_pins, self.pinned, physical)

    def unpin(self, kind: str, physical: IdArray) -> None:
        """Release one job's pins on distinct ``physical`` blocks (int64); a block no job
        pins any more is unpinned unless quarantined."""
        pins, others = (
            (self.store_pins, self.load_pins)
            if kind == "store"
            else (self.load_pins, self.store_pins)
        )
        kernels.unpin(pins, others, self.pinned, physical)
        quarantined = self.quarantined
        if quarantined:  # pinned until the step ends, whatever the jobs: set again
            kept = [p for p in physical.tolist() if p in quarantined]
            if kept:
                set_bits(self.pinned, np.asarray(kept, dtype=np.int64))

    def quarantine(self, physical: list[int]) -> None:
        """Pin freshly released blocks until the next StepEnded (``lift_quarantine``)."""
        fresh = [p for p in physical if p not in self.quarantined]
        if fresh:
            self.quarantined.update(fresh)
            set_bits(self.pinned, np.asarray(fresh, dtype=np.int64))

    def lift_quarantine(self) -> None:
        """Unpin the quarantined blocks that no transfer pins."""
        if not self.quarantined:
            return
        ids = np.fromiter(self.quarantined, np.int64, len(self.quarantined))
        self.quarantined.clear()
        free = ids[(self.store_pins[ids] | self.load_pins[ids]) == 0]
        if free.size:
            clear_bits(self.pinned, free)


def initial_state() -> State:
    """An unconfigured state: only ``CacheConfigured`` is accepted."""
    return State()

"""The whole bookkeeping state of one engine, and the primitives that keep it consistent.

Per-block state lives in numpy arrays sized ``num_gpu_blocks`` (physical space unless said):

- ``refs`` (int32): how many live request tables hold the block.
- ``fwd`` / ``bwd`` (int32): logical -> physical and physical -> logical; inverse
  permutations, the identity until defrag moves something.
- ``store_pins`` / ``load_pins`` (int32): how many unfinished stores read the block and how
  many unfinished loads write it. ``pinned`` is the uint64 bitmap of ``store + load > 0``.
- ``used``: the :class:`BlockSet` of blocks with ``refs > 0``; ``max_used`` is kept with it.

Everything else is per request (``tables``: logical block ids) or per job (``store_jobs``,
``load_jobs``: in submit order). The reducers change the arrays only through the primitives
here, so the bitmaps never disagree with the counts; each costs O(blocks it is given).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvlog.events import CacheConfigured, SwapPlan
from kvlog.reducers.blockset import (
    SCALAR_LIMIT,
    BlockSet,
    IdArray,
    WordArray,
    clear_bits,
    set_bits,
)

__all__ = ["MAX_JOBS_IN_FLIGHT", "Job", "State", "initial_state"]

MAX_JOBS_IN_FLIGHT = 1 << 16
"""Bound on unfinished transfer jobs (stores and loads together)."""

Int32Array = npt.NDArray[np.int32]


class Job:
    """One unfinished transfer: the physical GPU blocks it pins and the CPU blocks it uses."""

    __slots__ = ("cpu_block_ids", "gpu_block_ids", "job_id", "kind")

    def __init__(self, job_id: int, kind: str, gpu_block_ids: IdArray, cpu_block_ids: IdArray):
        self.job_id = job_id
        self.kind = kind
        self.gpu_block_ids = gpu_block_ids
        self.cpu_block_ids = cpu_block_ids


def _empty_i32(size: int) -> Int32Array:
    return np.zeros(size, dtype=np.int32)


class State:
    """The engine state: configuration, per-block arrays, request tables and jobs.

    Mutable; the reducers change it in place after validating an event. Read it through the
    query methods (``resolve``, ``request_blocks``, ...), which are the module contract.
    """

    def __init__(self) -> None:
        self.config: CacheConfigured | None = None
        self.step = -1
        self.last_job_id = -1
        self.tables: dict[str, list[int]] = {}
        self.store_jobs: dict[int, Job] = {}
        self.load_jobs: dict[int, Job] = {}
        self.last_swap: SwapPlan | None = None
        """The SwapPlan of the last accepted event if that was a StepEnded that moved
        blocks, else None (for ``check_invariants``; not part of the digest)."""
        self._allocate_arrays(0)

    def _allocate_arrays(self, num_gpu_blocks: int) -> None:
        identity = np.arange(num_gpu_blocks, dtype=np.int32)
        self.refs: Int32Array = _empty_i32(num_gpu_blocks)
        self.fwd: Int32Array = identity
        self.bwd: Int32Array = identity.copy()
        self.store_pins: Int32Array = _empty_i32(num_gpu_blocks)
        self.load_pins: Int32Array = _empty_i32(num_gpu_blocks)
        self.used = BlockSet(num_gpu_blocks)
        self.pinned: WordArray = np.zeros(self.used.words.size, dtype=np.uint64)
        self._max_used = -1

    def configure(self, config: CacheConfigured) -> None:
        """Take the geometry (called once, by the CacheConfigured reducer)."""
        self.config = config
        self._allocate_arrays(config.num_gpu_blocks)

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
        if 0 <= block_id < self.refs.size:
            return int(self.fwd[block_id])
        return block_id

    def unresolve(self, physical: int) -> int:
        """Physical -> logical; ids outside the pool are returned unchanged."""
        if 0 <= physical < self.refs.size:
            return int(self.bwd[physical])
        return physical

    def resolve_array(self, block_ids: npt.NDArray[np.integer]) -> npt.NDArray[np.integer]:
        """Vectorized ``resolve``: a new array of the same shape and dtype."""
        ids = np.asarray(block_ids)
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
        if not 0 <= physical < self.refs.size:
            return False
        return bool(self.store_pins[physical] or self.load_pins[physical])

    # -- primitives (keep arrays, bitmaps and max_used consistent) ------------------------
    def add_refs(self, physical: IdArray | list[int]) -> None:
        """One more reference to each of ``physical`` (distinct ids)."""
        if isinstance(physical, list) or physical.size <= SCALAR_LIMIT:
            refs, fresh = self.refs, []
            for p in physical if isinstance(physical, list) else physical.tolist():
                count = int(refs[p]) + 1
                refs[p] = count
                if count == 1:
                    self.used._add_one(p)
                    fresh.append(p)
            if fresh:
                self._max_used = max(self._max_used, *fresh)
            return
        self.refs[physical] += 1
        fresh = physical[self.refs[physical] == 1]
        if fresh.size:
            self.used.add(fresh)
            self._max_used = max(self._max_used, int(fresh.max()))

    def drop_refs(self, physical: IdArray) -> None:
        """One reference fewer to each of ``physical`` (repeats drop one each)."""
        if physical.size <= SCALAR_LIMIT:
            refs = self.refs
            for p in physical.tolist():
                count = int(refs[p]) - 1
                refs[p] = count
                if count == 0:
                    self.used._remove_one(p)
            self._refresh_max_used()
            return
        np.subtract.at(self.refs, physical, 1)
        freed = physical[self.refs[physical] == 0]
        if freed.size:
            if freed.size > 1:  # a table may repeat a block under prefix caching
                freed = np.sort(freed)
                freed = freed[np.concatenate(([True], freed[1:] != freed[:-1]))]
            self.used.remove(freed)
            self._refresh_max_used()

    def move_refs(self, sources: IdArray, destinations: IdArray) -> None:
        """Defrag: each source's refs go to its (free) destination; mappings follow."""
        self.refs[destinations] = self.refs[sources]
        self.refs[sources] = 0
        self.used.remove(sources)
        self.used.add(destinations)
        logical_sources = self.bwd[sources]
        logical_destinations = self.bwd[destinations]
        self.fwd[logical_sources] = destinations
        self.fwd[logical_destinations] = sources
        self.bwd[destinations] = logical_sources
        self.bwd[sources] = logical_destinations
        self._refresh_max_used()

    def _refresh_max_used(self) -> None:
        if self._max_used >= 0 and not self.used.contains(self._max_used):
            self._max_used = self.used.highest_at_most(self._max_used)

    def pin(self, kind: str, physical: IdArray) -> None:
        """Pin distinct ``physical`` blocks for one more unfinished job of ``kind``."""
        pins = self.store_pins if kind == "store" else self.load_pins
        pins[physical] += 1
        set_bits(self.pinned, physical)

    def unpin(self, kind: str, physical: IdArray) -> None:
        """Release one job's pins on distinct ``physical`` blocks."""
        pins = self.store_pins if kind == "store" else self.load_pins
        pins[physical] -= 1
        released = physical[(self.store_pins[physical] | self.load_pins[physical]) == 0]
        if released.size:
            clear_bits(self.pinned, released)


def initial_state() -> State:
    """An unconfigured state: only ``CacheConfigured`` is accepted."""
    return State()

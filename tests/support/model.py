"""A plain model of kvlog's bookkeeping, written for clarity, not speed.

Dicts, lists and ``sorted()``; no bitmaps, no incremental tricks. Reference counts and pins
are derived from the request tables and the jobs on every call, so the model cannot drift the
way an incremental implementation can. The stateful tests run it beside the real reducers and
compare every plan, every resolved table and every rejection.

Semantics (DESIGN.md, the seed's ``OnlineDefragmenter`` and ``transfer_async``, vLLM 0.33's
chunk rule, plus kvlog's pinning rules):

- Defrag at ``StepEnded``: used = physical blocks with refs > 0; fire when
  ``max_used - threshold > num_used``; sources = used blocks descending, skipping pinned ones;
  destinations = free blocks (refs 0) from 1 ascending, skipping pinned ones; pair until
  ``max_swaps`` pairs or the next destination exceeds the next source. "Pinned": read or
  written by an unfinished job (submitted or not), or, with ``quarantine_released``, freed by
  a ``RequestFinished``/``RequestPreempted`` since the last ``StepEnded`` (the quarantine is
  lifted after the decision).
- Transfers resolve logical GPU ids when requested and pin the physical blocks until
  ``TransferFinished``. GPU block ``k`` of a job pairs with CPU sub-block ``subs[k]`` (see
  :func:`cpu_sub_blocks`). A ``deferred`` job plans nothing yet; ``TransferSubmitted`` plans
  it (a job already submitted: nothing); it cannot finish before. ``after_job_id`` is the
  highest job id of the other submitted, unfinished jobs of the same direction.
- Refused with ``BlockInUse``: allocating a block an unfinished load writes (always) or a
  block with refs > 0 (without prefix caching); a load into a block another unfinished load
  writes; a store writing a CPU sub-block an unfinished load reads; a load reading a CPU
  sub-block an unfinished store writes. A store and a load may share a GPU block (vLLM
  stores a chunk a sync load just filled, and loads into a block whose flushed store has
  not run): wherever a job's ``TransferPlan`` is handed out, it comes after a ``FencePlan``
  naming the submitted, unfinished jobs of the other direction that touch its GPU blocks
  (in job order), so the two run in the order they were submitted.
- ``BlocksReleased`` (7f766bd; where the schema has it) drops the listed blocks from a request's
  table, one reference each; a block the request does not hold is ``InvalidEvent``.
- Allocating a free (refs 0) block that unfinished stores read plans the TransferPlans of
  the unsubmitted ones among the stores reading any such block (in job order), then a
  ``FencePlan`` naming every store reading any such block (in job order).
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field

from kvlog.events import (
    BlocksAllocated,
    CacheConfigured,
    Event,
    FencePlan,
    LoadRequested,
    Plan,
    RequestFinished,
    RequestPreempted,
    StepEnded,
    StoreRequested,
    SwapPlan,
    TransferFinished,
    TransferPlan,
    TransferSubmitted,
)

__all__ = ["ModelJob", "ModelRejected", "PlainModel", "cpu_sub_blocks", "is_deferred"]

MAX_JOBS_IN_FLIGHT = 1 << 16
MAX_REQ_ID_LENGTH = 4096
MAX_BLOCKS = 2**31 - 1


class ModelRejected(Exception):
    """The model refuses an event; ``kinds`` names the error classes that are acceptable."""

    def __init__(self, *kinds: str) -> None:
        super().__init__(", ".join(kinds))
        self.kinds = set(kinds)


def is_deferred(event: StoreRequested | LoadRequested) -> bool:
    """Whether a transfer is declared now and submitted later (``deferred`` may be missing
    on ``LoadRequested`` in schema versions that only defer stores)."""
    return bool(getattr(event, "deferred", False))


def cpu_sub_blocks(event: StoreRequested | LoadRequested, factor: int) -> list[int]:
    """The CPU sub-block each GPU block of ``event`` pairs with, in GPU order; raises
    ``ModelRejected("TransferSizeMismatch")`` when the counts do not fit.

    A CPU block ``c`` is the sub-blocks ``c * f .. c * f + f - 1``. With ``group_sizes``
    (vLLM 0.33): each group of ``n > 0`` GPU blocks whose first block index is ``i`` starts
    ``skip = i % f`` sub-blocks into the next unused CPU block and uses ``ceil((n + skip) /
    f)`` CPU blocks; every CPU block must be used. Without: the seed's rule, a store fills
    whole CPU blocks, a load skips the first ``(-num_gpu) % f`` sub-blocks of its first one.
    """
    f = factor
    cpu = list(event.cpu_block_ids)
    num_gpu = len(event.gpu_block_ids)
    if event.group_sizes:
        needed = 0
        for n, i in zip(event.group_sizes, event.block_indices, strict=True):
            if n:
                needed += (n + i % f + f - 1) // f
        if needed != len(cpu):
            raise ModelRejected("TransferSizeMismatch")
        subs: list[int] = []
        used = 0
        for n, i in zip(event.group_sizes, event.block_indices, strict=True):
            if not n:
                continue
            skip = i % f
            count = (n + skip + f - 1) // f
            expanded = [c * f + k for c in cpu[used : used + count] for k in range(f)]
            subs.extend(expanded[skip : skip + n])
            used += count
        return subs
    expanded = [c * f + k for c in cpu for k in range(f)]
    if isinstance(event, StoreRequested):
        if len(expanded) != num_gpu:
            raise ModelRejected("TransferSizeMismatch")
        return expanded
    skip = (-num_gpu) % f
    if len(expanded) - skip != num_gpu:
        raise ModelRejected("TransferSizeMismatch")
    return expanded[skip:]


@dataclass
class ModelJob:
    """An unfinished transfer: the physical GPU blocks it reads or writes, the CPU sub-block
    of each, and whether its plan has been handed out."""

    job_id: int
    kind: str
    gpu_blocks: list[int]
    cpu_subs: list[int] = field(default_factory=list)
    submitted: bool = True

    @property
    def pairs(self) -> list[tuple[int, int]]:
        """``(src, dst)``: GPU -> CPU sub-block for a store, the other way for a load."""
        if self.kind == "store":
            return list(zip(self.gpu_blocks, self.cpu_subs, strict=True))
        return list(zip(self.cpu_subs, self.gpu_blocks, strict=True))


@dataclass
class PlainModel:
    """The whole bookkeeping state as plain Python containers."""

    config: CacheConfigured | None = None
    tables: dict[str, list[int]] = field(default_factory=dict)
    forward: dict[int, int] = field(default_factory=dict)
    backward: dict[int, int] = field(default_factory=dict)
    jobs: dict[int, ModelJob] = field(default_factory=dict)
    quarantined: set[int] = field(default_factory=set)
    last_job_id: int = -1
    step: int = -1

    # -- derived views -------------------------------------------------------------------
    def resolve(self, block_id: int) -> int:
        return self.forward.get(block_id, block_id)

    def unresolve(self, block_id: int) -> int:
        return self.backward.get(block_id, block_id)

    def refs(self) -> Counter[int]:
        return Counter(self.resolve(b) for table in self.tables.values() for b in table)

    def pins(self, kind: str | None = None) -> Counter[int]:
        """Physical GPU block -> how many unfinished jobs (of ``kind``) read or write it."""
        return Counter(
            b for job in self.jobs.values() if kind in (None, job.kind) for b in job.gpu_blocks
        )

    def cpu_subs_in_use(self, kind: str) -> set[int]:
        """CPU sub-blocks that unfinished jobs of ``kind`` write (stores) or read (loads)."""
        return {s for job in self.jobs.values() if job.kind == kind for s in job.cpu_subs}

    def unsubmitted(self) -> list[int]:
        """Deferred jobs whose plan has not been handed out, in job order."""
        return sorted(j for j, job in self.jobs.items() if not job.submitted)

    def resolved_tables(self) -> dict[str, list[int]]:
        return {req_id: [self.resolve(b) for b in t] for req_id, t in sorted(self.tables.items())}

    # -- the transition ------------------------------------------------------------------
    def apply(self, event: Event) -> list[Plan]:
        """Apply one event; raise ``ModelRejected`` (changing nothing) if it is invalid."""
        if isinstance(event, CacheConfigured):
            if self.config is not None:
                raise ModelRejected("AlreadyConfigured")
            self.config = event
            return []
        if self.config is None:
            raise ModelRejected("NotConfigured")
        self._check_fields(event)
        if isinstance(event, BlocksAllocated):
            return self._allocate(event)
        if isinstance(event, (RequestFinished, RequestPreempted)):
            self._release(event.req_id)
        elif isinstance(event, StepEnded):
            self.step = event.step
            plans = self._defragment(event.step)
            self.quarantined.clear()
            return plans
        elif isinstance(event, (StoreRequested, LoadRequested)):
            return self._submit(event)
        elif isinstance(event, TransferSubmitted):
            job = self.jobs.get(event.job_id)
            if job is None:
                raise ModelRejected("UnknownJob")
            return [] if job.submitted else self._plan(job)
        elif isinstance(event, TransferFinished):
            job = self.jobs.get(event.job_id)
            if job is None or not job.submitted:
                raise ModelRejected("UnknownJob")
            del self.jobs[event.job_id]
        elif type(event).__name__ == "BlocksReleased":
            self._release_some(event.req_id, list(event.block_ids))  # type: ignore[union-attr]
        return []

    @staticmethod
    def _check_fields(event: Event) -> None:
        """Field rules that hold for an event on its own (DESIGN.md: ids are non-negative and
        distinct, a request id is a non-empty string, a transfer moves at least one block,
        one group size and one first-block index per KV-cache group)."""
        released = type(event).__name__ == "BlocksReleased"
        if released or isinstance(event, (BlocksAllocated, RequestFinished, RequestPreempted)):
            if not 0 < len(event.req_id) <= MAX_REQ_ID_LENGTH:  # type: ignore[union-attr]
                raise ModelRejected("InvalidEvent")
            if released or isinstance(event, BlocksAllocated):
                if any(b < 0 for b in event.block_ids):
                    raise ModelRejected("BlockOutOfRange")
                if len(set(event.block_ids)) != len(event.block_ids):
                    raise ModelRejected("DuplicateBlock")
        elif isinstance(event, StepEnded) and event.step < 0:
            raise ModelRejected("InvalidEvent")
        elif isinstance(event, (TransferFinished, TransferSubmitted)):
            if event.job_id < 0:
                raise ModelRejected("InvalidEvent")
        elif isinstance(event, (StoreRequested, LoadRequested)):
            for ids in (event.gpu_block_ids, event.cpu_block_ids):
                if any(b < 0 for b in ids):
                    raise ModelRejected("BlockOutOfRange")
                if len(set(ids)) != len(ids):
                    raise ModelRejected("DuplicateBlock")
            if not event.gpu_block_ids or not event.cpu_block_ids:
                raise ModelRejected("InvalidEvent")
            sizes, indices = event.group_sizes, event.block_indices
            if len(sizes) != len(indices):
                raise ModelRejected("InvalidEvent")
            if any(not 0 <= x <= MAX_BLOCKS for x in (*sizes, *indices)):
                raise ModelRejected("InvalidEvent")
            if sizes and sum(sizes) != len(event.gpu_block_ids):
                raise ModelRejected("InvalidEvent")
            if event.job_id < 0:
                raise ModelRejected("InvalidEvent")

    def _check_gpu_range(self, block_ids: list[int]) -> None:
        assert self.config is not None
        if any(not 0 <= b < self.config.num_gpu_blocks for b in block_ids):
            raise ModelRejected("BlockOutOfRange")

    def _allocate(self, event: BlocksAllocated) -> list[Plan]:
        assert self.config is not None
        self._check_gpu_range(event.block_ids)
        refs, loads, stores = self.refs(), self.pins("load"), self.pins("store")
        physical = [self.resolve(b) for b in event.block_ids]
        for p in physical:
            if loads[p] > 0:
                raise ModelRejected("BlockInUse")
            if not self.config.prefix_caching and refs[p] > 0:
                raise ModelRejected("BlockInUse")
        if not event.block_ids:
            return []
        self.tables.setdefault(event.req_id, []).extend(event.block_ids)
        reused = {p for p in physical if refs[p] == 0 and stores[p] > 0}
        if not reused:
            return []
        readers = [
            job
            for _, job in sorted(self.jobs.items())
            if job.kind == "store" and reused & set(job.gpu_blocks)
        ]
        plans = [p for job in readers if not job.submitted for p in self._plan(job)]
        plans.append(FencePlan(job_ids=[job.job_id for job in readers]))
        return plans

    def _release(self, req_id: str) -> None:
        table = self.tables.pop(req_id, None)
        if table is not None:
            self._quarantine(table)

    def _release_some(self, req_id: str, block_ids: list[int]) -> None:
        table = self.tables.get(req_id, [])
        if any(b not in table for b in block_ids):
            raise ModelRejected("InvalidEvent")
        if not block_ids:
            return
        kept = list(table)
        for b in block_ids:
            kept.remove(b)
        if kept:
            self.tables[req_id] = kept
        else:
            del self.tables[req_id]
        self._quarantine(block_ids)

    def _quarantine(self, released: list[int]) -> None:
        """With ``quarantine_released``, the released blocks that are free now wait for the
        next decision."""
        assert self.config is not None
        if self.config.quarantine_released:
            refs = self.refs()
            self.quarantined |= {self.resolve(b) for b in released if refs[self.resolve(b)] == 0}

    def _defragment(self, step: int) -> list[Plan]:
        config = self.config
        assert config is not None
        refs = self.refs()
        used = {b for b, n in refs.items() if n > 0}
        if not config.defrag or not used:
            return []
        if max(used) - config.threshold <= len(used):
            return []
        pinned = {b for b, n in self.pins().items() if n > 0} | self.quarantined
        sources = sorted(used - pinned, reverse=True)
        destinations = (b for b in itertools.count(1) if b not in used and b not in pinned)
        pairs: list[tuple[int, int]] = []
        for src, dst in zip(sources, destinations, strict=False):
            if len(pairs) == config.max_swaps or dst > src:
                break
            pairs.append((src, dst))
        if not pairs:
            return []
        for src, dst in pairs:
            logical_src, logical_dst = self.unresolve(src), self.unresolve(dst)
            self.forward[logical_src], self.backward[dst] = dst, logical_src
            self.forward[logical_dst], self.backward[src] = src, logical_dst
        padded_to = next((p for p in config.pad_sizes if p >= len(pairs)), config.pad_sizes[-1])
        mode = "swap" if config.prefix_caching else "move"
        return [SwapPlan(step=step, pairs=pairs, padded_to=padded_to, mode=mode)]

    def _submit(self, event: StoreRequested | LoadRequested) -> list[Plan]:
        config = self.config
        assert config is not None
        kind = "store" if isinstance(event, StoreRequested) else "load"
        if event.job_id in self.jobs or event.job_id <= self.last_job_id:
            raise ModelRejected("DuplicateJob")
        self._check_gpu_range(event.gpu_block_ids)
        if any(not 0 <= b < config.num_cpu_blocks for b in event.cpu_block_ids):
            raise ModelRejected("BlockOutOfRange")
        subs = cpu_sub_blocks(event, config.block_size_factor)
        gpu = [self.resolve(b) for b in event.gpu_block_ids]
        if kind == "load" and any(self.pins("load")[b] > 0 for b in gpu):
            raise ModelRejected("BlockInUse")
        other = self.cpu_subs_in_use("load" if kind == "store" else "store")
        if other & set(subs):
            raise ModelRejected("BlockInUse")
        if len(self.jobs) >= MAX_JOBS_IN_FLIGHT:
            raise ModelRejected("InvalidEvent")
        job = ModelJob(event.job_id, kind, gpu, subs, submitted=False)
        self.jobs[event.job_id] = job
        self.last_job_id = event.job_id
        return [] if is_deferred(event) else self._plan(job)

    def _plan(self, job: ModelJob) -> list[Plan]:
        """Hand out ``job``'s plan: after the highest other submitted job of its kind, and
        after a fence on the submitted jobs of the other direction that share a block."""
        assert self.config is not None and not job.submitted
        fence: list[Plan] = []
        earlier = [
            j
            for j, other in sorted(self.jobs.items())
            if other.kind != job.kind
            and other.submitted
            and set(other.gpu_blocks) & set(job.gpu_blocks)
        ]
        if earlier:
            fence.append(FencePlan(job_ids=earlier))
        after = max(
            (j.job_id for j in self.jobs.values() if j.kind == job.kind and j.submitted),
            default=-1,
        )
        job.submitted = True
        pairs = job.pairs
        transfer = TransferPlan(
            job_id=job.job_id,
            kind="store" if job.kind == "store" else "load",
            pairs=pairs,
            num_bytes=len(pairs) * self.config.page_size_bytes,
            after_job_id=after,
        )
        return [*fence, transfer]

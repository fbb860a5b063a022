"""A plain model of kvlog's bookkeeping, written for clarity, not speed.

Dicts, lists and ``sorted()``; no bitmaps, no incremental tricks. Reference counts and pins
are derived from the request tables and the jobs on every call, so the model cannot drift the
way an incremental implementation can. The stateful tests run it beside the real reducers and
compare every plan, every resolved table and every rejection.

Semantics (DESIGN.md, the seed's ``OnlineDefragmenter`` and ``transfer_async``, plus kvlog's
pinning rule):

- Defrag at ``StepEnded``: used = physical blocks with refs > 0; fire when
  ``max_used - threshold > num_used``; sources = used blocks descending, skipping pinned ones;
  destinations = free blocks (refs 0) from 1 ascending, skipping pinned ones; pair until
  ``max_swaps`` pairs or the next destination exceeds the next source.
- Transfers resolve logical GPU ids at submit time and pin the physical blocks until
  ``TransferFinished``.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field

from kvlog.events import (
    BlocksAllocated,
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
    TransferPlan,
)

__all__ = ["ModelJob", "ModelRejected", "PlainModel"]

MAX_JOBS_IN_FLIGHT = 1 << 16
MAX_REQ_ID_LENGTH = 4096


class ModelRejected(Exception):
    """The model refuses an event; ``kinds`` names the error classes that are acceptable."""

    def __init__(self, *kinds: str) -> None:
        super().__init__(", ".join(kinds))
        self.kinds = set(kinds)


@dataclass
class ModelJob:
    """An unfinished transfer: what it reads and writes, in physical GPU ids."""

    job_id: int
    kind: str
    gpu_blocks: list[int]


@dataclass
class PlainModel:
    """The whole bookkeeping state as plain Python containers."""

    config: CacheConfigured | None = None
    tables: dict[str, list[int]] = field(default_factory=dict)
    forward: dict[int, int] = field(default_factory=dict)
    backward: dict[int, int] = field(default_factory=dict)
    jobs: dict[int, ModelJob] = field(default_factory=dict)
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
        return Counter(
            b for job in self.jobs.values() if kind in (None, job.kind) for b in job.gpu_blocks
        )

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
            self._allocate(event)
        elif isinstance(event, (RequestFinished, RequestPreempted)):
            self.tables.pop(event.req_id, None)
        elif isinstance(event, StepEnded):
            self.step = event.step
            return self._defragment(event.step)
        elif isinstance(event, (StoreRequested, LoadRequested)):
            return [self._submit(event)]
        elif isinstance(event, TransferFinished):
            if event.job_id not in self.jobs:
                raise ModelRejected("UnknownJob")
            del self.jobs[event.job_id]
        return []

    @staticmethod
    def _check_fields(event: Event) -> None:
        """Field rules that hold for an event on its own (DESIGN.md: ids are non-negative,
        a request id is a non-empty string, a transfer moves at least one block)."""
        if isinstance(event, (BlocksAllocated, RequestFinished, RequestPreempted)):
            if not 0 < len(event.req_id) <= MAX_REQ_ID_LENGTH:
                raise ModelRejected("InvalidEvent")
        elif isinstance(event, StepEnded) and event.step < 0:
            raise ModelRejected("InvalidEvent")
        elif isinstance(event, (StoreRequested, LoadRequested, TransferFinished)):
            if event.job_id < 0:
                raise ModelRejected("InvalidEvent")
            if isinstance(event, TransferFinished):
                return
            ids = [*event.gpu_block_ids, *event.cpu_block_ids]
            if any(b < 0 for b in ids):
                raise ModelRejected("BlockOutOfRange")
            if not event.gpu_block_ids or not event.cpu_block_ids:
                raise ModelRejected("InvalidEvent")

    def _check_gpu_ids(self, block_ids: list[int]) -> None:
        assert self.config is not None
        if len(set(block_ids)) != len(block_ids):
            raise ModelRejected("DuplicateBlock")
        if any(not 0 <= b < self.config.num_gpu_blocks for b in block_ids):
            raise ModelRejected("BlockOutOfRange")

    def _allocate(self, event: BlocksAllocated) -> None:
        assert self.config is not None
        self._check_gpu_ids(event.block_ids)
        if not self.config.prefix_caching:
            refs, store_pins = self.refs(), self.pins("store")
            for b in event.block_ids:
                if refs[self.resolve(b)] > 0 or store_pins[self.resolve(b)] > 0:
                    raise ModelRejected("BlockInUse")
        if event.block_ids:
            self.tables.setdefault(event.req_id, []).extend(event.block_ids)

    def _defragment(self, step: int) -> list[Plan]:
        config = self.config
        assert config is not None
        refs = self.refs()
        used = {b for b, n in refs.items() if n > 0}
        if not config.defrag or not used:
            return []
        if max(used) - config.threshold <= len(used):
            return []
        pinned = {b for b, n in self.pins().items() if n > 0}
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

    def _submit(self, event: StoreRequested | LoadRequested) -> TransferPlan:
        config = self.config
        assert config is not None
        kind = "store" if isinstance(event, StoreRequested) else "load"
        if event.job_id in self.jobs or event.job_id <= self.last_job_id:
            raise ModelRejected("DuplicateJob")
        self._check_gpu_ids(event.gpu_block_ids)
        if len(set(event.cpu_block_ids)) != len(event.cpu_block_ids):
            raise ModelRejected("DuplicateBlock")
        if any(not 0 <= b < config.num_cpu_blocks for b in event.cpu_block_ids):
            raise ModelRejected("BlockOutOfRange")
        pairs = self._expand(kind, event.gpu_block_ids, event.cpu_block_ids)
        gpu = [self.resolve(b) for b in event.gpu_block_ids]
        if kind == "load" and any(self.pins()[b] > 0 for b in gpu):
            raise ModelRejected("BlockInUse")
        if kind == "store" and any(self.pins("load")[b] > 0 for b in gpu):
            raise ModelRejected("BlockInUse")
        if len(self.jobs) >= MAX_JOBS_IN_FLIGHT:
            raise ModelRejected("InvalidEvent")
        after = max((j.job_id for j in self.jobs.values() if j.kind == kind), default=-1)
        self.jobs[event.job_id] = ModelJob(event.job_id, kind, gpu)
        self.last_job_id = event.job_id
        return TransferPlan(
            job_id=event.job_id,
            kind=kind,
            pairs=pairs,
            num_bytes=len(pairs) * config.page_size_bytes,
            after_job_id=after,
        )

    def _expand(self, kind: str, gpu_ids: list[int], cpu_ids: list[int]) -> list[tuple[int, int]]:
        """The seed's sub-block expansion: GPU blocks are 1 sub-block, CPU blocks ``f``."""
        assert self.config is not None
        f = self.config.block_size_factor
        cpu_subs = [c * f + k for c in cpu_ids for k in range(f)]
        gpu = [self.resolve(b) for b in gpu_ids]
        if kind == "store":
            if len(cpu_subs) != len(gpu):
                raise ModelRejected("TransferSizeMismatch")
            return list(zip(gpu, cpu_subs, strict=True))
        skip = (-len(gpu)) % f
        if len(gpu) != len(cpu_subs) - skip:
            raise ModelRejected("TransferSizeMismatch")
        return list(zip(cpu_subs[skip:], gpu, strict=True))

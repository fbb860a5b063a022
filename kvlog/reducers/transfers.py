"""Store (GPU -> CPU) and load (CPU -> GPU) jobs, their sub-block expansion and their pins.

A ``StoreRequested`` / ``LoadRequested`` is checked in this order, and the first failure is
raised: job id (``DuplicateJob``), GPU ids (``BlockOutOfRange``), CPU ids
(``BlockOutOfRange``), sizes (``TransferSizeMismatch``), conflicts (``BlockInUse``), the
in-flight bound (``TooManyJobs``).

- Job ids must be strictly increasing across stores and loads (vLLM uses one counter): this
  rejects a reused or in-flight id with bounded memory. At most ``MAX_JOBS_IN_FLIGHT`` jobs
  are unfinished at once.
- GPU ids are logical and are resolved through the defrag mapping now; the plan and the
  pins use the physical ids, which defrag then never moves.
- Expansion: a GPU block is one sub-block, a CPU block ``f = block_size_factor`` sub-blocks
  ``cpu_block_id * f + k``; GPU block ``i`` of the event pairs with CPU sub-block ``subs[i]``.
  With ``group_sizes`` / ``block_indices`` (vLLM 0.33's ``GPULoadStoreSpec``), group ``g``
  of ``n`` GPU blocks starts ``skip = block_indices[g] % f`` sub-blocks into its first CPU
  block and takes the next ``ceil((n + skip) / f)`` CPU blocks (the last may be partial).
  Without them, the seed's rule: a store fills whole CPU blocks (``num_cpu * f ==
  num_gpu``); a load skips the first ``(-num_gpu) % f`` sub-blocks of its first CPU block.
  ``num_bytes = num_gpu * page_size_bytes``. ``after_job_id`` is the most recent submitted,
  unfinished job of the same direction (-1 if none).
- Conflicts refused with ``BlockInUse``: a load writing a GPU block another unfinished load
  writes; a store writing a CPU sub-block an unfinished load reads; a load reading a CPU
  sub-block an unfinished store writes. A store and a load may share a GPU block (vLLM
  stores a chunk that a sync load just filled; it loads into a block whose flushed store
  has not run yet): a job's plan comes after a ``FencePlan`` on the submitted, unfinished
  jobs of the other direction that touch its blocks, so they run in submission order.
  (Allocating a block an unfinished load writes is refused in ``defrag.check_allocate``.)
  Several stores may read one block: pins are counts.
- A deferred job (``deferred=True``: the scheduler decided it; a store's KV may still be
  being computed) pins at once and plans at ``TransferSubmitted``; a deferred store plans
  earlier, at ``flush``, when the scheduler hands one of its blocks to a new request first.
- ``TransferFinished`` ends the job, success or not, and releases its pins; a job not in
  flight is ``UnknownJob``. A deferred job cannot finish before it is submitted.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from kvlog.errors import (
    BlockInUse,
    DuplicateJob,
    TooManyJobs,
    TransferSizeMismatch,
    UnknownJob,
)
from kvlog.events import (
    FencePlan,
    LoadRequested,
    Plan,
    StoreRequested,
    TransferFinished,
    TransferPlan,
    TransferSubmitted,
)
from kvlog.reducers.blockset import IdArray
from kvlog.reducers.jobs import Job
from kvlog.reducers.ranges import check_block_range
from kvlog.reducers.state import MAX_JOBS_IN_FLIGHT, State

__all__ = [
    "apply_finish",
    "apply_submit",
    "apply_submitted",
    "check_finish",
    "check_submit",
    "check_submitted",
    "cpu_sub_blocks",
    "expand_sub_blocks",
    "flush",
    "seed_sub_blocks",
]

Transfer = StoreRequested | LoadRequested


def expand_sub_blocks(block_ids: IdArray, factor: int, skip: int = 0) -> IdArray:
    """Sub-block ids ``b * factor + k`` of each block, the first ``skip`` of the first block
    left out (the seed's ``expand_block_ids``)."""
    assert 0 <= skip < factor, f"skip {skip} must be below the factor {factor}"
    subs = (block_ids[:, None] * factor + np.arange(factor, dtype=np.int64)).ravel()
    return subs[skip:]


def _mismatch(event: Transfer, factor: int, detail: str) -> TransferSizeMismatch:
    kind = "store" if isinstance(event, StoreRequested) else "load"
    what = (
        f"{kind} of {len(event.gpu_block_ids)} GPU blocks and {len(event.cpu_block_ids)} CPU "
        f"blocks with block_size_factor {factor}"
    )
    return TransferSizeMismatch(f"{what}: {detail}", event)


def seed_sub_blocks(kind: str, num_gpu: int, cpu: IdArray, factor: int) -> IdArray:
    """The seed's rule (no groups): a store fills whole CPU blocks; a load of ``num_gpu``
    GPU blocks skips the first ``(-num_gpu) % factor`` sub-blocks of its first CPU block.
    (Unchecked: ``cpu_sub_blocks`` refuses counts that do not match.)"""
    skip = 0 if kind == "store" else (-num_gpu) % factor
    return expand_sub_blocks(cpu, factor, skip)


def _seed_subs(event: Transfer, cpu: IdArray, factor: int) -> IdArray:
    num_gpu, num_cpu = len(event.gpu_block_ids), len(event.cpu_block_ids)
    store = isinstance(event, StoreRequested)
    subs = seed_sub_blocks("store" if store else "load", num_gpu, cpu, factor)
    if subs.size != num_gpu:
        src_count, dst_count = (num_gpu, num_cpu * factor) if store else (num_cpu * factor, num_gpu)
        skip = num_cpu * factor - subs.size
        raise _mismatch(
            event,
            factor,
            f"{dst_count} destination sub-blocks, but {src_count} source sub-blocks minus "
            f"{skip} skipped = {src_count - skip}",
        )
    return subs


def _group_subs(event: Transfer, cpu: IdArray, factor: int) -> IdArray:
    """vLLM 0.33's rule (``SingleDirectionOffloadingHandler.transfer_async``)."""
    groups = [
        (size, index % factor, -(-(size + index % factor) // factor))
        for size, index in zip(event.group_sizes, event.block_indices, strict=True)
        if size
    ]
    needed = sum(count for _, _, count in groups)
    if needed != cpu.size:
        raise _mismatch(
            event,
            factor,
            f"the groups {list(event.group_sizes)} starting at block indices "
            f"{list(event.block_indices)} need {needed} CPU blocks",
        )
    parts: list[IdArray] = []
    offset = 0
    for size, skip, count in groups:
        parts.append(expand_sub_blocks(cpu[offset : offset + count], factor, skip)[:size])
        offset += count
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def cpu_sub_blocks(event: Transfer, cpu: IdArray, factor: int) -> IdArray:
    """The CPU sub-block of each GPU block of the event, in order (see the module rule)."""
    if factor == 1:  # a CPU block is a GPU block: every rule pairs the ids as they come
        needed = sum(event.group_sizes) if event.group_sizes else len(event.gpu_block_ids)
        if needed == cpu.size:
            return cpu
    if event.group_sizes:
        return _group_subs(event, cpu, factor)
    return _seed_subs(event, cpu, factor)


def _check_job_id(state: State, event: Transfer) -> None:
    job_id = event.job_id
    if job_id <= state.last_job_id:
        where = "is in flight" if state.job(job_id) is not None else "was used before"
        raise DuplicateJob(
            f"job id {job_id} {where}: job ids must be strictly increasing across stores and "
            f"loads (vLLM uses one counter); the last one was {state.last_job_id}",
            event,
        )


def _busy_gpu(state: State, event: Transfer, physical: IdArray) -> None:
    """A load may not write a block another unfinished load writes. A store and a load may
    share a block (vLLM stores a chunk a sync load just filled, and loads into a block whose
    flushed store has not run yet): their plans run in submission order (``_plan``)."""
    if isinstance(event, StoreRequested):
        return
    hit = np.flatnonzero(state.load_pins[physical] > 0)
    if hit.size:
        i = int(hit[0])
        p = int(physical[i])
        owners = sorted(j.job_id for j in state.load_jobs.values() if p in j.gpu_block_ids)
        raise BlockInUse(
            f"load job {event.job_id} writes GPU block {event.gpu_block_ids[i]} (physical {p}) "
            f"but unfinished load jobs {owners} write it too",
            event,
        )


def _busy_cpu(state: State, event: Transfer, subs: IdArray) -> None:
    """A store may not write, and a load may not read, CPU sub-blocks that an unfinished
    job of the other direction reads or writes."""
    store = isinstance(event, StoreRequested)
    others = state.load_jobs if store else state.store_jobs
    for job in others.values():
        assert job.pairs is not None, "every job keeps its pairs"
        theirs = job.pairs[0] if store else job.pairs[1]
        sub = _first_shared(subs, theirs)
        if sub is not None:
            verb = "reads" if store else "writes"
            raise BlockInUse(
                f"{'store' if store else 'load'} job {event.job_id} uses CPU sub-block {sub} "
                f"that unfinished {job.kind} job {job.job_id} {verb}",
                event,
            )


def _first_shared(ids: IdArray, others: IdArray) -> int | None:
    """The first of ``ids`` (in order) that ``others`` holds, or None. Python sets, at any
    size a job has: ``np.isin`` costs 3-5x more from a few ids up to thousands (26-35 us
    against 5-10 for 30-200 ids a side, 103 against 35 for 1,000)."""
    held: set[int] = set(others.tolist())
    listed: list[int] = ids.tolist()
    if held.isdisjoint(listed):
        return None
    return next(i for i in listed if i in held)


def check_submit(state: State, event: Transfer) -> tuple[IdArray, IdArray, IdArray]:
    """Refuse a bad store or load; return (physical GPU ids, their CPU sub-blocks, the CPU
    ids)."""
    config = state.config
    assert config is not None, "reduce() dispatches only configured states here"
    _check_job_id(state, event)
    gpu = check_block_range(event, "gpu_block_ids", event.gpu_block_ids, config.num_gpu_blocks)
    cpu = check_block_range(event, "cpu_block_ids", event.cpu_block_ids, config.num_cpu_blocks)
    subs = cpu_sub_blocks(event, cpu, config.block_size_factor)
    physical = state.fwd[gpu].astype(np.int64)
    _busy_gpu(state, event, physical)
    _busy_cpu(state, event, subs)
    if len(state.store_jobs) + len(state.load_jobs) >= MAX_JOBS_IN_FLIGHT:
        raise TooManyJobs(
            f"{MAX_JOBS_IN_FLIGHT} jobs are already in flight; finish some first", event
        )
    return physical, subs, cpu


def _plan(state: State, job: Job) -> list[Plan]:
    """Mark ``job`` submitted and return its plan, after the last submitted job of its kind;
    first a fence on the submitted, unfinished jobs of the other direction that touch its
    GPU blocks, so that transfers sharing a block run in the order they were submitted."""
    store = job.kind == "store"
    others = state.load_jobs if store else state.store_jobs
    pins = state.load_pins if store else state.store_pins  # the other direction's, per block
    earlier: list[int] = []
    if others and pins[job.gpu_block_ids].any():  # else no job of theirs shares a block
        earlier = [
            j.job_id
            for j in others.values()
            if j.submitted and _first_shared(j.gpu_block_ids, job.gpu_block_ids) is not None
        ]
    plans: list[Plan] = [FencePlan(job_ids=earlier)] if earlier else []
    plans.append(_transfer_plan(state, job))
    return plans


def _transfer_plan(state: State, job: Job) -> TransferPlan:
    config = state.config
    assert config is not None and job.pairs is not None, "a configured state's job"
    jobs = state.store_jobs if job.kind == "store" else state.load_jobs
    after_job_id = next((j.job_id for j in reversed(jobs.values()) if j.submitted), -1)
    state.mark_submitted(job)
    src, dst = job.pairs
    pairs = list(zip(src.tolist(), dst.tolist(), strict=True))
    kind: Literal["store", "load"] = "store" if job.kind == "store" else "load"
    num_bytes = len(pairs) * config.page_size_bytes
    return TransferPlan(job.job_id, kind, pairs, num_bytes, after_job_id)


def apply_submit(
    state: State, event: Transfer, checked: tuple[IdArray, IdArray, IdArray]
) -> list[Plan]:
    """Pin a checked store's or load's GPU blocks and return its TransferPlan (none yet for
    a deferred job)."""
    physical, subs, cpu = checked
    store = isinstance(event, StoreRequested)
    kind = "store" if store else "load"
    pairs = (physical, subs) if store else (subs, physical)
    deferred = event.deferred
    job = Job(event.job_id, kind, physical, cpu, pairs, submitted=False)
    state.add_job(job)
    state.pin(kind, physical)
    state.last_job_id = event.job_id
    return [] if deferred else _plan(state, job)


def check_submitted(state: State, event: TransferSubmitted) -> Job | None:
    """The deferred job to submit, None for one already submitted (a flushed store), or
    ``UnknownJob``."""
    job = state.job(event.job_id)
    if job is None:
        why = "finished already" if event.job_id <= state.last_job_id else "was never submitted"
        raise UnknownJob(f"job {event.job_id} is not in flight (it {why})", event)
    return None if job.submitted else job


def apply_submitted(state: State, event: TransferSubmitted, job: Job | None) -> list[Plan]:
    """Run a deferred job's plan now (nothing for one already submitted)."""
    return [] if job is None else _plan(state, job)


def flush(state: State, physical: IdArray | list[int]) -> list[Plan]:
    """Plans that make it safe to hand ``physical`` (store-pinned) blocks to a new request:
    submit the deferred stores that read them, then fence every store that reads them."""
    wanted = np.asarray(physical, dtype=np.int64)
    readers = [
        j for j in state.store_jobs.values() if _first_shared(j.gpu_block_ids, wanted) is not None
    ]
    plans: list[Plan] = [p for j in readers if not j.submitted for p in _plan(state, j)]
    plans.append(FencePlan(job_ids=[j.job_id for j in readers]))
    return plans


def check_finish(state: State, event: TransferFinished) -> Job:
    """The job to finish, or ``UnknownJob`` (also for a deferred store not yet submitted)."""
    job = state.job(event.job_id)
    if job is None:
        why = "finished already" if event.job_id <= state.last_job_id else "was never submitted"
        raise UnknownJob(f"job {event.job_id} is not in flight (it {why})", event)
    if not job.submitted:
        raise UnknownJob(
            f"{job.kind} job {event.job_id} is deferred: it cannot finish before it is submitted",
            event,
        )
    return job


def apply_finish(state: State, event: TransferFinished, job: Job) -> list[Plan]:
    """End a checked job (success or not) and release its pins."""
    state.remove_job(job)
    state.unpin(job.kind, job.gpu_block_ids)
    return []

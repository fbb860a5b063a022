"""Store (GPU -> CPU) and load (CPU -> GPU) jobs, their sub-block expansion and their pins.

A ``StoreRequested`` / ``LoadRequested`` is checked in this order, and the first failure is
raised: job id (``DuplicateJob``), GPU ids (``BlockOutOfRange``), CPU ids
(``BlockOutOfRange``), sizes (``TransferSizeMismatch``), conflicts (``BlockInUse``), the
in-flight bound (``TooManyJobs``).

- Job ids must be strictly increasing across stores and loads (vLLM uses one counter): this
  rejects a reused or in-flight id with bounded memory. At most ``MAX_JOBS_IN_FLIGHT`` jobs
  are unfinished at once.
- GPU ids are logical and are resolved through the defrag mapping now, at submit time; the
  plan and the pins use the physical ids, which defrag then never moves.
- Expansion (the seed's ``transfer_async`` + ``expand_block_ids``): a GPU block is one
  sub-block, a CPU block ``f = block_size_factor`` sub-blocks ``cpu_block_id * f + k``. A
  store has src factor 1 and dst factor f, a load src factor f and dst factor 1; the first
  ``skip = (-len(dst_blocks)) % src_factor`` sub-blocks of the FIRST src block are skipped,
  and ``dst_sub_count == src_sub_count - skip`` must hold. ``num_bytes = dst_sub_count *
  page_size_bytes``. ``after_job_id`` is the most recent unfinished job of the same
  direction (-1 if none).
- Conflicts refused with ``BlockInUse``: a load whose destination GPU block is pinned by an
  unfinished job (store or load); a store reading a GPU block an unfinished load is
  writing. (Allocating a block an unfinished store still reads is refused in
  ``defrag.allocate`` when prefix caching is off.) Several stores may read one block: pins
  are counts.
- ``TransferFinished`` ends the job, success or not, and releases its pins; a job not in
  flight is ``UnknownJob``.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from kvlog.errors import BlockInUse, DuplicateJob, TooManyJobs, TransferSizeMismatch, UnknownJob
from kvlog.events import LoadRequested, Plan, StoreRequested, TransferFinished, TransferPlan
from kvlog.reducers.blockset import IdArray
from kvlog.reducers.defrag import check_block_range
from kvlog.reducers.state import MAX_JOBS_IN_FLIGHT, Job, State

__all__ = ["check_finish", "check_submit", "expand_sub_blocks", "finish", "submit"]


def expand_sub_blocks(block_ids: IdArray, factor: int, skip: int = 0) -> IdArray:
    """Sub-block ids ``b * factor + k`` of each block, the first ``skip`` of the first block
    left out (the seed's ``expand_block_ids``)."""
    assert 0 <= skip < factor, f"skip {skip} must be below the factor {factor}"
    subs = (block_ids[:, None] * factor + np.arange(factor, dtype=np.int64)).ravel()
    return subs[skip:]


def _check_job_id(state: State, event: StoreRequested | LoadRequested) -> None:
    job_id = event.job_id
    if job_id <= state.last_job_id:
        where = "is in flight" if state.job(job_id) is not None else "was used before"
        raise DuplicateJob(
            f"job id {job_id} {where}: job ids must be strictly increasing across stores and "
            f"loads (vLLM uses one counter); the last one was {state.last_job_id}",
            event,
        )


def _sizes(event: StoreRequested | LoadRequested, factor: int) -> tuple[int, int]:
    """(skip, dst_sub_count), or ``TransferSizeMismatch`` with the counts."""
    num_gpu, num_cpu = len(event.gpu_block_ids), len(event.cpu_block_ids)
    if isinstance(event, StoreRequested):
        src_count, dst_count, skip = num_gpu, num_cpu * factor, 0
        what = f"store of {num_gpu} GPU blocks into {num_cpu} CPU blocks"
    else:
        src_count, dst_count, skip = num_cpu * factor, num_gpu, (-num_gpu) % factor
        what = f"load of {num_cpu} CPU blocks into {num_gpu} GPU blocks"
    if dst_count != src_count - skip:
        raise TransferSizeMismatch(
            f"{what} with block_size_factor {factor}: {dst_count} destination sub-blocks, "
            f"but {src_count} source sub-blocks minus {skip} skipped = {src_count - skip}",
            event,
        )
    return skip, dst_count


def _check_conflicts(
    state: State, event: StoreRequested | LoadRequested, physical: IdArray
) -> None:
    kind = "store" if isinstance(event, StoreRequested) else "load"
    if kind == "store":
        busy = state.load_pins[physical] > 0
        why = "an unfinished load is writing it"
    else:
        busy = (state.load_pins[physical] | state.store_pins[physical]) > 0
        why = "an unfinished transfer reads or writes it"
    hit = np.flatnonzero(busy)
    if hit.size:
        i = int(hit[0])
        p = int(physical[i])
        jobs = (*state.store_jobs.values(), *state.load_jobs.values())
        owners = sorted(j.job_id for j in jobs if p in j.gpu_block_ids)
        raise BlockInUse(
            f"{kind} job {event.job_id} uses GPU block {event.gpu_block_ids[i]} (physical {p}) "
            f"but {why} (jobs {owners})",
            event,
        )


def check_submit(state: State, event: StoreRequested | LoadRequested) -> tuple[IdArray, IdArray]:
    """Refuse a bad store or load; return (physical GPU ids, CPU sub-block ids)."""
    config = state.config
    assert config is not None, "reduce() dispatches only configured states here"
    _check_job_id(state, event)
    gpu = check_block_range(event, "gpu_block_ids", event.gpu_block_ids, config.num_gpu_blocks)
    cpu = check_block_range(event, "cpu_block_ids", event.cpu_block_ids, config.num_cpu_blocks)
    factor = config.block_size_factor
    skip, _ = _sizes(event, factor)
    physical = state.fwd[gpu].astype(np.int64)
    _check_conflicts(state, event, physical)
    if len(state.store_jobs) + len(state.load_jobs) >= MAX_JOBS_IN_FLIGHT:
        raise TooManyJobs(
            f"{MAX_JOBS_IN_FLIGHT} jobs are already in flight; finish some first", event
        )
    return physical, expand_sub_blocks(cpu, factor, skip)


def submit(state: State, event: StoreRequested | LoadRequested) -> list[Plan]:
    """Validate a store or load, pin its GPU blocks and return its TransferPlan."""
    config = state.config
    assert config is not None, "reduce() dispatches only configured states here"
    physical, cpu_subs = check_submit(state, event)
    kind: Literal["store", "load"] = "store" if isinstance(event, StoreRequested) else "load"
    jobs = state.store_jobs if kind == "store" else state.load_jobs
    after_job_id = next(reversed(jobs), -1)
    src, dst = (physical, cpu_subs) if kind == "store" else (cpu_subs, physical)
    state.pin(kind, physical)
    cpu = np.asarray(event.cpu_block_ids, dtype=np.int64)
    jobs[event.job_id] = Job(event.job_id, kind, physical, cpu)
    state.last_job_id = event.job_id
    pairs = list(zip(src.tolist(), dst.tolist(), strict=True))
    num_bytes = len(pairs) * config.page_size_bytes  # len(pairs) is dst_sub_count
    return [TransferPlan(event.job_id, kind, pairs, num_bytes, after_job_id)]


def check_finish(state: State, event: TransferFinished) -> Job:
    """The job to finish, or ``UnknownJob``."""
    job = state.job(event.job_id)
    if job is None:
        why = "finished already" if event.job_id <= state.last_job_id else "was never submitted"
        raise UnknownJob(f"job {event.job_id} is not in flight (it {why})", event)
    return job


def finish(state: State, event: TransferFinished) -> list[Plan]:
    """End a job (success or not) and release its pins."""
    job = check_finish(state, event)
    jobs = state.store_jobs if job.kind == "store" else state.load_jobs
    del jobs[event.job_id]
    state.unpin(job.kind, job.gpu_block_ids)
    return []

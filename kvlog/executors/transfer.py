"""The transfer executor: store and load jobs between canonical views and CPU block tensors.

Each direction (``"store"``: accelerator to CPU, ``"load"``: CPU to accelerator) keeps a
pool of streams and events and a queue of jobs in submit order. A job:

1. takes a stream and two timing events from its direction's pools;
2. waits for the compute stream when it is a store (the model must have written the blocks);
3. waits for the end event of ``after_job_id`` and of the previous job of its direction,
   so jobs of one direction run one after another (never a device-wide synchronize);
4. records its start event, queues its copy work (one program built per job, the device
   index moved to the device once per job, then a few copy calls per canonical tensor),
   and records its end event.

``poll()`` returns the finished jobs (their end event has completed) in submit order per
direction, merged in submit order, as :class:`TransferCompletion`. A copy that fails reports
``success=False`` (with the error text) and never raises out of ``poll()``.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import torch

from kvlog.events import TransferPlan
from kvlog.executors.copies import (
    INDEXED_MAX_PAIRS,
    build_device_transfer_program,
    build_host_program,
    host_rows,
    indexed_copy,
)
from kvlog.executors.devices import Device
from kvlog.executors.layouts import CacheLayout

__all__ = ["TransferCompletion", "TransferExecutor"]


class TransferCompletion(msgspec.Struct, frozen=True):
    """A finished transfer job: whether it worked, its size and how long it took.

    The executor's (and the Engine's) report; the vLLM-shaped result the offloading
    facades hand to vLLM is :class:`kvlog.integrations.offload.TransferResult`.

    ``num_bytes`` is the job's size (pairs times the layout's ``page_size_bytes``), also
    for a failed job; ``error`` says why a job failed (empty on success).
    """

    job_id: int
    success: bool
    num_bytes: int
    elapsed_s: float
    error: str = ""


@dataclass
class _Job:
    job_id: int
    kind: str
    seq: int
    num_bytes: int
    stream: Any = None
    """None for a job that ran at submit (``_run_now``): ``start`` and ``end`` are then
    host-clock times, else the device's events."""
    start: Any = None
    end: Any = None
    error: str = ""
    keepalive: object = None


@dataclass
class _Direction:
    jobs: deque[_Job] = field(default_factory=deque)
    streams: list[Any] = field(default_factory=list)
    events: list[Any] = field(default_factory=list)


class TransferExecutor:
    """Runs :class:`TransferPlan` jobs on one device; see the module docstring."""

    def __init__(self, layout: CacheLayout, cpu_views: list[torch.Tensor], device: Device) -> None:
        assert len(cpu_views) == len(layout.tensors), "one CPU tensor per canonical view"
        self._layout = layout
        self._gpu_views = [t.view for t in layout.tensors]
        self._cpu_views = cpu_views
        self._device = device
        self._num_cpu_rows = int(cpu_views[0].shape[0]) if cpu_views else 0
        self._directions = {"store": _Direction(), "load": _Direction()}
        self._in_flight: dict[int, _Job] = {}
        self._seq = itertools.count()
        self._host_rows: dict[bool, list[tuple[np.ndarray, np.ndarray]]] | None = None
        """Per direction (store: True), the (destination, source) row arrays of each
        tensor as numpy (host devices), built on first use."""

    @property
    def jobs_in_flight(self) -> list[int]:
        """Job ids submitted and not yet reported, in submit order."""
        jobs = sorted(self._in_flight.values(), key=lambda job: job.seq)
        return [job.job_id for job in jobs]

    def submit(self, plan: TransferPlan) -> None:
        """Queue one job; it runs after its dependencies, on a transfer stream."""
        assert plan.job_id not in self._in_flight, f"job {plan.job_id} is already in flight"
        src, dst = self._check(plan)
        if self._device.synchronous:
            self._run_now(plan, src, dst)
            return
        flat = itertools.chain.from_iterable(plan.pairs)
        pairs = np.fromiter(flat, np.int64, 2 * len(plan.pairs)).reshape(-1, 2)
        direction = self._directions[plan.kind]
        device = self._device
        stream = direction.streams.pop() if direction.streams else device.new_stream()
        start, end = (self._event(direction), self._event(direction))
        num_bytes = len(pairs) * self._layout.page_size_bytes
        job = _Job(plan.job_id, plan.kind, next(self._seq), num_bytes, stream, start, end)
        if plan.kind == "store":
            device.wait_stream(stream, device.compute_stream())
        for previous in self._dependencies(plan, direction):
            device.wait_event(stream, previous.end)
        device.record(start, stream)
        device.enqueue(stream, self._work(job, pairs), lambda error: _fail(job, error))
        device.record(end, stream)
        direction.jobs.append(job)
        self._in_flight[plan.job_id] = job

    def _run_now(self, plan: TransferPlan, src: Sequence[int], dst: Sequence[int]) -> None:
        """A synchronous device's job: its copies run here, before ``submit`` returns (every
        job before it already has), timed by the host clock; it waits in its direction's
        queue, done, for ``poll``. No stream or event: nothing could wait on one."""
        n = len(src)
        src_ids, dst_ids = np.fromiter(src, np.int64, n), np.fromiter(dst, np.int64, n)
        store = plan.kind == "store"
        gpu_ids, cpu_ids = (src_ids, dst_ids) if store else (dst_ids, src_ids)
        job = _Job(plan.job_id, plan.kind, next(self._seq), n * self._layout.page_size_bytes)
        work = self._host_work(store, gpu_ids, cpu_ids, owned=True)
        start = time.perf_counter()
        self._device.enqueue(None, work, lambda error: _fail(job, error))  # runs it now
        job.start, job.end = start, time.perf_counter()
        self._directions[plan.kind].jobs.append(job)
        self._in_flight[plan.job_id] = job

    def _event(self, direction: _Direction) -> Any:
        return direction.events.pop() if direction.events else self._device.new_event()

    def poll(self) -> list[TransferCompletion]:
        """Finished jobs, in submit order per direction; never raises for a failed copy."""
        self._device.progress()
        finished: list[_Job] = []
        for direction in self._directions.values():
            while direction.jobs and self._is_done(direction.jobs[0]):
                finished.append(self._retire(direction))
        finished.sort(key=lambda job: job.seq)
        return [self._result(job) for job in finished]

    def wait(self, job_ids: Iterable[int] | None = None) -> list[TransferCompletion]:
        """Block until the given jobs (default: all in flight) finish; return what finished.

        Ids that are not in flight have already finished and are ignored. The result holds
        every job that finished meanwhile, the requested ones included.
        """
        wanted = list(self._in_flight) if job_ids is None else list(job_ids)
        for job_id in wanted:
            job = self._in_flight.get(job_id)
            if job is not None:
                self._synchronize(job)
        return self.poll()

    def _check(self, plan: TransferPlan) -> tuple[Sequence[int], Sequence[int]]:
        """The plan's sources and destinations, once its ids are seen to lie in the caches
        and its destinations to be distinct (the reducer's promises: a miss is a bug)."""
        assert plan.kind in self._directions, f"TransferPlan kind {plan.kind!r}"
        if not plan.pairs:
            return (), ()
        store = plan.kind == "store"
        src, dst = zip(*plan.pairs, strict=True)  # a job's few pairs: Python beats numpy
        gpu, cpu = (src, dst) if store else (dst, src)
        num_gpu, num_cpu = self._layout.num_gpu_blocks, self._num_cpu_rows
        assert min(gpu) >= 0 and max(gpu) < num_gpu, (
            f"job {plan.job_id}: GPU block id outside [0, {num_gpu})"
        )
        assert min(cpu) >= 0 and max(cpu) < num_cpu, (
            f"job {plan.job_id}: CPU sub-block id outside [0, {num_cpu})"
        )
        assert len(set(dst)) == len(dst), f"job {plan.job_id}: a destination block appears twice"
        return src, dst

    def _dependencies(self, plan: TransferPlan, direction: _Direction) -> list[_Job]:
        jobs = [direction.jobs[-1]] if direction.jobs else []
        after = self._in_flight.get(plan.after_job_id)
        if after is not None and (not jobs or after is not jobs[0]):
            jobs.append(after)
        return jobs

    def _work(self, job: _Job, pairs: np.ndarray) -> Callable[[], None]:
        """The job's copy work: one program per job, then a few copies per canonical tensor."""
        store = job.kind == "store"
        gpu_ids, cpu_ids = (pairs[:, 0], pairs[:, 1]) if store else (pairs[:, 1], pairs[:, 0])
        gpu_views, cpu_views = self._gpu_views, self._cpu_views
        if self._device.host_like:
            return self._host_work(store, gpu_ids, cpu_ids)
        device = self._layout.device

        def device_work() -> None:
            # Built here, in stream order: the index moves to the device on the transfer
            # stream (once per job) and is allocated from that stream's pool.
            program = build_device_transfer_program(cpu_ids, gpu_ids, device)
            job.keepalive = program  # the device index lives until the job is retired
            copy = program.store if store else program.load
            for cpu_view, gpu_view in zip(cpu_views, gpu_views, strict=True):
                copy(cpu_view, gpu_view)

        return device_work

    def _host_work(
        self, store: bool, gpu_ids: np.ndarray, cpu_ids: np.ndarray, owned: bool = False
    ) -> Callable[[], None]:
        """Host memory on both sides: a small job gathers and scatters per tensor, a large
        one runs a run-coalesced program (``copies.INDEXED_MAX_PAIRS``)."""
        src, dst = (gpu_ids, cpu_ids) if store else (cpu_ids, gpu_ids)
        if len(src) > INDEXED_MAX_PAIRS:
            host = build_host_program(src, dst)
            gpu_views, cpu_views = self._gpu_views, self._cpu_views
            dst_views, src_views = (cpu_views, gpu_views) if store else (gpu_views, cpu_views)
            views = list(zip(dst_views, src_views, strict=True))

            def host_work() -> None:
                for dst_view, src_view in views:
                    host.copy(dst_view, src_view)

            return host_work
        if self._host_rows is None:
            gpu_rows = [host_rows(view) for view in self._gpu_views]
            cpu_rows = [host_rows(view) for view in self._cpu_views]
            self._host_rows = {
                True: list(zip(cpu_rows, gpu_rows, strict=True)),
                False: list(zip(gpu_rows, cpu_rows, strict=True)),
            }
        pairs = self._host_rows[store]
        if not owned:  # strided views of a pairs array: index with contiguous copies
            src, dst = src.copy(), dst.copy()

        def indexed_work() -> None:
            for to_rows, from_rows in pairs:
                indexed_copy(to_rows, from_rows, dst, src, INDEXED_MAX_PAIRS)

        return indexed_work

    def _is_done(self, job: _Job) -> bool:
        if job.stream is None:  # ran at submit (``_run_now``)
            return True
        try:
            return self._device.query(job.end)
        except Exception as error:  # a device error ends the job as failed
            _fail(job, error)
            return True

    def _synchronize(self, job: _Job) -> None:
        if job.stream is None:  # ran at submit (``_run_now``)
            return
        try:
            self._device.synchronize(job.end)
        except Exception as error:
            _fail(job, error)

    def _retire(self, direction: _Direction) -> _Job:
        job = direction.jobs.popleft()
        del self._in_flight[job.job_id]
        return job

    def _result(self, job: _Job) -> TransferCompletion:
        if job.stream is None:  # ran at submit (``_run_now``): host clock times
            elapsed_s = max(0.0, job.end - job.start)
        else:
            direction = self._directions[job.kind]
            try:
                elapsed_s = self._device.elapsed_s(job.start, job.end)
            except Exception:  # timing is best effort; the outcome is what matters
                elapsed_s = 0.0
            direction.streams.append(job.stream)
            direction.events.extend((job.start, job.end))
            job.keepalive = None
        return TransferCompletion(job.job_id, not job.error, job.num_bytes, elapsed_s, job.error)


def _fail(job: _Job, error: BaseException) -> None:
    if not job.error:
        job.error = f"{type(error).__name__}: {error}"

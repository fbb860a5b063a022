"""Offloading facades shaped like vLLM's CPU offloading worker and its older handlers.

Two shapes, one Engine (the defragmenter's, see :mod:`kvlog.integrations.session`):

- :class:`OffloadingWorker`, like ``vllm.v1.kv_offload.base.OffloadingWorker``:
  ``submit_store(job_id, src_spec, dst_spec)``, ``submit_load(job_id, src_spec, dst_spec)``,
  ``get_finished() -> list[TransferResult]``, ``wait(job_ids)``, ``shutdown()``.
- :class:`OffloadingHandler`, like ``vllm.v1.kv_offload.worker.worker.OffloadingHandler``
  (one per direction, as the plugin's ``SingleDirectionOffloadingHandler``):
  ``transfer_async(job_id, (src_spec, dst_spec)) -> bool``, ``get_finished()``, ``wait``.
  :class:`OffloadingHandlers` holds the pair as ``gpu_to_cpu_handler`` and
  ``cpu_to_gpu_handler``, like the plugin's ``CpuGpuOffloadingHandlers``.

A spec is anything with ``.block_ids`` (vLLM's ``GPULoadStoreSpec``/``CPULoadStoreSpec``), or
a plain numpy array or list of ids; a GPU spec's ``group_sizes`` and ``block_indices``
(vLLM 0.33) select vLLM's chunk rule, any number of KV-cache groups. GPU ids are the
scheduler's (logical) ids: the Engine resolves them when the job is declared or submitted and
pins the physical blocks until the transfer finishes, which the seed handler does not do.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import msgspec
import numpy as np

from kvlog.errors import DuplicateJob, TransferSpecError
from kvlog.events import (
    LoadRequested,
    StoreRequested,
    TransferBatch,
    TransferEvent,
    TransferSubmitted,
)
from kvlog.executors import TransferCompletion
from kvlog.integrations.defragmenter import OnlineDefragmenter
from kvlog.integrations.session import JobKind, KvCacheSession

__all__ = [
    "DeclaredJob",
    "OffloadingHandler",
    "OffloadingHandlers",
    "OffloadingWorker",
    "TransferResult",
    "block_ids_of",
    "groups_of",
    "transfer_event",
]


class TransferResult(msgspec.Struct, frozen=True):
    """vLLM's ``TransferResult`` fields: job id, success, bytes and seconds, direction.

    What ``get_finished()`` returns, built from the executor's
    :class:`~kvlog.executors.TransferCompletion`; ``num_bytes`` / ``elapsed_s`` read the
    same values under the executor's names.
    """

    job_id: int
    success: bool
    transfer_size: int | None = None
    transfer_time: float | None = None
    transfer_type: tuple[str, str] | None = None

    @property
    def num_bytes(self) -> int:
        return self.transfer_size or 0

    @property
    def elapsed_s(self) -> float:
        return self.transfer_time or 0.0


DeclaredJob = tuple[JobKind, int, Any, Any, "str | None", "bool | None"]
"""One job of a step for ``OffloadingWorker.declare_step``: ``(kind, job_id, src_spec,
dst_spec, req_id, sync)``."""

_TYPES: dict[JobKind, tuple[str, str]] = {"store": ("GPU", "CPU"), "load": ("CPU", "GPU")}


def _result(kind: JobKind, r: TransferCompletion) -> TransferResult:
    return TransferResult(r.job_id, r.success, r.num_bytes, r.elapsed_s, _TYPES[kind])


def block_ids_of(spec: Any, name: str) -> list[int]:
    """The block ids of a spec with ``.block_ids``, a numpy array, or a sequence of ints."""
    ids = getattr(spec, "block_ids", spec)
    try:
        array = np.asarray(ids)
    except (TypeError, ValueError) as error:
        raise TransferSpecError(f"{name}: block_ids are not ints: {error}") from None
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise TransferSpecError(f"{name}: block_ids must be a 1-D array of ints, got {ids!r}")
    return array.tolist()  # type: ignore[no-any-return]  # an int array: Python ints


def groups_of(spec: Any, name: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A GPU spec's ``(group_sizes, block_indices)`` (vLLM 0.33), or ``((), ())``."""
    sizes = getattr(spec, "group_sizes", None)
    indices = getattr(spec, "block_indices", None)
    if sizes is None and indices is None:
        return (), ()
    try:
        return tuple(map(int, sizes or ())), tuple(map(int, indices or ()))
    except (TypeError, ValueError) as error:
        raise TransferSpecError(f"{name}: group_sizes/block_indices: {error}") from None


def transfer_event(
    kind: JobKind, job_id: int, src_spec: Any, dst_spec: Any, *, deferred: bool = False
) -> StoreRequested | LoadRequested:
    """The event for one vLLM transfer job (the GPU spec carries the KV-cache groups)."""
    src, dst = block_ids_of(src_spec, "src_spec"), block_ids_of(dst_spec, "dst_spec")
    if kind == "store":
        sizes, indices = groups_of(src_spec, "src_spec")
        return StoreRequested(
            job_id=int(job_id),
            gpu_block_ids=src,
            cpu_block_ids=dst,
            group_sizes=sizes,
            block_indices=indices,
            deferred=deferred,
        )
    sizes, indices = groups_of(dst_spec, "dst_spec")
    return LoadRequested(
        job_id=int(job_id),
        cpu_block_ids=src,
        gpu_block_ids=dst,
        group_sizes=sizes,
        block_indices=indices,
        deferred=deferred,
    )


def _job_id(job_id: object) -> int:
    """``job_id`` as an int: an int or numpy integer, never a bool, float or string."""
    if isinstance(job_id, bool):
        raise TransferSpecError(f"job id {job_id!r} is a bool, not an int")
    try:
        return operator.index(job_id)  # type: ignore[arg-type]
    except TypeError:
        raise TransferSpecError(f"job id {job_id!r} is not an int") from None


def _session_of(owner: OnlineDefragmenter | KvCacheSession) -> KvCacheSession:
    return owner.session if isinstance(owner, OnlineDefragmenter) else owner


class OffloadingWorker:
    """vLLM 0.33's ``OffloadingWorker`` over the shared Engine.

    ``num_cpu_blocks`` and ``block_size_factor`` (vLLM's ``blocks_per_chunk``: a CPU block
    is that many GPU blocks) go into the log's ``CacheConfigured``, so build the worker
    before the first scheduler step. A job may be declared first (``declare``: pinned from
    the scheduler's decision, see ``kvlog.integrations.vllm``); its ``submit_*`` then runs
    it. Bad input raises ``InvalidEvent`` or ``TransferSpecError``.

    Job ids: ``submit_*`` takes a fresh int above every job id used before (vLLM's one
    counter), or a job ``declare`` pinned and no ``submit_*`` ran yet. Anything else (a
    reused or lower id, -1, ``6.7``, ``True``) raises :class:`~kvlog.errors.DuplicateJob`
    or :class:`~kvlog.errors.TransferSpecError` instead of returning: vLLM's connector
    asserts the returned bool (``assert success``), so a False would end as a bare
    ``AssertionError`` (or, under ``python -O``, a job that is never submitted and a
    ``wait`` that never returns); the typed error names the job.
    """

    def __init__(
        self,
        defragmenter: OnlineDefragmenter | KvCacheSession,
        num_cpu_blocks: int,
        block_size_factor: int = 1,
        *,
        quarantine: bool = False,
    ) -> None:
        self.session = _session_of(defragmenter)
        self.session.attach_offload(num_cpu_blocks, block_size_factor, quarantine=quarantine)
        self._shut_down = False
        self._declared: dict[int, JobKind] = {}  # declared, their submit_* not called yet
        self._batch: list[TransferEvent] | None = None
        """Inside ``batched()``: the events its calls made, applied as one at its end."""
        self._kept_last = -1
        """The highest job id a request kept in the batch has (-1: none kept)."""

    def batched(self) -> contextlib.AbstractContextManager[None]:
        """Within this block, declarations and submissions of declared jobs are kept and
        applied at its end as one ``TransferBatch`` (a load's hold still comes right before
        its declaration: what was kept is applied first; so is what was kept when anything
        else reaches the session's Engine, ``KvCacheSession.keep``). A refused batch raises
        and applies nothing of it; an exception inside the block applies what was kept
        before it, as the calls one by one would have."""
        return _Batched(self)

    def begin_batch(self) -> bool:
        """Start keeping events for one batch; False inside one already (nested: the outer
        block applies). ``batched()`` is the way to use it."""
        if self._batch is not None:
            return False
        self._batch = []
        self.session.keep(self.flush)  # whatever else reaches the Engine comes after it
        return True

    def end_batch(self) -> None:
        """Apply what the batch kept (``flush``) and stop keeping."""
        try:
            self.flush()
        finally:
            self._batch = None
            self.session.let_go(self.flush)

    def flush(self) -> None:
        """Apply what ``batched()`` kept so far: one event, or a ``TransferBatch``."""
        events = self._batch
        if not events:
            return
        self._batch = []
        self._kept_last = -1
        try:
            self.session.apply(events[0] if len(events) == 1 else TransferBatch(events=events))
        except BaseException:  # refused: none of its jobs was declared
            for event in events:
                if type(event) is not TransferSubmitted:
                    self._declared.pop(event.job_id, None)
            raise

    def declare(
        self,
        kind: JobKind,
        job_id: int,
        src_spec: Any,
        dst_spec: Any,
        req_id: str | None = None,
        sync: bool | None = None,
    ) -> None:
        """Pin a job the scheduler decided for request ``req_id`` (a load: ``sync`` if the
        request runs this step), before its ``submit_*`` runs it."""
        event = transfer_event(kind, _job_id(job_id), src_spec, dst_spec, deferred=True)
        self._keep_declared(event, kind, req_id, sync)

    def declare_step(self, jobs: Sequence[DeclaredJob]) -> None:
        """``declare`` each of a step's jobs (job-id order), ``(kind, job_id, src_spec,
        dst_spec, req_id, sync)``, into the batch (inside ``batched()``) or one by one.

        A load's hold (``KvCacheSession.hold``) comes right before its declaration, and
        what was kept before it is applied first; inside an empty batch the step's holds
        are applied first instead, before any of its declarations, and the declarations
        stay kept as one batch (one record instead of a hold, a record and a flush a load),
        where that changes nothing: no load writes a GPU block another job of the step
        reads or writes (a hold then commutes with every other declaration: an allocation
        reads only its own blocks' pins and references, a declaration reads none of those),
        and no hold must first release a stale holder (``hold(evict=False)``; from the
        first load that must, the rest go as above). Every spec is read before anything is
        held: a bad one raises with nothing applied."""
        if self._shut_down:
            raise TransferSpecError("the offloading worker was shut down")
        events = [
            transfer_event(kind, _job_id(j), src, dst, deferred=True)
            for kind, j, src, dst, _, _ in jobs
        ]
        held = self._hold_first(events, jobs) if self._batch == [] else set()
        for event, (kind, _, _, _, req_id, sync) in zip(events, jobs, strict=True):
            self._keep_declared(event, kind, req_id, sync, event.job_id in held)

    def _keep_declared(
        self,
        event: StoreRequested | LoadRequested,
        kind: JobKind,
        req_id: str | None,
        sync: bool | None,
        held: bool = False,
    ) -> None:
        """A declared job's event applied or kept (``_submit``; ``held``: its load's hold
        applied already), the job awaiting its ``submit_*``."""
        self._submit(event, req_id, sync, held)
        self._declared[event.job_id] = kind

    def _hold_first(
        self, events: list[StoreRequested | LoadRequested], jobs: Sequence[DeclaredJob]
    ) -> set[int]:
        """Apply the holds of the step's loads now, as ``declare_step`` says; the job ids
        of the loads held."""
        loads = [(e, job) for e, job in zip(events, jobs, strict=True) if type(e) is LoadRequested]
        if not loads:
            return set()
        written = [b for e, _ in loads for b in e.gpu_block_ids]
        blocks = set(written)
        if len(blocks) != len(written) or any(
            not blocks.isdisjoint(e.gpu_block_ids) for e in events if type(e) is StoreRequested
        ):
            return set()
        held: set[int] = set()
        for event, (_, _, _, _, req_id, sync) in loads:
            if not self.session.hold(event.job_id, event.gpu_block_ids, req_id, sync, evict=False):
                break
            held.add(event.job_id)
        return held

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        """GPU (logical ids) -> CPU; True once submitted."""
        return self._run("store", job_id, src_spec, dst_spec)

    def submit_load(
        self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False
    ) -> bool:
        """CPU -> GPU (logical ids); True once submitted. ``expedited`` (a load the caller
        waits for within the step) changes nothing here: kvlog's loads do not queue behind
        one another's completion."""
        del expedited
        return self._run("load", job_id, src_spec, dst_spec)

    def _run(self, kind: JobKind, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        if self._shut_down:
            raise TransferSpecError("the offloading worker was shut down")
        job_id = _job_id(job_id)
        if job_id not in self._declared:
            self.flush()
            if self.session.known(job_id) or job_id < 0:
                last = self.session.engine.view.last_job_id
                raise DuplicateJob(
                    f"{kind} job id {job_id} is not a fresh one: job ids must be ints above "
                    f"every id used before (the last one was {last}) or a declared job "
                    "submitted once; nothing was submitted"
                )
            self._submit(transfer_event(kind, job_id, src_spec, dst_spec))
            return True
        declared = self._declared[job_id]
        if declared != kind:
            raise TransferSpecError(f"job {job_id} was declared as a {declared}, not a {kind}")
        del self._declared[job_id]
        view = self.session.engine.view
        job = view.job(job_id)
        if job is None and job_id > view.last_job_id:  # declared in this batch, kept
            assert self._batch, "a declared job not applied is kept in the batch"
            self._batch.append(TransferSubmitted(job_id=job_id))
        elif job is not None and not job.submitted:
            self._apply(TransferSubmitted(job_id=job_id))  # after a pending step
        # else: a declared store already flushed (running or done): nothing to do
        return True

    def _submit(
        self,
        event: StoreRequested | LoadRequested,
        req_id: str | None = None,
        sync: bool | None = None,
        held: bool = False,
    ) -> None:
        if self._shut_down:
            raise TransferSpecError("the offloading worker was shut down")
        kind: JobKind = "store" if isinstance(event, StoreRequested) else "load"
        if kind == "load" and not held:
            self.flush()  # the hold comes after what came before it
            self.session.hold(event.job_id, event.gpu_block_ids, req_id, sync)
        self._apply(event)
        self.session.submitted(event.job_id, kind)

    def _apply(self, event: TransferEvent) -> None:
        """Keep ``event`` for the batch (inside ``batched()``), else apply it now."""
        if self._batch is not None:
            self._batch.append(event)
            if type(event) is not TransferSubmitted:
                self._kept_last = event.job_id  # requests come in job-id order
        else:
            self.session.apply(event)

    def knows(self, job_id: int) -> bool:
        """Whether job ``job_id`` was declared or submitted here: applied (it may have
        finished since) or kept in the batch."""
        return job_id <= self._kept_last or self.session.known(job_id)

    def get_finished(self) -> list[TransferResult]:
        """Transfers finished since the last call (logged as ``TransferFinished``)."""
        return self.finished_of(("store", "load"))

    def finished_of(self, kinds: Sequence[JobKind]) -> list[TransferResult]:
        self.flush()
        finished = self.session.take_finished(kinds)  # one poll of the executor
        return [_result(kind, r) for kind, r in finished]

    def wait(self, job_ids: Iterable[int] | None) -> None:
        """Block until these jobs (None: all) finish; results still come from ``get_finished``."""
        self.flush()
        self.session.wait(job_ids)

    def shutdown(self) -> None:
        """Wait for every transfer; later submits raise."""
        self.flush()
        self.session.wait(None)
        self._shut_down = True


class _Batched:
    """``OffloadingWorker.batched()``'s context manager (a plain class: a generator-based
    one costs a few microseconds a step, on every connector call)."""

    __slots__ = ("outer", "worker")

    def __init__(self, worker: OffloadingWorker) -> None:
        self.worker = worker
        self.outer = False

    def __enter__(self) -> None:
        self.outer = self.worker.begin_batch()

    def __exit__(self, *exc_info: object) -> None:
        if self.outer:
            self.worker.end_batch()


class OffloadingHandler:
    """vLLM's older one-direction ``OffloadingHandler`` shape over a shared worker."""

    def __init__(self, worker: OffloadingWorker, kind: Literal["store", "load"]) -> None:
        self.worker = worker
        self.kind: JobKind = kind
        self.gpu_to_cpu = kind == "store"
        self.transfer_type = _TYPES[kind]

    def transfer_async(self, job_id: int, src_spec: Any, dst_spec: Any = None) -> bool:
        """Submit a job in this handler's direction: ``(job_id, src_spec, dst_spec)`` as
        vLLM 0.33's handlers take it, or ``(job_id, (src_spec, dst_spec))`` as older ones."""
        if dst_spec is None:
            src_spec, dst_spec = src_spec
        if self.gpu_to_cpu:
            return self.worker.submit_store(job_id, src_spec, dst_spec)
        return self.worker.submit_load(job_id, src_spec, dst_spec)

    def get_finished(self) -> list[TransferResult]:
        return self.worker.finished_of((self.kind,))

    def wait(self, job_ids: Iterable[int]) -> None:
        self.worker.wait(job_ids)

    def shutdown(self) -> None:
        self.worker.wait(None)


class OffloadingHandlers:
    """The pair of handlers, as the plugin's ``CpuGpuOffloadingHandlers`` exposes them."""

    def __init__(
        self,
        defragmenter: OnlineDefragmenter | KvCacheSession,
        num_cpu_blocks: int,
        block_size_factor: int = 1,
    ) -> None:
        self.worker = OffloadingWorker(defragmenter, num_cpu_blocks, block_size_factor)
        self.gpu_to_cpu_handler = OffloadingHandler(self.worker, "store")
        self.cpu_to_gpu_handler = OffloadingHandler(self.worker, "load")

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
a plain numpy array or list of ids. GPU ids are the scheduler's (logical) ids: the Engine
resolves them at submit time and pins the physical blocks until the transfer finishes, which
is what the seed handler does not do. Only one KV cache group is supported, as in the seed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Literal

import msgspec
import numpy as np

from kvlog.errors import TransferSpecError
from kvlog.events import LoadRequested, StoreRequested
from kvlog.executors import TransferResult as ExecutorResult
from kvlog.integrations.defrag import OnlineDefragmenter
from kvlog.integrations.session import JobKind, KvCacheSession

__all__ = [
    "OffloadingHandler",
    "OffloadingHandlers",
    "OffloadingWorker",
    "TransferResult",
    "block_ids_of",
]


class TransferResult(msgspec.Struct, frozen=True):
    """vLLM's ``TransferResult`` fields: job id, success, bytes and seconds, direction."""

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


_TYPES: dict[JobKind, tuple[str, str]] = {"store": ("GPU", "CPU"), "load": ("CPU", "GPU")}


def _result(kind: JobKind, r: ExecutorResult) -> TransferResult:
    return TransferResult(r.job_id, r.success, r.num_bytes, r.elapsed_s, _TYPES[kind])


def block_ids_of(spec: Any, name: str) -> list[int]:
    """The block ids of a spec with ``.block_ids``, a numpy array, or a sequence of ints."""
    group_sizes = getattr(spec, "group_sizes", None)
    if group_sizes is not None and len(group_sizes) > 1:
        raise TransferSpecError(f"{name}: {len(group_sizes)} KV cache groups; kvlog supports 1")
    ids = getattr(spec, "block_ids", spec)
    array = np.asarray(ids)
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise TransferSpecError(f"{name}: block_ids must be a 1-D array of ints, got {ids!r}")
    return [int(b) for b in array.tolist()]


def _session_of(owner: OnlineDefragmenter | KvCacheSession) -> KvCacheSession:
    return owner.session if isinstance(owner, OnlineDefragmenter) else owner


class OffloadingWorker:
    """vLLM's CPU ``OffloadingWorker`` shape over the defragmenter's Engine.

    ``num_cpu_blocks`` and ``block_size_factor`` (CPU block = that many GPU blocks) go into
    the log's ``CacheConfigured``, so build the worker before the first scheduler step.
    """

    def __init__(
        self,
        defragmenter: OnlineDefragmenter | KvCacheSession,
        num_cpu_blocks: int,
        block_size_factor: int = 1,
    ) -> None:
        self.session = _session_of(defragmenter)
        self.session.attach_offload(num_cpu_blocks, block_size_factor)
        self._shut_down = False

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        """GPU (logical ids) -> CPU; True once submitted. Bad input raises ``InvalidEvent``."""
        gpu, cpu = block_ids_of(src_spec, "src_spec"), block_ids_of(dst_spec, "dst_spec")
        self._submit(StoreRequested(job_id=int(job_id), gpu_block_ids=gpu, cpu_block_ids=cpu))
        return True

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        """CPU -> GPU (logical ids); True once submitted. Bad input raises ``InvalidEvent``."""
        cpu, gpu = block_ids_of(src_spec, "src_spec"), block_ids_of(dst_spec, "dst_spec")
        self._submit(LoadRequested(job_id=int(job_id), cpu_block_ids=cpu, gpu_block_ids=gpu))
        return True

    def _submit(self, event: StoreRequested | LoadRequested) -> None:
        if self._shut_down:
            raise TransferSpecError("the offloading worker was shut down")
        self.session.apply(event)
        kind: JobKind = "store" if isinstance(event, StoreRequested) else "load"
        self.session.submitted(event.job_id, kind)
        if kind == "load":
            self.session.hold(event.job_id, event.gpu_block_ids)

    def get_finished(self) -> list[TransferResult]:
        """Transfers finished since the last call (logged as ``TransferFinished``)."""
        return self.finished_of(("store", "load"))

    def finished_of(self, kinds: Sequence[JobKind]) -> list[TransferResult]:
        out: list[TransferResult] = []
        for kind in kinds:
            out.extend(_result(kind, r) for r in self.session.take_finished((kind,)))
        return out

    def wait(self, job_ids: Iterable[int] | None) -> None:
        """Block until these jobs (None: all) finish; results still come from ``get_finished``."""
        self.session.wait(job_ids)

    def shutdown(self) -> None:
        """Wait for every transfer; later submits raise."""
        self.session.wait(None)
        self._shut_down = True


class OffloadingHandler:
    """vLLM's older one-direction ``OffloadingHandler`` shape over a shared worker."""

    def __init__(self, worker: OffloadingWorker, kind: Literal["store", "load"]) -> None:
        self.worker = worker
        self.kind: JobKind = kind
        self.gpu_to_cpu = kind == "store"
        self.transfer_type = _TYPES[kind]

    def transfer_async(self, job_id: int, spec: tuple[Any, Any]) -> bool:
        """Submit ``spec = (src_spec, dst_spec)`` in this handler's direction."""
        src_spec, dst_spec = spec
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

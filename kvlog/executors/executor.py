"""The executor: plans applied to real KV-cache tensors, and block-level reads for canaries.

``make_executor`` registers the KV caches (checking their layout), allocates the CPU-side
offload tensors (one per canonical view, ``page_bytes * block_size_factor`` per CPU block,
pinned where the backend transfers by DMA) and wires a swap and a transfer executor to one
device backend. The executor trusts its plans (the reducers validated them) but asserts
their bounds.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import TracebackType

import torch

from kvlog.errors import ExecutorError, LayoutError
from kvlog.events import CacheConfigured, FencePlan, Plan, SwapPlan, TransferPlan
from kvlog.executors.devices import BACKENDS, CpuDevice, Device, StreamDevice
from kvlog.executors.fake import FakeDevice
from kvlog.executors.layouts import CacheLayout, KVCaches, register_layout
from kvlog.executors.swap import SwapExecutor
from kvlog.executors.transfer import TransferCompletion, TransferExecutor

__all__ = ["Executor", "make_executor"]


def make_executor(
    kv_caches: KVCaches,
    config: CacheConfigured,
    *,
    backend: str | Device = "cpu",
    layout: str = "auto",
    seed: int = 0,
    failure_rate: float = 0.0,
    max_delay_polls: int = 4,
) -> Executor:
    """Build an executor for ``kv_caches`` under ``config`` on one backend.

    ``backend`` is ``"cpu"``, ``"cuda"``, ``"hpu"``, ``"fake"`` or a :class:`Device`.
    ``seed`` seeds the fake device and failure injection (``failure_rate``, default 0);
    ``max_delay_polls`` bounds the fake device's completion delay. Raises ``LayoutError``
    for tensors that fit no layout, or whose bytes per block differ from a non-zero
    ``config.page_size_bytes``, and ``BackendUnavailable`` for a backend this machine lacks.
    """
    cache_layout = register_layout(kv_caches, config.num_gpu_blocks, config.block_size, layout)
    if config.page_size_bytes and config.page_size_bytes != cache_layout.page_size_bytes:
        raise LayoutError(
            f"CacheConfigured.page_size_bytes={config.page_size_bytes} but the registered "
            f"tensors hold {cache_layout.page_size_bytes} bytes per block "
            f"({len(cache_layout.tensors)} canonical tensors)"
        )
    device = _make_device(backend, cache_layout, seed, failure_rate, max_delay_polls)
    device.check_device(cache_layout.device)
    return Executor(cache_layout, config, device)


def _make_device(
    backend: str | Device, layout: CacheLayout, seed: int, failure_rate: float, max_delay: int
) -> Device:
    if isinstance(backend, Device):
        return backend
    if backend == "cpu":
        return CpuDevice(seed, failure_rate)
    if backend == "fake":
        return FakeDevice(seed, failure_rate, max_delay)
    if backend in ("cuda", "hpu"):
        return StreamDevice(backend, layout.device, seed, failure_rate)
    raise ExecutorError(f"unknown backend {backend!r}; expected one of {BACKENDS}")


class Executor:
    """Applies plans to one registered KV cache; see ``docs/internals.md`` for the contract."""

    def __init__(self, layout: CacheLayout, config: CacheConfigured, device: Device) -> None:
        self.layout = layout
        self.config = config
        self.device = device
        factor = config.block_size_factor
        self.cpu_tensors = [
            torch.zeros(
                (config.num_cpu_blocks, t.page_bytes * factor),
                dtype=torch.int8,
                pin_memory=device.pin_memory,
            )
            for t in layout.tensors
        ]
        self._cpu_views = [
            cpu.view(config.num_cpu_blocks * factor, t.page_bytes)
            for cpu, t in zip(self.cpu_tensors, layout.tensors, strict=True)
        ]
        self._swaps = SwapExecutor(layout, device)
        self._transfers = TransferExecutor(layout, self._cpu_views, device)
        self._finished: list[TransferCompletion] = []
        self._shut_down = False

    @property
    def backend(self) -> str:
        return self.device.name

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one GPU block over all canonical tensors."""
        return self.layout.page_size_bytes

    @property
    def pad_block_id(self) -> int:
        return self.layout.pad_block_id

    @property
    def jobs_in_flight(self) -> list[int]:
        return self._transfers.jobs_in_flight

    def execute(self, plan: Plan) -> None:
        """Run a ``SwapPlan`` now (compute stream); queue a ``TransferPlan`` on a stream;
        for a ``FencePlan`` wait until its jobs finish (their results stay for ``poll``)."""
        if self._shut_down:
            raise ExecutorError("execute() after shutdown()")
        if isinstance(plan, SwapPlan):
            self._swaps.apply(plan)
        elif isinstance(plan, TransferPlan):
            self._transfers.submit(plan)
        elif isinstance(plan, FencePlan):
            self._finished.extend(self._transfers.wait(plan.job_ids))
        else:
            raise ExecutorError(f"unknown plan type {type(plan).__name__}")

    def poll(self) -> list[TransferCompletion]:
        """Finished jobs since the last call, in submit order per direction."""
        results, self._finished = self._finished, []
        return results + (self._transfers.poll() if not self._shut_down else [])

    def wait(self, job_ids: Iterable[int] | None = None) -> list[TransferCompletion]:
        """Block until ``job_ids`` (default: every job in flight) finish; return results."""
        results, self._finished = self._finished, []
        return results + (self._transfers.wait(job_ids) if not self._shut_down else [])

    def shutdown(self) -> None:
        """Finish every job in flight; their results stay available to ``poll()``."""
        if not self._shut_down:
            self._finished.extend(self._transfers.wait())
            self._shut_down = True

    def __enter__(self) -> Executor:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.shutdown()

    def read_gpu_block(self, block_id: int) -> bytes:
        """Every byte of one physical block (the pad block included), all canonical tensors."""
        self._check_id("GPU block", block_id, self.layout.num_block_rows)
        return b"".join(bytes(t.view[block_id].cpu().numpy().data) for t in self.layout.tensors)

    def write_gpu_block(self, block_id: int, data: bytes) -> None:
        """Overwrite every byte of one physical block (tests, canaries)."""
        self._check_id("GPU block", block_id, self.layout.num_block_rows)
        rows = [t.view[block_id] for t in self.layout.tensors]
        _write_rows(rows, data, self.page_size_bytes)

    def read_cpu_block(self, cpu_block_id: int) -> bytes:
        """Every byte of one CPU block (all its sub-blocks), all canonical tensors."""
        self._check_id("CPU block", cpu_block_id, self.config.num_cpu_blocks)
        return b"".join(bytes(cpu[cpu_block_id].numpy().data) for cpu in self.cpu_tensors)

    def write_cpu_block(self, cpu_block_id: int, data: bytes) -> None:
        """Overwrite every byte of one CPU block (tests, canaries)."""
        self._check_id("CPU block", cpu_block_id, self.config.num_cpu_blocks)
        rows = [cpu[cpu_block_id] for cpu in self.cpu_tensors]
        _write_rows(rows, data, self.page_size_bytes * self.config.block_size_factor)

    @staticmethod
    def _check_id(what: str, block_id: int, limit: int) -> None:
        if not 0 <= block_id < limit:
            raise ExecutorError(f"{what} id {block_id} is outside [0, {limit})")


def _write_rows(rows: list[torch.Tensor], data: bytes, num_bytes: int) -> None:
    if len(data) != num_bytes:
        raise ExecutorError(f"block data of {len(data)} bytes; expected {num_bytes}")
    source = torch.frombuffer(bytearray(data), dtype=torch.int8)
    offset = 0
    for row in rows:
        row.copy_(source[offset : offset + row.numel()])
        offset += row.numel()

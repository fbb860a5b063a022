"""Device backends: clean refusals, lazy HPU import, and the stream/event wiring.

There is no GPU here, so the CUDA/HPU backend (:class:`StreamDevice`) runs against a
recording stand-in for ``torch.cuda`` on CPU tensors: it checks which stream each job waits
for, that index tensors move once per job, and that nothing synchronizes the whole device.
"""

from __future__ import annotations

import contextlib
import importlib.util
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvlog.errors import BackendUnavailable, ExecutorError
from kvlog.events import SwapPlan
from kvlog.executors import CpuDevice, FakeDevice, StreamDevice, make_executor
from kvlog.executors import devices as devices_module
from tests.support.executor_helpers import config_for, load_plan, make_kv_caches, store_plan

N, BS, CPU = 12, 2, 4


def caches() -> tuple[list[object], str]:
    return make_kv_caches("hpu_fp8_scales", N, BS, torch.device("cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present: nothing to refuse")
def test_cuda_backend_refuses_cleanly_without_cuda() -> None:
    kv_caches, layout = caches()
    with pytest.raises(BackendUnavailable, match="needs a CUDA device"):
        make_executor(kv_caches, config_for(N, BS), backend="cuda", layout=layout)


@pytest.mark.skipif(
    importlib.util.find_spec("habana_frameworks") is not None, reason="Habana stack installed"
)
def test_hpu_backend_refuses_cleanly_without_habana() -> None:
    kv_caches, layout = caches()
    with pytest.raises(BackendUnavailable, match=r"habana_frameworks\.torch"):
        make_executor(kv_caches, config_for(N, BS), backend="hpu", layout=layout)


def test_importing_kvlog_never_imports_habana() -> None:
    code = "import sys, kvlog, kvlog.executors; assert 'habana_frameworks' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_unknown_backend_and_bad_failure_rate_are_refused() -> None:
    kv_caches, layout = caches()
    with pytest.raises(ExecutorError, match="unknown backend 'tpu'"):
        make_executor(kv_caches, config_for(N, BS), backend="tpu", layout=layout)
    with pytest.raises(ValueError, match="failure_rate"):
        CpuDevice(failure_rate=-0.1)


def test_device_is_an_abstract_base() -> None:
    with pytest.raises(TypeError, match="abstract"):
        devices_module.Device()  # type: ignore[abstract]

    class Partial(devices_module.Device):
        def compute_stream(self) -> Any:
            return None

    with pytest.raises(TypeError, match="abstract"):
        Partial()
    assert all(
        issubclass(backend, devices_module.Device)
        for backend in (CpuDevice, StreamDevice, FakeDevice)
    )
    CpuDevice().progress()  # the one default: a no-op


class _Stream:
    def __init__(self, log: list[tuple[Any, ...]], name: str) -> None:
        self.log, self.name = log, name

    def wait_event(self, event: _Event) -> None:
        self.log.append(("wait_event", self.name, event.name))

    def wait_stream(self, other: _Stream) -> None:
        self.log.append(("wait_stream", self.name, other.name))


class _Event:
    count = 0

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing, "transfer events must time the job"
        _Event.count += 1
        self.name = f"event{_Event.count}"
        self.log: list[tuple[Any, ...]] = []

    def record(self, stream: _Stream) -> None:
        stream.log.append(("record", stream.name, self.name))

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: _Event) -> float:
        return 2.5  # milliseconds


class _FakeCuda:
    """Just the torch.cuda surface StreamDevice may use; no device-wide synchronize."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.compute = _Stream(self.log, "compute")
        self.streams = 0
        self.Event = _Event

    def current_stream(self, device: torch.device | None = None) -> _Stream:
        return self.compute

    def Stream(self, device: torch.device | None = None) -> _Stream:
        self.streams += 1
        return _Stream(self.log, f"stream{self.streams}")

    @contextlib.contextmanager
    def stream(self, stream: _Stream) -> Iterator[None]:
        self.log.append(("enter", stream.name))
        yield
        self.log.append(("exit", stream.name))

    def synchronize(self) -> None:
        raise AssertionError("a device-wide synchronize inside the transfer path")


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> _FakeCuda:
    module = _FakeCuda()
    monkeypatch.setattr(devices_module, "_accelerator_module", lambda name: module)
    return module


def test_stream_device_orders_jobs_with_events_only(fake_cuda: _FakeCuda) -> None:
    device = StreamDevice("cuda", torch.device("cpu"))
    device.device_type = "cpu"  # CPU tensors stand in for device memory
    device.pin_memory = False
    kv_caches, layout = caches()
    executor = make_executor(kv_caches, config_for(N, BS, CPU), backend=device, layout=layout)
    executor.execute(store_plan(1, [3, 7], [0, 1], 1))
    executor.execute(store_plan(2, [5], [2], 1, after=1))
    executor.execute(load_plan(3, [0], [9], 1))
    store1, store2, load3 = "stream1", "stream2", "stream3"
    log = fake_cuda.log
    assert ("wait_stream", store1, "compute") in log and ("wait_stream", store2, "compute") in log
    assert not any(entry[:2] == ("wait_stream", load3) for entry in log), (
        "a load waited for compute"
    )
    start_of_1, end_of_1 = (e[2] for e in log if e[0] == "record" and e[1] == store1)
    assert log.index(("record", store1, start_of_1)) < log.index(("enter", store1))
    assert ("wait_event", store2, end_of_1) in log  # job 2 starts after job 1's end event
    assert ("enter", store1) in log and ("enter", load3) in log
    results = executor.poll()
    assert [(r.job_id, r.success, r.elapsed_s) for r in results] == [
        (1, True, 0.0025),
        (2, True, 0.0025),
        (3, True, 0.0025),
    ]
    executor.execute(store_plan(4, [1], [3], 1))
    assert fake_cuda.streams == 3, "streams are reused from the pool"


def test_the_device_index_moves_inside_the_transfer_stream(
    fake_cuda: _FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvlog.executors import transfer

    seen: list[tuple[Any, ...]] = []
    build = transfer.build_device_transfer_program

    def spy(*args: Any) -> Any:
        seen.append(fake_cuda.log[-1])  # what the stream context was when it ran
        return build(*args)

    monkeypatch.setattr(transfer, "build_device_transfer_program", spy)
    device = StreamDevice("cuda", torch.device("cpu"))
    device.device_type, device.pin_memory = "cpu", False
    kv_caches, layout = caches()
    executor = make_executor(kv_caches, config_for(N, BS, CPU), backend=device, layout=layout)
    executor.execute(store_plan(1, [3, 9, 4], [0, 1, 2], 1))  # scattered: needs an index
    executor.execute(load_plan(2, [3], [7], 1))
    assert seen == [("enter", "stream1"), ("enter", "stream2")]


def test_stream_device_moves_bytes_like_the_cpu_backend(fake_cuda: _FakeCuda) -> None:
    results = {}
    for backend in ("cpu", "cuda"):
        kv_caches, layout = caches()
        device: Any = backend
        if backend == "cuda":
            device = StreamDevice("cuda", torch.device("cpu"))
            device.device_type, device.pin_memory = "cpu", False
        executor = make_executor(
            kv_caches, config_for(N, BS, CPU, 2), backend=device, layout=layout
        )
        executor.execute(SwapPlan(step=1, pairs=[(11, 1), (10, 2)], padded_to=8, mode="swap"))
        executor.execute(store_plan(1, [1, 2, 8, 4], [0, 3], 2))
        executor.execute(load_plan(2, [3, 0], [5, 6, 7], 2))
        assert all(r.success for r in executor.wait())
        blocks = [executor.read_gpu_block(b) for b in range(N + 1)]
        results[backend] = (blocks, [executor.read_cpu_block(c) for c in range(CPU)])
    assert results["cuda"] == results["cpu"]

"""Device backends behind one small interface: streams, events, record/wait/query, enqueue.

The transfer executor is written once against :class:`Device`, an abstract base class: a
backend subclasses it and only says how to make streams and events, how to order them, and
how to run a piece of copy work in stream order (the abstract methods); the base keeps the
shared parts (seeded failure injection, the device-type check, a no-op ``progress``). Stream
and event objects are the backend's own handles (``Any`` here).

- :class:`CpuDevice` (``"cpu"``): copies run synchronously at submit; events complete at
  once; ``host_like`` tells the executors to use run-coalesced slice copies.
- :class:`StreamDevice` (``"cuda"``, ``"hpu"``): torch streams and events, pinned host
  memory, ``non_blocking`` copies queued on side streams; never a device-wide synchronize.
  ``habana_frameworks.torch`` is imported lazily, inside the HPU backend only.
- ``"fake"``: a deterministic asynchronous simulator, see :mod:`kvlog.executors.fake`.

Every backend can inject failures (``failure_rate``, seeded, default 0): the job's work is
then not run and the job reports ``success=False``.
"""

from __future__ import annotations

import random
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from kvlog.errors import BackendUnavailable, LayoutError

__all__ = [
    "BACKENDS",
    "CpuDevice",
    "Device",
    "InjectedFailure",
    "StreamDevice",
    "Work",
]

BACKENDS: tuple[str, ...] = ("cpu", "cuda", "hpu", "fake")
Work = Callable[[], None]
ErrorHandler = Callable[[BaseException], None]


class InjectedFailure(RuntimeError):
    """A copy failure injected on purpose (``failure_rate``) to exercise the failure path."""


class Device(ABC):
    """The interface every backend implements: the abstract methods below, plus the shared
    failure injection and device check. ``progress`` defaults to a no-op (hardware)."""

    name: str = "device"
    host_like: bool = False
    """True where copies run on the host right away: use run-coalesced slice copies."""
    synchronous: bool = False
    """True where ``enqueue`` runs the work before it returns and events complete when
    recorded (no stream ever waits): the executors may run a job's copies at once, with no
    streams or events."""
    pin_memory: bool = False
    device_type: str = "cpu"
    """The ``torch.device.type`` the KV-cache tensors must live on."""

    def __init__(self, seed: int = 0, failure_rate: float = 0.0) -> None:
        if not 0.0 <= failure_rate <= 1.0:
            raise ValueError(f"failure_rate={failure_rate} must be within [0, 1]")
        self.failure_rate = failure_rate
        self._failures = random.Random(seed)

    def check_device(self, device: torch.device) -> None:
        """Refuse KV-cache tensors that do not live on this backend's device type."""
        if device.type != self.device_type:
            raise LayoutError(
                f"backend {self.name!r} needs KV-cache tensors on {self.device_type!r}, "
                f"got tensors on {str(device)!r}"
            )

    def should_fail(self) -> bool:
        """Draw one seeded failure decision (always False at the default rate 0)."""
        return self.failure_rate > 0.0 and self._failures.random() < self.failure_rate

    @abstractmethod
    def compute_stream(self) -> Any:
        """The stream the model's compute runs on (what transfers order against)."""

    @abstractmethod
    def new_stream(self) -> Any:
        """A new side stream for copies."""

    @abstractmethod
    def new_event(self) -> Any:
        """A new (timing) event."""

    @abstractmethod
    def record(self, event: Any, stream: Any) -> None:
        """Record ``event`` at the current end of ``stream``."""

    @abstractmethod
    def wait_event(self, stream: Any, event: Any) -> None:
        """Make ``stream`` wait for the latest record of ``event`` (as of this call)."""

    @abstractmethod
    def wait_stream(self, stream: Any, other: Any) -> None:
        """Make ``stream`` wait for everything queued on ``other`` so far."""

    @abstractmethod
    def query(self, event: Any) -> bool:
        """Whether the latest record of ``event`` has completed (never blocks)."""

    @abstractmethod
    def synchronize(self, event: Any) -> None:
        """Block the host until ``event`` completes (never the whole device)."""

    @abstractmethod
    def elapsed_s(self, start: Any, end: Any) -> float:
        """Seconds between two completed events."""

    @abstractmethod
    def enqueue(self, stream: Any, work: Work, on_error: ErrorHandler) -> None:
        """Run ``work`` in ``stream`` order; an exception from it goes to ``on_error``."""

    def progress(self) -> None:
        """Let asynchronous work advance; called once per ``poll()`` (a no-op on hardware)."""
        return  # a concrete default, deliberately not abstract: hardware advances alone


class _HostEvent:
    __slots__ = ("time_s",)

    def __init__(self) -> None:
        self.time_s = -1.0


class CpuDevice(Device):
    """Synchronous host backend: work runs at submit and events complete when recorded."""

    name = "cpu"
    host_like = True
    synchronous = True

    def __init__(self, seed: int = 0, failure_rate: float = 0.0) -> None:
        super().__init__(seed, failure_rate)
        self._stream = object()

    def compute_stream(self) -> Any:
        return self._stream

    def new_stream(self) -> Any:
        return object()

    def new_event(self) -> Any:
        return _HostEvent()

    def record(self, event: Any, stream: Any) -> None:
        event.time_s = time.perf_counter()

    def wait_event(self, stream: Any, event: Any) -> None:
        pass  # everything before has already run

    def wait_stream(self, stream: Any, other: Any) -> None:
        pass

    def query(self, event: Any) -> bool:
        return bool(event.time_s >= 0.0)

    def synchronize(self, event: Any) -> None:
        pass

    def elapsed_s(self, start: Any, end: Any) -> float:
        return max(0.0, float(end.time_s - start.time_s))

    def enqueue(self, stream: Any, work: Work, on_error: ErrorHandler) -> None:
        try:
            if self.should_fail():
                raise InjectedFailure("injected copy failure")
            work()
        except Exception as error:  # a failed copy is reported, never raised
            on_error(error)


class StreamDevice(Device):
    """CUDA or HPU: side streams, timing events, pinned host memory, non-blocking copies."""

    host_like = False
    pin_memory = True

    def __init__(
        self, name: str, device: torch.device, seed: int = 0, failure_rate: float = 0.0
    ) -> None:
        super().__init__(seed, failure_rate)
        self.name = name
        self.device_type = name
        self._module = _accelerator_module(name)
        self.device = device

    def compute_stream(self) -> Any:
        if self.name == "cuda":
            return self._module.current_stream(self.device)
        return self._module.current_stream()

    def new_stream(self) -> Any:
        if self.name == "cuda":
            return self._module.Stream(device=self.device)
        return self._module.Stream()

    def new_event(self) -> Any:
        event_type = getattr(self._module, "Event", torch.Event)
        return event_type(enable_timing=True)

    def record(self, event: Any, stream: Any) -> None:
        event.record(stream)

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def wait_stream(self, stream: Any, other: Any) -> None:
        stream.wait_stream(other)

    def query(self, event: Any) -> bool:
        return bool(event.query())

    def synchronize(self, event: Any) -> None:
        event.synchronize()

    def elapsed_s(self, start: Any, end: Any) -> float:
        return float(start.elapsed_time(end)) / 1000.0

    def enqueue(self, stream: Any, work: Work, on_error: ErrorHandler) -> None:
        try:
            if self.should_fail():
                raise InjectedFailure("injected copy failure")
            with self._module.stream(stream):
                work()
        except Exception as error:  # a failed enqueue is reported, never raised
            on_error(error)


def _accelerator_module(name: str) -> ModuleType:
    """``torch.cuda`` or ``torch.hpu``, importing the Habana bridge only when asked for."""
    if name == "cuda":
        if not torch.cuda.is_available():
            raise BackendUnavailable("backend 'cuda' needs a CUDA device; torch sees none")
        return torch.cuda
    if name == "hpu":
        try:
            import habana_frameworks.torch  # noqa: F401  (registers torch.hpu)
        except ImportError as error:
            raise BackendUnavailable(
                "backend 'hpu' needs habana_frameworks.torch (Intel Gaudi software stack); "
                f"importing it failed: {error}"
            ) from error
        module = getattr(torch, "hpu", None)
        if module is None or not module.is_available():
            raise BackendUnavailable("backend 'hpu': torch.hpu reports no Gaudi device")
        return module  # type: ignore[no-any-return]
    raise BackendUnavailable(f"unknown accelerator backend {name!r}; expected one of {BACKENDS}")

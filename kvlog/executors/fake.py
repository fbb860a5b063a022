"""A deterministic, seeded, asynchronous fake device for tests.

It works on CPU tensors but behaves like an accelerator with lazy transfer streams:

- every stream is a FIFO of operations (wait for an event, record an event, run work);
- a transfer's copy work is DEFERRED: when it reaches the head of its stream it draws a
  seeded delay of 1..``max_delay_polls`` ``progress()`` calls (one per ``poll()``) and runs
  only then, reading its source bytes at that moment. A block that defrag moved or that
  something overwrote while the job was in flight therefore shows up as corrupt data;
- streams advance in a seeded random order each tick, so jobs of different directions
  complete out of wall-clock order, while a wait on an event still holds a stream back,
  which keeps each job behind the previous job of its direction;
- the compute stream is immediate (swaps run at once), and failures can be injected at a
  seeded rate: the work is then skipped and the job reports ``success=False``.

Events carry generations like CUDA events: a wait refers to the latest record made before
the wait was queued, so recycling an event for a later job never confuses an earlier wait.
"""

from __future__ import annotations

import random
import time
from collections import deque
from typing import Any

from kvlog.executors.devices import Device, ErrorHandler, InjectedFailure, Work

__all__ = ["FakeDevice", "FakeEvent", "FakeStream"]

_MAX_TICKS = 1 << 20
"""Upper bound on ticks in ``synchronize``: hitting it means a dependency cycle (a bug)."""


class FakeEvent:
    """An event with generations: ``recorded`` records queued, ``completed`` records run."""

    __slots__ = ("completed", "recorded", "time_s")

    def __init__(self) -> None:
        self.recorded = 0
        self.completed = 0
        self.time_s = 0.0


class FakeStream:
    """A FIFO of pending operations, and the delay left for its head work item."""

    __slots__ = ("delay", "ops")

    def __init__(self) -> None:
        self.ops: deque[tuple[str, Any, Any]] = deque()
        self.delay = -1


class FakeDevice(Device):
    """The fake asynchronous backend (``"fake"``): see the module docstring."""

    name = "fake"
    host_like = False

    def __init__(self, seed: int = 0, failure_rate: float = 0.0, max_delay_polls: int = 4) -> None:
        super().__init__(seed, failure_rate)
        if max_delay_polls < 1:
            raise ValueError(f"max_delay_polls={max_delay_polls} must be >= 1")
        self.max_delay_polls = max_delay_polls
        self._rng = random.Random(seed ^ 0x5EED)
        self._compute = FakeStream()
        self._streams: list[FakeStream] = []

    def compute_stream(self) -> Any:
        return self._compute

    def new_stream(self) -> Any:
        stream = FakeStream()
        self._streams.append(stream)
        return stream

    def new_event(self) -> Any:
        return FakeEvent()

    def record(self, event: Any, stream: Any) -> None:
        event.recorded += 1
        if stream is self._compute:
            self._complete(event, event.recorded)
        else:
            stream.ops.append(("record", event, event.recorded))

    def wait_event(self, stream: Any, event: Any) -> None:
        if event.completed < event.recorded:
            stream.ops.append(("wait", event, event.recorded))

    def wait_stream(self, stream: Any, other: Any) -> None:
        if other is not self._compute:  # the compute stream has nothing pending
            marker = FakeEvent()
            self.record(marker, other)
            self.wait_event(stream, marker)

    def query(self, event: Any) -> bool:
        return bool(event.completed >= event.recorded)

    def synchronize(self, event: Any) -> None:
        for _ in range(_MAX_TICKS):
            if self.query(event):
                return
            self.progress()
        raise AssertionError("fake device: event never completes (dependency cycle)")

    def elapsed_s(self, start: Any, end: Any) -> float:
        return max(0.0, float(end.time_s - start.time_s))

    def enqueue(self, stream: Any, work: Work, on_error: ErrorHandler) -> None:
        stream.ops.append(("work", work, on_error))

    def progress(self) -> None:
        """One tick: every stream, in a seeded order, runs what its dependencies allow."""
        order = [s for s in self._streams if s.ops]
        self._rng.shuffle(order)
        for stream in order:
            self._advance(stream)

    def _advance(self, stream: FakeStream) -> None:
        while stream.ops:
            op, target, extra = stream.ops[0]
            if op == "wait" and target.completed < extra:
                return
            if op == "record":
                self._complete(target, extra)
            elif op == "work" and not self._work_due(stream):
                return
            elif op == "work":
                self._run(target, extra)
            stream.ops.popleft()

    def _work_due(self, stream: FakeStream) -> bool:
        if stream.delay < 0:
            stream.delay = self._rng.randint(1, self.max_delay_polls)
        stream.delay -= 1
        if stream.delay > 0:
            return False
        stream.delay = -1
        return True

    def _run(self, work: Work, on_error: ErrorHandler) -> None:
        try:
            if self.should_fail():
                raise InjectedFailure("injected copy failure")
            work()
        except Exception as error:  # reported through the job, never raised from poll()
            on_error(error)

    @staticmethod
    def _complete(event: FakeEvent, generation: int) -> None:
        event.completed = max(event.completed, generation)
        event.time_s = time.perf_counter()

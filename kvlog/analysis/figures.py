"""What an operator watches of one Engine: defrag and transfer figures, one definition.

:class:`EngineFigures` is an observer of a :class:`~kvlog.runtime.machine.Machine`: live,
attached to the serving Engine's machine (``kvlog.integrations.metrics``); offline, to the
lane of a fold over the same log (:func:`figures_of_log`). Same code, same events, same
counts: the metrics a server exports equal what the replay of its log computes.

Counters (since the observer was attached; the Engine attaches it before the first event
after ``CacheConfigured``): steps, steps on which defrag moved blocks, pairs moved and their
bytes, pairs after padding (what the padded swap executes), store and load jobs planned and
their bytes, transfers that failed. Gauges (read from the state when asked, O(jobs +
requests), never per event): used blocks, the highest used id, fragmentation (highest used
id over used blocks: 1.0 is compact), jobs in flight, the oldest one's age in steps (and in
seconds, live only), blocks that unfinished transfers pin, blocks a load's placeholder holds.
Per event the observer does O(plans + jobs in the event) work.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvlog import reducers
from kvlog.events import (
    HOLD_PREFIX,
    STEP_EVENTS,
    Event,
    LoadRequested,
    Plan,
    StoreRequested,
    SwapPlan,
    TransferBatch,
    TransferFinished,
    TransferPlan,
    pair_bytes,
)
from kvlog.runtime.fold import Fold, Lane
from kvlog.runtime.machine import Machine, Observer

__all__ = [
    "DIRECTIONS",
    "EngineFigures",
    "EngineGauges",
    "LogFigures",
    "figures_of_log",
    "live_figures",
]

DIRECTIONS: tuple[str, str] = ("store", "load")
_STEPS = frozenset(STEP_EVENTS)
_JOBS = frozenset((StoreRequested, LoadRequested, TransferFinished, TransferBatch))


@dataclass
class EngineGauges:
    """The state's figures now (``EngineFigures.gauges``)."""

    used_blocks: int = 0
    highest_used_id: int = -1
    fragmentation: float = 0.0
    jobs_in_flight: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DIRECTIONS, 0))
    oldest_job_age_steps: int = 0
    oldest_job_age_seconds: float = 0.0
    pinned_blocks: int = 0
    held_blocks: int = 0
    num_gpu_blocks: int = 0


class EngineFigures(Observer):
    """Counts a run's plans and steps (module docstring); ``clock`` (live only) times the
    age of the oldest job in flight."""

    __slots__ = (
        "_clock",
        "_started",
        "defrag_bytes",
        "defrag_pairs",
        "defrag_steps",
        "hold_prefix",
        "padded_pairs",
        "steps",
        "transfer_bytes",
        "transfer_failures",
        "transfer_jobs",
    )

    def __init__(
        self, clock: Callable[[], float] | None = None, hold_prefix: str = HOLD_PREFIX
    ) -> None:
        self._clock = clock
        self.hold_prefix = hold_prefix
        self.steps = self.defrag_steps = self.defrag_pairs = 0
        self.defrag_bytes = self.padded_pairs = 0
        self.transfer_jobs = dict.fromkeys(DIRECTIONS, 0)
        self.transfer_bytes = dict.fromkeys(DIRECTIONS, 0)
        self.transfer_failures = dict.fromkeys(DIRECTIONS, 0)
        self._started: dict[int, tuple[str, int, float]] = {}
        """Job in flight -> (direction, step and clock time it was requested)."""

    def before(self, state: reducers.State, event: Event) -> None:
        return None

    def after(self, state: reducers.State, event: Event, plans: list[Plan]) -> None:
        kind = type(event)
        if kind in _STEPS:
            self.steps += 1
        elif kind in _JOBS:
            if kind is TransferBatch:
                for inner in event.events:  # type: ignore[union-attr]
                    self._job_event(inner)
            else:
                self._job_event(event)
        if plans:
            self._count(state, plans)

    def _job_event(self, event: Event) -> None:
        kind = type(event)
        if kind is StoreRequested or kind is LoadRequested:
            direction = "store" if kind is StoreRequested else "load"
            now = self._clock() if self._clock is not None else 0.0
            self._started[event.job_id] = (direction, self.steps, now)  # type: ignore[union-attr]
        elif kind is TransferFinished:
            started = self._started.pop(event.job_id, None)  # type: ignore[union-attr]
            if started is not None and not event.success:  # type: ignore[union-attr]
                self.transfer_failures[started[0]] += 1

    def _count(self, state: reducers.State, plans: list[Plan]) -> None:
        moved = False
        for plan in plans:
            if type(plan) is SwapPlan:
                page = 0 if state.config is None else state.config.page_size_bytes
                self.defrag_pairs += len(plan.pairs)
                self.defrag_bytes += len(plan.pairs) * pair_bytes(page, plan.mode)
                self.padded_pairs += plan.padded_to
                moved = moved or bool(plan.pairs)
            elif type(plan) is TransferPlan:
                self.transfer_jobs[plan.kind] += 1
                self.transfer_bytes[plan.kind] += plan.num_bytes
        self.defrag_steps += moved

    def gauges(self, state: reducers.State) -> EngineGauges:
        """The state's figures now (module docstring)."""
        used, highest = state.num_used, state.max_used
        out = EngineGauges(used_blocks=used, highest_used_id=highest)
        out.num_gpu_blocks = state.num_gpu_blocks
        out.fragmentation = highest / used if used else 0.0
        out.jobs_in_flight = {"store": len(state.store_jobs), "load": len(state.load_jobs)}
        pinned: set[int] = set()
        for table in (state.store_jobs, state.load_jobs):
            for job in table.values():
                pinned.update(job.gpu_block_ids.tolist())
        out.pinned_blocks = len(pinned)
        prefix = self.hold_prefix
        out.held_blocks = sum(len(t) for r, t in state.tables.items() if r.startswith(prefix))
        jobs = [*state.store_jobs, *state.load_jobs]
        started = self._started.get(min(jobs)) if jobs else None
        if started is not None:
            out.oldest_job_age_steps = self.steps - started[1]
            if self._clock is not None:
                out.oldest_job_age_seconds = max(0.0, self._clock() - started[2])
        if len(self._started) > len(jobs):  # jobs the observer missed finishing: forget them
            live = set(jobs)
            self._started = {j: s for j, s in self._started.items() if j in live}
        return out

    def counters(self) -> dict[str, object]:
        """The counters as plain values."""
        return {
            "steps": self.steps,
            "defrag_steps": self.defrag_steps,
            "defrag_pairs": self.defrag_pairs,
            "defrag_bytes": self.defrag_bytes,
            "padded_pairs": self.padded_pairs,
            "transfer_jobs": dict(self.transfer_jobs),
            "transfer_bytes": dict(self.transfer_bytes),
            "transfer_failures": dict(self.transfer_failures),
        }


def live_figures() -> EngineFigures:
    """An observer for a serving Engine (ages timed by the monotonic clock)."""
    return EngineFigures(clock=time.monotonic)


@dataclass
class LogFigures:
    """What a fold of a whole log computes: the engine figures, its final state's gauges,
    and the recorder's records (checkpoints among them)."""

    figures: EngineFigures
    gauges: EngineGauges
    records: int
    checkpoints: int
    last_seq: int


def figures_of_log(path: str | os.PathLike[str]) -> LogFigures:
    """Fold the log at ``path`` from its start with an :class:`EngineFigures` on its lane."""
    figures = EngineFigures()
    fold = Fold(path, [Lane(Machine(observers=[figures]))], verify=False)
    if fold.reader.first_seq != 0:  # retention removed the start: from the first snapshot
        fold.start_from_snapshot(first=True)
    fold.run()
    last = max(fold.seq, fold.reader.last_seq)  # the reader counts a closed log's end record
    return LogFigures(
        figures, figures.gauges(fold.state), fold.num_records, fold.num_checkpoints, last
    )

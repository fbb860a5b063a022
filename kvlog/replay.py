"""Replay a log through the reducers: verify, diff against another log, or run a what-if.

``replay(path)`` re-runs every event of a log and checks every ``Checkpoint`` record
against the digest of the re-run state. The first divergence is reported precisely:

- an event the reducers refuse: its exact sequence number and the error;
- a checkpoint whose digest differs: the checkpoint's sequence number (the state diverged
  after the previous verified checkpoint and at or before it; a log holds events, not the
  states in between, so one log alone cannot say more);
- with ``against=OTHER_LOG`` (a re-run of the recorded log next to a re-run of an edited
  one): the exact sequence number of the first event that differs, both events, both
  digests after it and both plan lists.

Policy overrides (any ``CacheConfigured`` field but the geometry-free ones are allowed:
``threshold``, ``max_swaps``, ``defrag``, ``pad_sizes``...) run a what-if next to the
recorded policy: both runs see the same events and the result compares swaps, bytes moved
and the highest used block over time. ``execute=True`` applies the (effective) plans to
small CPU tensors filled with canary bytes and checks every live block at the end.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from kvlog import reducers
from kvlog.canary import CanaryReport, CanaryTracker, make_canary_executor
from kvlog.errors import CorruptLogError, InvalidEvent, NotConfigured
from kvlog.events import (
    STEP_EVENTS,
    CacheConfigured,
    Checkpoint,
    Event,
    Plan,
    Record,
    StepEnded,
    StepScheduled,
    TransferFinished,
    to_dict,
)
from kvlog.log import LogReader, first_snapshot, latest_snapshot
from kvlog.machine import Machine, Observer
from kvlog.memory import check_state_memory
from kvlog.reducers import running
from kvlog.report import Series
from kvlog.tally import PlanTally

if TYPE_CHECKING:
    from kvlog.executors import Executor

__all__ = [
    "POLICY_FIELDS",
    "Divergence",
    "ReplayResult",
    "RunStats",
    "WhatIf",
    "checkpoint_digest",
    "replay",
    "replay_state",
]

POLICY_FIELDS: tuple[str, ...] = ("defrag", "threshold", "max_swaps", "pad_sizes")
"""Fields a what-if may override without touching the recorded geometry."""
_ALL_FIELDS = tuple(CacheConfigured.__struct_fields__)

_log = logging.getLogger(__name__)
Progress = Callable[[int, int], None]
"""Called as ``progress(records_done, bytes_done_estimate)`` every few thousand records."""


@dataclass
class Divergence:
    """The first place where a re-run disagrees with what it is checked against."""

    kind: str  # "rejected" | "checkpoint" | "checkpoint-seq" | "snapshot" | "event" | "plans"
    # | "digest"
    seq: int  # the record where it was found (exact for rejected/event/plans)
    after_seq: int  # the last sequence number known to agree (-1: none)
    message: str
    event: dict[str, Any] | None = None
    other_event: dict[str, Any] | None = None
    expected_digest: str = ""
    actual_digest: str = ""
    expected_plans: list[dict[str, Any]] = field(default_factory=list)
    actual_plans: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class RunStats:
    """What one policy did over the whole log."""

    label: str
    config: CacheConfigured
    num_events: int = 0
    num_steps: int = 0
    num_swap_plans: int = 0
    num_swapped_blocks: int = 0
    swap_bytes: int = 0
    num_stores: int = 0
    num_loads: int = 0
    store_bytes: int = 0
    load_bytes: int = 0
    peak_max_used: int = -1
    sum_max_used: int = 0
    final_digest: str = ""
    rejected: Divergence | None = None
    series: Series | None = None

    @property
    def mean_max_used(self) -> float:
        return self.sum_max_used / self.num_steps if self.num_steps else 0.0

    @property
    def bytes_moved(self) -> int:
        return self.swap_bytes + self.store_bytes + self.load_bytes


@dataclass
class WhatIf:
    """A what-if run next to the recorded policy."""

    overrides: dict[str, Any]
    recorded: RunStats
    whatif: RunStats
    num_steps_max_used_differs: int = 0

    @property
    def differences(self) -> dict[str, tuple[Any, Any]]:
        """``{name: (recorded, whatif)}`` for every summary figure that differs."""
        names = (
            "num_swap_plans",
            "num_swapped_blocks",
            "swap_bytes",
            "store_bytes",
            "load_bytes",
            "peak_max_used",
            "sum_max_used",
            "final_digest",
        )
        out = {n: (getattr(self.recorded, n), getattr(self.whatif, n)) for n in names}
        out["steps_with_other_max_used"] = (0, self.num_steps_max_used_differs)
        return {n: v for n, v in out.items() if v[0] != v[1]}


@dataclass
class ReplayResult:
    """Everything a replay found."""

    path: str
    meta: dict[str, str]
    recorded_config: CacheConfigured | None
    num_records: int = 0
    num_events: int = 0
    num_checkpoints: int = 0
    num_verified: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    start_seq: int = 0
    last_seq: int = -1
    last_event_seq: int = -1
    final_digest: str = ""
    divergence: Divergence | None = None
    recorded: RunStats | None = None
    whatif: WhatIf | None = None
    canary: CanaryReport | None = None
    tail: str = ""
    elapsed_s: float = 0.0
    gaps: list[str] = field(default_factory=list)
    """Where the recorder detached after an I/O error (``LogDetached`` records)."""
    salvaged: str = ""
    """With ``salvage``: where and why the intact prefix ended ('' when the log is whole)."""

    @property
    def ok(self) -> bool:
        """No divergence, no failed canary."""
        return self.divergence is None and (self.canary is None or self.canary.ok)

    @property
    def events_per_s(self) -> float:
        return self.num_events / self.elapsed_s if self.elapsed_s > 0 else 0.0


def _plans_dicts(plans: list[Plan]) -> list[dict[str, Any]]:
    return [to_dict(p) for p in plans]


class _StatsObserver(Observer):
    """Counts what one policy did (``RunStats``), step by step: an observer of its machine."""

    def __init__(self, stats: RunStats) -> None:
        self.stats = stats
        self.tally = PlanTally(stats.config.page_size_bytes)

    def after(self, state: reducers.State, event: Event, plans: list[Plan]) -> None:
        self.stats.num_events += 1
        if plans:
            self.tally.add(plans)
        if isinstance(event, (StepEnded, StepScheduled)):
            self._end_step(state, event.step)

    def _end_step(self, state: reducers.State, step: int) -> None:
        s, t = self.stats, self.tally
        top = int(state.max_used)
        s.num_steps += 1
        s.peak_max_used = max(s.peak_max_used, top)
        s.sum_max_used += top
        if s.series is not None:
            s.series.add(
                step,
                int(state.num_used),
                top,
                t.step_blocks_moved,
                t.step_store_bytes,
                t.step_load_bytes,
            )
        t.end_step()

    def copy_totals(self) -> None:
        """The tally's run totals into ``RunStats`` (at the end of the run)."""
        s, t = self.stats, self.tally
        s.num_swap_plans, s.num_swapped_blocks, s.swap_bytes = (
            t.swap_plans,
            t.blocks_moved,
            t.swap_bytes,
        )
        s.num_stores, s.store_bytes = t.stores, t.store_bytes
        s.num_loads, s.load_bytes = t.loads, t.load_bytes


class _FinishedInLog(Observer):
    """Replaying with an executor: a logged ``TransferFinished`` first waits for that job
    on the replay's own executor (the recording's executor had finished it)."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor

    def before(self, state: reducers.State, event: Event) -> None:
        if type(event) is TransferFinished:
            self.executor.wait([event.job_id])


class _Run:
    """One policy fed a log's events: a machine, with its statistics as an observer."""

    def __init__(self, label: str, config: CacheConfigured, series: bool) -> None:
        self.stats = RunStats(label, config, series=Series(label) if series else None)
        self._observer = _StatsObserver(self.stats)
        self.machine = Machine(observers=[self._observer])
        self.alive = True

    @property
    def state(self) -> reducers.State:
        return self.machine.state

    def apply(self, event: Event) -> list[Plan]:
        return self.machine.apply(event)

    def finish(self) -> RunStats:
        self._observer.copy_totals()
        self.stats.final_digest = str(reducers.digest(self.state))
        return self.stats


def checkpoint_digest(state: reducers.State, recorded: str) -> str:
    """The state's digest by the algorithm a checkpoint's digest names: the running digest
    for ``"v2:..."`` (O(1)), else the canonical version-1 digest
    of the whole state."""
    if recorded.startswith(running.DIGEST_V2_PREFIX):
        return running.checkpoint_digest(state)
    return str(reducers.digest(state))


def _check_overrides(overrides: dict[str, Any]) -> None:
    unknown = sorted(set(overrides) - set(_ALL_FIELDS))
    if unknown:
        raise TypeError(f"unknown CacheConfigured field(s) to override: {unknown}")
    if "pad_sizes" in overrides:
        overrides["pad_sizes"] = tuple(overrides["pad_sizes"])


def _latest_snapshot(
    path: str, skip: frozenset[int] = frozenset()
) -> tuple[int, Checkpoint | None]:
    """Sequence number and record of the last checkpoint that carries a snapshot (but
    those at a sequence number in ``skip``): ``kvlog.log.latest_snapshot``."""
    return latest_snapshot(path, skip)


def replay_state(path: str | os.PathLike[str]) -> tuple[reducers.State, int]:
    """The state at the end of a log (from its latest snapshot, verified) and the sequence
    number of its last event; raises ``CorruptLogError`` on a divergence, so a resumed
    engine never continues a wrong state.

    A bad snapshot (one that does not restore, or restores another state than the log's
    events give there) is skipped with a warning: the replay starts again from the
    snapshot before it (or the log's start), and checks the bad one no more. Any other
    divergence raises."""
    path = os.fspath(path)
    skip: set[int] = set()
    while True:
        result, state = _replay(
            path, verify=True, from_snapshot=True, series=False, skip_snapshots=frozenset(skip)
        )
        d = result.divergence
        if d is None:
            return state, result.last_event_seq
        if d.kind != "snapshot" or d.seq in skip:
            raise CorruptLogError(f"replay diverged: {d.message}", path=result.path, seq=d.seq)
        _log.warning("%s: %s; replaying from the snapshot before it", path, d.message)
        skip.add(d.seq)


def replay(
    path: str | os.PathLike[str],
    verify: bool = True,
    *,
    against: str | os.PathLike[str] | None = None,
    execute: bool = False,
    backend: str = "cpu",
    from_snapshot: bool = False,
    series: bool = True,
    progress: Progress | None = None,
    salvage: bool = False,
    **policy_overrides: Any,
) -> ReplayResult:
    """Re-run the log at ``path``; see the module docstring.

    ``verify``: check every checkpoint digest. ``against``: compare event by event with a
    re-run of that log. ``execute``: apply the plans to canary-filled CPU tensors
    (``backend`` "cpu" or "fake") and check every live block at the end. ``from_snapshot``:
    start from the latest checkpoint snapshot (only for plain verification).
    ``salvage``: replay the intact prefix of a damaged log (``result.salvaged`` says where
    and why it stops). ``policy_overrides``: ``CacheConfigured`` fields for a what-if run.
    A log directory whose oldest segments are gone starts at its first snapshot.
    """
    _check_overrides(policy_overrides)
    if from_snapshot and (policy_overrides or against is not None or execute):
        raise ValueError(
            "from_snapshot replays the recorded policy only: no what-if, against or execute"
        )
    result, _ = _replay(
        os.fspath(path),
        verify=verify,
        against=None if against is None else os.fspath(against),
        execute=execute,
        backend=backend,
        from_snapshot=from_snapshot,
        series=series,
        progress=progress,
        overrides=policy_overrides,
        salvage=salvage,
    )
    return result


def _replay(
    path: str,
    *,
    verify: bool,
    against: str | None = None,
    execute: bool = False,
    backend: str = "cpu",
    from_snapshot: bool = False,
    series: bool = True,
    progress: Progress | None = None,
    overrides: dict[str, Any] | None = None,
    skip_snapshots: frozenset[int] = frozenset(),
    salvage: bool = False,
) -> tuple[ReplayResult, reducers.State]:
    replayer = _Replayer(path, verify, overrides or {}, against, execute, backend, series, progress)
    replayer.reader.salvage = salvage
    replayer.skip_snapshots = skip_snapshots
    started = time.perf_counter()
    replayer.run(from_snapshot)
    result = replayer.finish()
    result.elapsed_s = time.perf_counter() - started
    assert replayer.recorded is not None or result.divergence is not None or result.num_events == 0
    state = replayer.recorded.state if replayer.recorded is not None else reducers.initial_state()
    return result, state


class _Replayer:
    """The replay loop and everything it keeps between records."""

    def __init__(
        self,
        path: str,
        verify: bool,
        overrides: dict[str, Any],
        against: str | None,
        execute: bool,
        backend: str,
        series: bool,
        progress: Progress | None,
    ) -> None:
        self.reader = LogReader(path)
        self.verify = verify
        self.overrides = overrides
        self.execute = execute
        self.backend = backend
        self.series = series
        self.progress = progress
        self.result = ReplayResult(path, dict(self.reader.header.meta), None)
        self.recorded: _Run | None = None
        self.whatif: _Run | None = None
        self.other: _Other | None = None if against is None else _Other(against, series)
        self.tracker: CanaryTracker | None = None
        self.executor: Executor | None = None
        self.last_event_seq = -1
        self.last_event: Event | None = None
        self.last_verified_seq = -1
        self.num_steps_max_used_differs = 0
        self.stopped = False
        self.skip_snapshots: frozenset[int] = frozenset()
        """Snapshot checkpoints known bad (``replay_state``): not started from, not checked."""
        self.start_snapshot = -1  # the snapshot checkpoint the replay started from

    # -- setup ---------------------------------------------------------------------------
    def _start(self, config: CacheConfigured) -> None:
        self.result.recorded_config = config
        if type(config.num_gpu_blocks) is int:  # a bad one is refused by the reducers
            check_state_memory(config)
        self.recorded = _Run("recorded", config, self.series)
        if self.overrides:
            whatif_config = msgspec.structs.replace(config, **self.overrides)
            from kvlog.events import validate_event

            validate_event(whatif_config)
            self.whatif = _Run("what-if", whatif_config, self.series)
        if self.execute:
            effective = self.whatif or self.recorded
            self.executor, self.tracker = make_canary_executor(effective.stats.config, self.backend)
            effective.machine.executor = self.executor
            effective.machine.observers += [_FinishedInLog(self.executor), self.tracker]

    def _start_from_snapshot(self, first: bool = False) -> int:
        """Start from the latest snapshot (or the first record, a snapshot, of a log
        whose start retention removed: ``first``); the sequence number to go on from."""
        if first:
            seq, checkpoint = first_snapshot(self.reader.path)
        else:
            seq, checkpoint = _latest_snapshot(self.reader.path, self.skip_snapshots)
        if checkpoint is None:
            return self.reader.first_seq
        self.start_snapshot = seq
        try:
            state = reducers.restore(checkpoint.snapshot)
        except CorruptLogError as exc:
            self._bad_snapshot(seq, checkpoint, f"it does not restore ({exc})")
            self.stopped = True  # nothing to start from
            return seq + 1
        if state.config is None:
            raise CorruptLogError(
                "a checkpoint snapshot without a configuration", path=self.reader.path, seq=seq
            )
        if checkpoint_digest(state, checkpoint.digest) != checkpoint.digest:
            self._bad_snapshot(seq, checkpoint, "it restores another state than its digest")
            self.stopped = True
            return seq + 1
        self.result.recorded_config = state.config
        self.recorded = _Run("recorded", state.config, self.series)
        self.recorded.machine.state = state
        self.last_event_seq = checkpoint.seq
        self._checkpoint(seq, checkpoint)
        return seq + 1

    # -- the loop ------------------------------------------------------------------------
    def run(self, from_snapshot: bool) -> None:
        retained = self.reader.first_seq > 0  # a log directory without its oldest segments
        start = (
            self._start_from_snapshot(first=not from_snapshot) if from_snapshot or retained else 0
        )
        self.result.start_seq = start
        done_bytes = 0
        counts: collections.Counter[type] = collections.Counter()
        try:
            for seq, record in self.reader.records(start) if not self.stopped else ():
                self.result.num_records += 1
                counts[type(record)] += 1
                if isinstance(record, Checkpoint):
                    self._checkpoint(seq, record)
                else:
                    self._event(seq, record)
                if self.stopped:
                    break
                if self.progress is not None:
                    done_bytes += 16 + len(_encoded(record))
                    if self.result.num_records % 4096 == 0:
                        self.progress(self.result.num_records, done_bytes)
        finally:
            for record_type, count in counts.items():
                name = record_type.__name__
                self.result.counts[name] = self.result.counts.get(name, 0) + count
        self.result.last_seq = self.reader.last_seq
        self.result.last_event_seq = self.last_event_seq
        if self.reader.tail is not None:
            self.result.tail = str(self.reader.tail)
        self.result.gaps = [
            f"the recorder detached after seq {seq - 1}: {gap.error}"
            for seq, gap in self.reader.gaps
        ]
        if self.reader.stopped is not None:
            self.result.salvaged = str(self.reader.stopped)
        if self.other is not None and not self.stopped:
            self.other.at_end(self)

    def _event(self, seq: int, event: Event) -> None:
        self.result.num_events += 1
        if self.recorded is None:
            if type(event) is not CacheConfigured:
                self._diverge(
                    Divergence(
                        "rejected",
                        seq,
                        -1,
                        "the log does not start with CacheConfigured",
                        to_dict(event),
                    )
                )
                self.stopped = True
                return
            self._start(event)
        assert self.recorded is not None
        try:
            plans = self.recorded.apply(event)
        except InvalidEvent as exc:
            self._diverge(
                Divergence(
                    "rejected", seq, self.last_event_seq, f"seq {seq}: {exc}", to_dict(event)
                )
            )
            self.stopped = True
            return
        self._whatif(seq, event)
        if type(event) in STEP_EVENTS:
            self._compare_step()
        self.last_event_seq, self.last_event = seq, event
        if self.other is not None:
            self.other.compare(self, seq, event, plans)

    def _compare_step(self) -> None:
        """Count the steps where the what-if's highest used block differs."""
        run, recorded = self.whatif, self.recorded
        if run is None or not run.alive or recorded is None:
            return
        if run.state.max_used != recorded.state.max_used:
            self.num_steps_max_used_differs += 1

    def _whatif(self, seq: int, event: Event) -> list[Plan]:
        run = self.whatif
        if run is None or not run.alive:
            return []
        if type(event) is CacheConfigured:
            event = run.stats.config  # the what-if policy, on the recorded geometry
        try:
            return run.apply(event)
        except InvalidEvent as exc:
            run.alive = False
            run.stats.rejected = Divergence(
                "rejected",
                seq,
                self.last_event_seq,
                f"what-if refused seq {seq}: {exc}",
                to_dict(event),
            )
            return []

    def _checkpoint(self, seq: int, checkpoint: Checkpoint) -> None:
        self.result.num_checkpoints += 1
        if not self.verify or self.recorded is None:
            return
        if checkpoint.seq != self.last_event_seq:
            message = (
                f"checkpoint at seq {seq} covers seq {checkpoint.seq}, but the last "
                f"event before it is seq {self.last_event_seq}"
            )
            self._diverge(Divergence("checkpoint-seq", seq, self.last_verified_seq, message))
            return
        actual = checkpoint_digest(self.recorded.state, checkpoint.digest)
        if actual == checkpoint.digest:
            self.result.num_verified += 1
            self.last_verified_seq = checkpoint.seq
            if checkpoint.snapshot and seq != self.start_snapshot:
                self._check_snapshot(seq, checkpoint)
            return
        message = (
            f"state digest differs at the checkpoint after seq {checkpoint.seq}: it "
            f"diverged after seq {self.last_verified_seq} and at or before seq {checkpoint.seq}"
        )
        event = None if self.last_event is None else to_dict(self.last_event)
        self._diverge(
            Divergence(
                "checkpoint",
                checkpoint.seq,
                self.last_verified_seq,
                message,
                event,
                expected_digest=checkpoint.digest,
                actual_digest=actual,
            )
        )

    def _check_snapshot(self, seq: int, checkpoint: Checkpoint) -> None:
        """A snapshot passed on the way must restore to the state replayed up to it (whose
        digest its checkpoint just matched), as ``--parallel``'s segments check the
        snapshots they start from: flipped bytes under a valid frame CRC, or another
        checkpoint's snapshot, are a divergence. O(pool) per snapshot, as writing it was."""
        if seq in self.skip_snapshots:
            return
        try:
            restored = reducers.restore(checkpoint.snapshot)
        except CorruptLogError as exc:
            self._bad_snapshot(seq, checkpoint, f"it does not restore ({exc})")
            return
        if checkpoint_digest(restored, checkpoint.digest) != checkpoint.digest:
            self._bad_snapshot(seq, checkpoint, "it restores another state than the log's")

    def _bad_snapshot(self, seq: int, checkpoint: Checkpoint, why: str) -> None:
        message = f"the snapshot of the checkpoint at seq {seq} (after seq {checkpoint.seq}): {why}"
        self._diverge(Divergence("snapshot", seq, self.last_verified_seq, message))

    def _diverge(self, divergence: Divergence) -> None:
        if self.result.divergence is None:
            self.result.divergence = divergence

    # -- the end -------------------------------------------------------------------------
    def finish(self) -> ReplayResult:
        result = self.result
        if self.recorded is not None:
            result.recorded = self.recorded.finish()
            result.final_digest = result.recorded.final_digest
        if self.whatif is not None and result.recorded is not None:
            stats = self.whatif.finish()
            result.whatif = WhatIf(
                dict(self.overrides), result.recorded, stats, self.num_steps_max_used_differs
            )
        if self.tracker is not None:
            effective = self.whatif or self.recorded
            assert effective is not None and self.executor is not None, "execute without a run"
            self.executor.wait()
            result.canary = self.tracker.check(effective.state)
            self.executor.shutdown()
        return result


def _encoded(record: Record) -> bytes:
    from kvlog.events import encode

    return encode(record)


class _Other:
    """The log a replay is compared against (``against=``), re-run in lockstep."""

    def __init__(self, path: str, series: bool) -> None:
        self.path = path
        events = ((seq, r) for seq, r in LogReader(path).records() if not isinstance(r, Checkpoint))
        first = next(events, None)
        if first is not None and type(first[1]) is not CacheConfigured:
            raise NotConfigured(
                f"{path} does not start with CacheConfigured (seq {first[0]} is a "
                f"{type(first[1]).__name__}): it is not a log to compare against",
                first[1],
            )
        self.events: Iterator[tuple[int, Event]] = itertools.chain(
            [] if first is None else [first], events
        )
        self.run: _Run | None = None
        self.done = False

    def compare(self, replayer: _Replayer, seq: int, event: Event, plans: list[Plan]) -> None:
        if self.done:
            return
        assert replayer.recorded is not None
        nxt = next(self.events, None)
        if nxt is None:
            self._report(
                replayer,
                Divergence(
                    "event",
                    seq,
                    replayer.last_verified_seq,
                    f"seq {seq}: {self.path} ends before this event",
                    to_dict(event),
                ),
            )
            return
        other_seq, other_event = nxt
        if self.run is None:
            assert type(other_event) is CacheConfigured, "checked when the log was opened"
            check_state_memory(other_event)
            self.run = _Run("against", other_event, series=False)
        try:
            other_plans = self.run.apply(other_event)
        except InvalidEvent as exc:
            self._report(
                replayer,
                Divergence(
                    "rejected",
                    seq,
                    -1,
                    f"{self.path} seq {other_seq}: {exc}",
                    to_dict(event),
                    to_dict(other_event),
                ),
            )
            return
        if other_event == event and other_plans == plans:
            return
        kind = "event" if other_event != event else "plans"
        what = "events differ" if kind == "event" else "the same event planned differently"
        self._report(
            replayer,
            Divergence(
                kind,
                seq,
                seq - 1,
                f"seq {seq}: {what} ({self.path} seq {other_seq})",
                to_dict(event),
                to_dict(other_event),
                expected_digest=str(reducers.digest(self.run.state)),
                actual_digest=str(reducers.digest(replayer.recorded.state)),
                expected_plans=_plans_dicts(other_plans),
                actual_plans=_plans_dicts(plans),
            ),
        )

    def _report(self, replayer: _Replayer, divergence: Divergence) -> None:
        self.done = True
        replayer._diverge(divergence)

    def at_end(self, replayer: _Replayer) -> None:
        if self.done:
            return
        nxt = next(self.events, None)
        if nxt is not None:
            seq = replayer.last_event_seq + 1
            self._report(
                replayer,
                Divergence(
                    "event",
                    seq,
                    replayer.last_event_seq,
                    f"the log ends at seq {replayer.last_event_seq}; {self.path} goes on",
                    None,
                    to_dict(nxt[1]),
                ),
            )

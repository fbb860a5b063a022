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

Policy overrides (the policy fields of ``CacheConfigured``, ``kvlog.analysis.policy.POLICY_FIELDS``:
``threshold``, ``max_swaps``, ``defrag``, ``policy``...; the geometry stays the recorded
one) run a what-if next to the recorded policy: both runs see the same events and the
result compares swaps, bytes moved and the highest used block over time.
``execute=True`` applies the (effective) plans to small CPU tensors filled with canary
bytes and checks every live block at the end.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvlog import reducers
from kvlog.analysis.canary import CanaryReport, CanaryTracker, make_canary_executor
from kvlog.analysis.policy import POLICY_FIELDS
from kvlog.analysis.tally import RunResult, RunTally, Series
from kvlog.errors import ConfigError, InvalidEvent, NotConfigured
from kvlog.events import (
    STEP_EVENTS,
    CacheConfigured,
    Checkpoint,
    Event,
    Plan,
    TransferBatch,
    TransferFinished,
    to_dict,
)
from kvlog.events.difference import differing_fields, narrowed
from kvlog.log import LogReader
from kvlog.runtime.fold import (
    Divergence,
    Fold,
    Lane,
    Progress,
    checkpoint_digest,
)
from kvlog.runtime.machine import Machine, Observer
from kvlog.runtime.memory import check_state_memory

if TYPE_CHECKING:
    from kvlog.executors import Executor

__all__ = [
    "Divergence",
    "ReplayResult",
    "PolicyResult",
    "WhatIf",
    "checkpoint_digest",
    "replay",
]

_POLICY_FIELDS = frozenset(row.name for row in POLICY_FIELDS)


@dataclass
class PolicyResult(RunResult):
    """What one policy did over the whole log: its run's :class:`~kvlog.analysis.tally.RunTally`
    (read through ``RunResult``' names), its final digest, its refusal and its series."""

    label: str
    config: CacheConfigured
    tally: RunTally
    final_digest: str = ""
    rejected: Divergence | None = None
    series: Series | None = None


@dataclass
class WhatIf:
    """A what-if run next to the recorded policy."""

    overrides: dict[str, Any]
    recorded: PolicyResult
    whatif: PolicyResult
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
    recorded: PolicyResult | None = None
    whatif: WhatIf | None = None
    canary: CanaryReport | None = None
    tail: str = ""
    elapsed_s: float = 0.0
    gaps: list[str] = field(default_factory=list)
    """Where the recorder detached after an I/O error (``LogDetached`` records)."""
    salvaged: str = ""
    """With ``salvage``: where and why the intact prefix ended ('' when the log is whole,
    or every damage was gone past: ``damaged``)."""
    salvage_resume_seq: int = -1
    """With ``salvage``: where a valid record follows the damage it stopped at (``-1``:
    none), so ``past_damage`` would go on there."""
    damaged: list[str] = field(default_factory=list)
    """With ``past_damage``: each damaged range gone past (``kvlog.log.DamagedRange``, in
    words): not read."""
    unverified: list[tuple[int, int]] = field(default_factory=list)
    """With ``past_damage``: sequence numbers (first, last) from each damaged range to the
    snapshot the replay went on from (or to the end): not replayed, not verified."""
    retired: list[tuple[int, int]] = field(default_factory=list)
    """Sequence numbers (first, last) the writer's retention removed while the replay read
    the log: not read, not verified (it went on from the next segment's snapshot)."""
    closed_cleanly: bool = True
    """Whether the log's writer closed it (False: killed, crashed, never closed, or still
    writing; the replay reads it to its last durable record)."""
    from_snapshot: bool = False
    """Started from the latest snapshot (``from_snapshot``): the records before it were not
    replayed, and in a log directory the segments before it (``segments_not_read``) not
    read at all."""
    first_seq: int = 0
    """The log's first sequence number (above 0: retention removed its oldest segments)."""
    segments_not_read: int = 0
    """Segments of a log directory lying wholly before where the replay started."""
    unlisted: list[str] = field(default_factory=list)
    """Segment files the directory's manifest does not list: read without a SHA-256 check."""
    strays: list[str] = field(default_factory=list)
    """Files named like segments that hold no log and no manifest lists: not read."""

    @property
    def ok(self) -> bool:
        """No divergence, no failed canary."""
        return self.divergence is None and (self.canary is None or self.canary.ok)

    def describe(self) -> str:
        """One line: the log, what was checked, the verdict (``kvlog replay`` prints more)."""
        checked = (
            f"{self.num_events:,} events, {self.num_verified:,} of "
            f"{self.num_checkpoints:,} checkpoints verified"
        )
        if self.divergence is not None:
            d = self.divergence
            verdict = f"DIVERGENCE ({d.kind}) at seq {d.seq}: {d.message}"
        elif self.canary is not None and not self.canary.ok:
            verdict = f"canary failed: {self.canary.num_failed:,} blocks wrong"
        else:
            verdict = "verified"
        whatif = ""
        if self.whatif is not None:
            changed = ", ".join(f"{k}={v!r}" for k, v in self.whatif.overrides.items())
            whatif = f"; what-if {changed}"
        return f"{self.path}: {verdict} ({checked}{whatif})"

    def __repr__(self) -> str:
        """Short: the figures, not the per-step series (``describe()`` in words)."""
        return (
            f"ReplayResult(path={self.path!r}, ok={self.ok}, num_events={self.num_events}, "
            f"num_checkpoints={self.num_checkpoints}, num_verified={self.num_verified}, "
            f"final_digest={self.final_digest[:16]!r}..., "
            f"divergence={None if self.divergence is None else self.divergence.kind!r}, "
            f"whatif={self.whatif is not None})"
        )

    @property
    def events_per_s(self) -> float:
        return self.num_events / self.elapsed_s if self.elapsed_s > 0 else 0.0


def _plans_dicts(plans: list[Plan]) -> list[dict[str, Any]]:
    return [to_dict(p) for p in plans]


class _FinishedInLog(Observer):
    """Replaying with an executor: a logged ``TransferFinished`` first waits for that job
    on the replay's own executor (the recording's executor had finished it)."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor

    def before(self, state: reducers.State, event: Event) -> None:
        if type(event) is TransferFinished:
            self.executor.wait([event.job_id])
        elif type(event) is TransferBatch:  # the finishes of one poll (reducers/transfer_batch)
            finished = [e.job_id for e in event.events if type(e) is TransferFinished]
            if finished:
                self.executor.wait(finished)


class _TalliedLane:
    """One policy's :class:`Lane` of the fold with its :class:`RunTally` (and its
    :class:`Series`, if kept); ``finish`` makes its :class:`PolicyResult`."""

    def __init__(
        self,
        label: str,
        series: bool,
        overrides: dict[str, Any] | None = None,
        counted: bool = False,
    ) -> None:
        self.label = label
        self.series = Series(label) if series else None
        self.tally = RunTally(on_step=None if self.series is None else self._add_step)
        self.lane = Lane(Machine(observers=[self.tally]), overrides, label)
        self.lane.machine.counted_swaps = counted  # nothing executes or compares its plans

    def _add_step(self, summary: RunTally, state: reducers.State, step: int) -> None:
        assert self.series is not None, "a step hook only with a series"
        t = summary.plans
        self.series.add(
            step,
            int(state.num_used),
            int(state.max_used),
            t.step_blocks_moved,
            t.step_store_bytes,
            t.step_load_bytes,
            t.step_padded_pairs,
        )

    def finish(self, config: CacheConfigured) -> PolicyResult:
        state = self.lane.state
        return PolicyResult(
            self.label,
            self.tally.config or config,
            self.tally,
            final_digest=str(reducers.digest(state)),
            rejected=self.lane.rejected,
            series=self.series,
        )


def _check_overrides(overrides: dict[str, Any]) -> None:
    unknown = sorted(set(overrides) - _POLICY_FIELDS)
    if unknown:
        raise TypeError(
            f"not policy fields of CacheConfigured (a what-if keeps the geometry): {unknown}"
        )
    if "pad_sizes" in overrides:
        overrides["pad_sizes"] = tuple(overrides["pad_sizes"])


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
    past_damage: bool = False,
    **policy_overrides: Any,
) -> ReplayResult:
    """Re-run the log at ``path``; see the module docstring.

    ``verify``: check every checkpoint digest. ``against``: compare event by event with a
    re-run of that log. ``execute``: apply the plans to canary-filled CPU tensors
    (``backend`` "cpu" or "fake") and check every live block at the end. ``from_snapshot``:
    start from the latest checkpoint snapshot (only for plain verification).
    ``salvage``: replay the intact prefix of a damaged log (``result.salvaged`` says where
    and why it stops). ``past_damage`` (with ``salvage``): go on past damage followed by
    valid records, from the next checkpoint with a snapshot (restored, checked against its
    digest); ``result.damaged`` and ``result.unverified`` say what was not read, not
    verified; not with ``against`` or ``execute``. ``policy_overrides``:
    ``CacheConfigured`` fields for a what-if run.
    A log directory whose oldest segments are gone starts at its first snapshot; segments
    retention removes during the replay are skipped to the next segment's snapshot
    (``result.retired``), but under ``against`` or ``execute`` (``SegmentsRetired``).
    """
    _check_overrides(policy_overrides)
    if past_damage and (not salvage or against is not None or execute):
        raise ValueError("past_damage needs salvage, and neither against nor execute")
    if from_snapshot and (policy_overrides or against is not None or execute):
        raise ValueError(
            "from_snapshot replays the recorded policy only: no what-if, against or execute"
        )
    replayer = _Replayer(
        os.fspath(path),
        verify,
        policy_overrides,
        None if against is None else os.fspath(against),
        execute,
        backend,
        series,
    )
    replayer.fold.reader.salvage = salvage
    replayer.fold.reader.past_damage = past_damage
    started = time.perf_counter()
    replayer.run(from_snapshot, progress)
    result = replayer.finish()
    result.from_snapshot = from_snapshot
    result.elapsed_s = time.perf_counter() - started
    return result


class _Replayer:
    """A fold of the log with the recorded run, a what-if, ``against`` and canaries."""

    def __init__(
        self,
        path: str,
        verify: bool,
        overrides: dict[str, Any],
        against: str | None,
        execute: bool,
        backend: str,
        series: bool,
    ) -> None:
        self.overrides = overrides
        self.execute = execute
        self.backend = backend
        self.series = series
        self.counted = not execute and against is None  # plans only tallied: counted
        self.recorded = _TalliedLane("recorded", series, counted=self.counted)
        self.fold = Fold(path, [self.recorded.lane], verify=verify)
        self.fold.on_configured = self._start
        self.fold.on_restart = self._restart
        self.fold.on_event.append(self._compare_step)
        self.recorded_config: CacheConfigured | None = None
        self.whatif: _TalliedLane | None = None
        self.other: _Other | None = None
        if against is not None:
            self.other = _Other(against, self.fold)
            self.fold.on_event.append(self.other.compare)
        self.fold.follow_retired = against is None and not execute  # they need every event
        self.tracker: CanaryTracker | None = None
        self.executor: Executor | None = None
        self.num_steps_max_used_differs = 0

    def _start(self, config: CacheConfigured) -> None:
        """The log's configuration: the what-if lane (its configuration checked here, so a
        bad override raises) and the canary executor on the run whose plans count."""
        self.recorded_config = config
        if self.overrides:
            self.whatif = _TalliedLane("what-if", self.series, self.overrides, self.counted)
            self.whatif.lane.configured(config)
            self.fold.lanes.append(self.whatif.lane)
        if self.execute:
            effective = (self.whatif or self.recorded).lane
            self.executor, self.tracker = make_canary_executor(
                effective.configured(config), self.backend
            )
            effective.machine.executor = self.executor
            effective.machine.observers += [_FinishedInLog(self.executor), self.tracker]

    def run(self, from_snapshot: bool, progress: Progress | None) -> None:
        fold = self.fold
        retained = fold.reader.first_seq > 0  # a log directory without its oldest segments
        if retained and self.execute:
            raise ConfigError(
                "execute",
                True,
                f"a log from its first record: {fold.path} starts at seq "
                f"{fold.reader.first_seq} (retention removed its oldest segments), so the "
                "canary cannot know the bytes of blocks written before",
            )
        if from_snapshot or retained:
            fold.start_from_snapshot(first=not from_snapshot)
            config = fold.state.config
            self.recorded_config = config
            if config is not None:
                self.recorded.tally.configured(config)
                if self.overrides:  # a what-if from the first snapshot on
                    self._start_whatif_at_snapshot(config)
        fold.run(progress)
        if self.other is not None and not fold.stopped:
            self.other.at_end()

    def _restart(self, config: CacheConfigured) -> None:
        """Damage cut the log's ``CacheConfigured``: the runs start at the snapshot the
        fold goes on from (``past_damage``)."""
        self.recorded_config = config
        self.recorded.tally.configured(config)
        if self.overrides:
            self._start_whatif_at_snapshot(config)

    def _start_whatif_at_snapshot(self, config: CacheConfigured) -> None:
        """The what-if lane of a log that starts at a snapshot: the snapshot's state under
        the what-if's policy (its overrides checked here, so a bad one raises)."""
        self.whatif = _TalliedLane("what-if", self.series, self.overrides, self.counted)
        whatif_config = self.whatif.lane.configured(config)
        self.whatif.tally.configured(whatif_config)
        self.fold.add_lane(self.whatif.lane)

    def _compare_step(self, seq: int, event: Event, plans: list[Plan]) -> None:
        """Count the steps where the what-if's highest used block differs."""
        run = self.whatif
        if run is None or not run.lane.alive or type(event) not in STEP_EVENTS:
            return
        if run.lane.state.max_used != self.fold.state.max_used:
            self.num_steps_max_used_differs += 1

    def finish(self) -> ReplayResult:
        fold, config = self.fold, self.recorded_config
        tail = fold.reader.tail
        result = ReplayResult(
            fold.path,
            dict(fold.reader.header.meta),
            config,
            num_records=fold.num_records,
            num_events=fold.num_events,
            num_checkpoints=fold.num_checkpoints,
            num_verified=fold.num_verified,
            counts=dict(fold.counts),
            start_seq=fold.start_seq,
            last_seq=fold.reader.last_seq,
            last_event_seq=fold.last_event_seq,
            divergence=fold.divergence,
            tail="" if tail is None else str(tail),
        )
        result.gaps = [
            f"the recorder detached after seq {seq - 1}: {gap.error}"
            for seq, gap in fold.reader.gaps
        ]
        result.damaged = [str(d) for d in fold.reader.damaged]
        result.unverified = list(fold.unverified)
        if fold.reader.stopped is not None:
            result.salvaged = str(fold.reader.stopped)
            result.salvage_resume_seq = fold.reader.stopped.resume_seq
        result.retired = list(fold.retired)
        reader = fold.reader
        result.closed_cleanly = reader.closed_cleanly
        result.first_seq = reader.first_seq
        result.segments_not_read = reader.segments_before(fold.start_seq)
        result.unlisted, result.strays = list(reader.unlisted), list(reader.strays)
        if config is None:
            return result
        result.recorded = self.recorded.finish(config)
        result.final_digest = result.recorded.final_digest
        if self.whatif is not None:
            stats = self.whatif.finish(config)
            result.whatif = WhatIf(
                dict(self.overrides), result.recorded, stats, self.num_steps_max_used_differs
            )
        if self.tracker is not None:
            assert self.executor is not None, "a tracker comes with its executor"
            self.executor.wait()
            result.canary = self.tracker.check((self.whatif or self.recorded).lane.state)
            self.executor.shutdown()
        return result


class _Other:
    """The log a replay is compared against (``against=``), re-run in lockstep: a hook of
    the replay's fold, after every event the recorded run took."""

    def __init__(self, path: str, fold: Fold) -> None:
        self.path = path
        self.fold = fold
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
        self.machine: Machine | None = None
        self.done = False

    def compare(self, seq: int, event: Event, plans: list[Plan]) -> None:
        if self.done:
            return
        nxt = next(self.events, None)
        if nxt is None:
            message = f"seq {seq}: {self.path} ends before this event"
            self._report(Divergence("event", seq, seq - 1, message, to_dict(event)))
            return
        other_seq, other_event = nxt
        if self.machine is None:
            assert type(other_event) is CacheConfigured, "checked when the log was opened"
            check_state_memory(other_event)
            self.machine = Machine()
        try:
            other_plans = self.machine.apply(other_event)
        except InvalidEvent as exc:
            message = f"{self.path} seq {other_seq}: {exc}"
            self._report(
                Divergence("rejected", seq, seq - 1, message, to_dict(event), to_dict(other_event))
            )
            return
        if other_event == event and other_plans == plans:
            return
        kind = "event" if other_event != event else "plans"
        mine, theirs = to_dict(event), to_dict(other_event)
        fields = differing_fields(mine, theirs) if kind == "event" else []
        what = "the same event planned differently"
        if kind == "event":
            named = f"{type(event).__name__} differs in {', '.join(fields)}"
            what = named if fields else "events differ"
        self._report(
            Divergence(
                kind,
                seq,
                seq - 1,
                f"seq {seq}: {what} ({self.path} seq {other_seq})",
                narrowed(mine, fields),
                narrowed(theirs, fields),
                expected_digest=str(reducers.digest(self.machine.state)),
                actual_digest=str(reducers.digest(self.fold.state)),
                expected_plans=_plans_dicts(other_plans),
                actual_plans=_plans_dicts(plans),
            )
        )

    def _report(self, divergence: Divergence) -> None:
        self.done = True
        self.fold.record_divergence(divergence)

    def at_end(self) -> None:
        if self.done:
            return
        nxt = next(self.events, None)
        if nxt is not None:
            last = self.fold.last_event_seq
            self._report(
                Divergence(
                    "event",
                    last + 1,
                    last,
                    f"the log ends at seq {last}; {self.path} goes on",
                    None,
                    to_dict(nxt[1]),
                )
            )

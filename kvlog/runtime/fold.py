"""One fold of a log over Machines: the loop every reader of a log's events runs.

A :class:`Fold` reads a log's records (through ``kvlog.log``, never its bytes), from the
log's start or from a restored snapshot, up to a sequence number, and feeds every event to
its :class:`Lane`s: a lane is a :class:`~kvlog.runtime.machine.Machine` with the
``CacheConfigured`` fields it overrides. The first lane is the log's own run: its refusal
of an event is the fold's :class:`Divergence` and stops the fold. Any other lane is a
what-if on the same events, which its own first refusal stops alone. With ``verify`` every
``Checkpoint`` is checked here, once, against the first lane: the event it covers, its
digest, and that a snapshot passed on the way restores to the state replayed up to it.

Every reader of a log folds it with this: ``Engine.resume`` (:func:`state_at_end`),
``replay`` (verification, what-ifs, ``against``, canaries: observers and hooks on the
lanes), the sweep's what-ifs and its segment replay. Nothing here writes a log; what a run
did is its observers' business (``kvlog.analysis.tally.RunTally``).
"""

from __future__ import annotations

import collections
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvlog import reducers
from kvlog.errors import CorruptLogError, InvalidEvent, SegmentsRetired
from kvlog.events import (
    CacheConfigured,
    Checkpoint,
    Event,
    Plan,
    Record,
    encode,
    to_dict,
    validate_event,
)
from kvlog.log import LogReader, first_snapshot, latest_snapshot
from kvlog.reducers import checkpoint
from kvlog.runtime.machine import Machine
from kvlog.runtime.memory import check_state_memory

__all__ = [
    "Divergence",
    "Fold",
    "Lane",
    "Progress",
    "checkpoint_digest",
    "fold_to_end",
    "restore_snapshot",
    "state_at_end",
]

_log = logging.getLogger(__name__)
Progress = Callable[[int, int], None]
"""Called as ``progress(records_done, bytes_done_estimate)`` every few thousand records."""
_PROGRESS_EVERY = 4096
_SAMPLE_EVERY = 64  # one event in this many is measured for the byte estimate
_FRAME_BYTES = 16  # a record's frame header


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


def checkpoint_digest(state: reducers.State, recorded: str) -> str:
    """The state's digest by the algorithm a checkpoint's digest names: the running digest
    for ``"v2:..."`` (O(1)), else the canonical version-1 digest of the whole state."""
    if recorded.startswith(checkpoint.DIGEST_V2_PREFIX):
        return checkpoint.checkpoint_digest(state)
    return str(reducers.digest(state))


def restore_snapshot(blob: bytes, digest: str, path: str, seq: int) -> reducers.State | str:
    """The state a checkpoint's snapshot holds, checked against the checkpoint's digest;
    else why not (a sentence). A snapshot of a state before ``CacheConfigured`` (no log
    writes one) raises ``CorruptLogError`` naming the log and the checkpoint's ``seq``."""
    try:
        state = reducers.restore(blob)
    except CorruptLogError as exc:
        return f"it does not restore ({exc})"
    if state.config is None:
        raise CorruptLogError("a checkpoint snapshot without a configuration", path=path, seq=seq)
    if checkpoint_digest(state, digest) != digest:
        return "it restores another state than its checkpoint's digest"
    return state


class Lane:
    """A machine a fold feeds, and the ``CacheConfigured`` fields it runs with instead of
    the log's (a what-if); ``rejected``: its first refusal, after which it is fed no more."""

    __slots__ = ("label", "machine", "overrides", "rejected")

    def __init__(
        self,
        machine: Machine | None = None,
        overrides: Mapping[str, Any] | None = None,
        label: str = "",
    ) -> None:
        self.machine = Machine() if machine is None else machine
        self.overrides = dict(overrides or {})
        self.label = label
        self.rejected: Divergence | None = None

    @property
    def state(self) -> reducers.State:
        return self.machine.state

    @property
    def alive(self) -> bool:
        return self.rejected is None

    def configured(self, event: CacheConfigured) -> CacheConfigured:
        """The log's configuration with this lane's overrides (``InvalidEvent`` for a
        combination the validator refuses)."""
        if not self.overrides:
            return event
        config = msgspec.structs.replace(event, **self.overrides)
        validate_event(config)
        return config


EventHook = Callable[[int, Event, list[Plan]], None]
"""Called as ``hook(seq, event, plans)`` after every lane took an event (the first lane's
plans)."""


class Fold:
    """One pass over the log at ``path`` (module docstring); ``run`` it once."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        lanes: Sequence[Lane] = (),
        *,
        verify: bool = True,
        stop_seq: int = -1,
        skip_snapshots: frozenset[int] = frozenset(),
    ) -> None:
        self.reader = LogReader(path)
        self.path = self.reader.path
        self.lanes = list(lanes) or [Lane()]
        self.verify = verify
        self.stop_seq = stop_seq
        """The last record to read (-1: the log's end)."""
        self.skip_snapshots = skip_snapshots
        """Snapshot checkpoints known bad: not started from, not checked."""
        self.start_seq = 0
        self.start_snapshot = -1  # the snapshot checkpoint the fold started from
        self._start_snapshot_record: Checkpoint | None = None
        self.num_records = self.num_events = self.num_checkpoints = self.num_verified = 0
        self.counts: collections.Counter[str] = collections.Counter()
        """Records read, by type name."""
        self.seq = -1  # the record being folded
        self.last_event_seq = -1
        self.last_event: Event | None = None
        self.last_verified_seq = -1
        self.divergence: Divergence | None = None
        self.stopped = False
        self.done_bytes = 0  # the progress estimate
        self.follow_retired = True
        """Go on past segments retention removes during the read (``run``); a caller whose
        hooks need every event (``against``, canaries) turns it off."""
        self.retired: list[tuple[int, int]] = []
        """The sequence numbers (first, last) retention removed during the read: not read,
        not verified."""
        self.unverified: list[tuple[int, int]] = []
        """With a reader that goes past damage (``LogReader.past_damage``): the sequence
        numbers (first, last) from each damaged range (``reader.damaged``: not read) to
        the snapshot the fold went on from (read, not folded), or to the end: not
        verified."""
        self._damage_seen = 0  # how many of reader.damaged the fold took in
        self._lost_from = -1  # the first seq not verified since damage (-1: not lost)
        self.on_configured: Callable[[CacheConfigured], None] | None = None
        """Called with the log's ``CacheConfigured`` before any lane takes it (a caller may
        add lanes there)."""
        self.on_event: list[EventHook] = []
        self.on_restart: Callable[[CacheConfigured], None] | None = None
        """Called with a snapshot's configuration when the fold goes on from it past damage
        before it ever took the log's ``CacheConfigured`` (damage cut it; a caller may
        add lanes there, as at ``on_configured``)."""

    @property
    def lane(self) -> Lane:
        """The log's own run (the first lane)."""
        return self.lanes[0]

    @property
    def state(self) -> reducers.State:
        return self.lanes[0].machine.state

    @property
    def configured(self) -> bool:
        return self.state.config is not None

    # -- where it starts -----------------------------------------------------------------
    def start_at(self, state: reducers.State, last_event_seq: int, start_seq: int) -> None:
        """Start from ``state`` (a restored snapshot covering ``last_event_seq``): the
        first lane takes it, and records are read from ``start_seq`` on."""
        self.lanes[0].machine.state = state
        self.last_event_seq = last_event_seq
        self.start_seq = start_seq

    def start_from_latest_snapshot(self) -> None:
        """Start from the log's latest snapshot (its checkpoint counts as verified); a bad
        one is the fold's divergence (kind ``"snapshot"``) and nothing is read."""
        self.start_from_snapshot()

    def start_from_snapshot(self, first: bool = False) -> None:
        """``start_from_latest_snapshot``, or with ``first`` from the log's first record, a
        snapshot (a log directory whose oldest segments retention removed)."""
        if first:
            seq, checkpoint = first_snapshot(self.path)
        else:
            seq, checkpoint = latest_snapshot(self.path, self.skip_snapshots)
        if checkpoint is None:
            self.start_seq = self.reader.first_seq
            return
        self.start_snapshot, self.start_seq = seq, seq + 1
        state = restore_snapshot(checkpoint.snapshot, checkpoint.digest, self.path, seq)
        if isinstance(state, str):
            self._bad_snapshot(seq, checkpoint, state)
            self.stopped = True  # nothing to start from
            return
        self._start_snapshot_record = checkpoint
        self.start_at(state, checkpoint.seq, seq + 1)
        self._seat(self.lanes[0], state)
        for lane in self.lanes[1:]:
            self.add_lane(lane, append=False)
        self._checkpoint(seq, checkpoint)

    def add_lane(self, lane: Lane, append: bool = True) -> None:
        """Fold ``lane`` too from here: a fold that started from a snapshot gives it the
        snapshot's state under its own policy (a what-if from that point on)."""
        if append:
            self.lanes.append(lane)
        checkpoint = self._start_snapshot_record
        if checkpoint is None:
            return
        state = restore_snapshot(
            checkpoint.snapshot, checkpoint.digest, self.path, self.start_snapshot
        )
        assert not isinstance(state, str), "the start snapshot restored once: fold bug"
        self._seat(lane, state)

    @staticmethod
    def _seat(lane: Lane, state: reducers.State) -> None:
        """``lane`` runs on from ``state``, under its overrides."""
        lane.machine.state = state
        if lane.overrides and state.config is not None:
            state.adopt_policy(lane.configured(state.config))

    # -- the loop ------------------------------------------------------------------------
    def run(self, progress: Progress | None = None) -> Fold:
        """Fold every record from ``start_seq`` to ``stop_seq`` (or the first divergence).

        Segments the writer's retention removes while they are read (``SegmentsRetired``):
        with ``follow_retired`` the fold goes on from the snapshot that opens the oldest
        segment still there, and notes the sequence numbers it did not read in
        ``retired``; else, or when nothing later is left, the error is raised."""
        if self.stopped:
            return self
        start = self.start_seq
        if self.last_event_seq >= 0 and start < self.reader.first_seq:
            # a fold seated on a state reads on where retention has already cut the log
            # (a live view polling a directory): the records in between are gone
            gone = SegmentsRetired(self.path, start, self.reader.first_seq)
            if not self.follow_retired:
                raise gone
            start = self._resume_after_retired(gone)
            if self.stopped:
                return self
        while True:
            try:
                self._read(start, progress)
                self._end_damage()
                return self
            except SegmentsRetired as exc:
                if not self.follow_retired or exc.resume_seq < 0:
                    raise
                start = self._resume_after_retired(exc)
                if self.stopped:
                    return self

    def _read(self, start_seq: int, progress: Progress | None) -> None:
        stop = self.stop_seq
        for seq, record in self.reader.records(start_seq):
            if 0 <= stop < seq:
                break
            self.seq = seq
            if self.reader.damaged and self._past_damage(seq, record):
                if self.stopped:
                    break
                continue
            self.num_records += 1
            self.counts[type(record).__name__] += 1
            if isinstance(record, Checkpoint):
                self._checkpoint(seq, record)
                self.done_bytes += _FRAME_BYTES + 64 + len(record.snapshot)
            else:
                self._event(seq, record)
                if self.num_events % _SAMPLE_EVERY == 0:  # an estimate, not a re-encoding
                    self.done_bytes += _SAMPLE_EVERY * (_FRAME_BYTES + len(encode(record)))
            if self.stopped:
                break
            if progress is not None and self.num_records % _PROGRESS_EVERY == 0:
                progress(self.num_records, self.done_bytes)

    def _resume_after_retired(self, exc: SegmentsRetired) -> int:
        """Seat every lane on the snapshot that opens the segment at ``exc.resume_seq``
        (read, not verified: the events before it are gone) and note the records skipped;
        the sequence number to read on from."""
        try:
            seq, record = next(iter(self.reader.records(exc.resume_seq)), (-1, None))
        except SegmentsRetired as again:  # that segment went too
            if again.resume_seq < 0:
                raise
            return self._resume_after_retired(
                SegmentsRetired(self.path, exc.first_seq, again.resume_seq)
            )
        checkpoint = record if type(record) is Checkpoint and record.snapshot else None
        if checkpoint is None:
            raise CorruptLogError(
                "the segment a read goes on from after retention removed the ones before "
                "it does not start with a snapshot",
                path=self.path,
                seq=exc.resume_seq,
            ) from exc
        self.retired.append((exc.first_seq, seq - 1))
        _log.warning("%s: %s; not verified: seq %d-%d", self.path, exc, exc.first_seq, seq - 1)
        self._go_on_from(seq, checkpoint)
        return seq + 1

    def _go_on_from(self, seq: int, checkpoint: Checkpoint) -> None:
        """Seat every live lane on ``checkpoint``'s snapshot (read, checked against its
        digest, not counted verified: the events before it were not folded); a bad one
        is the fold's divergence and stops it."""
        self.num_records += 1
        self.num_checkpoints += 1
        self.counts["Checkpoint"] += 1
        if not self.configured and self.on_restart is not None:
            first = restore_snapshot(checkpoint.snapshot, checkpoint.digest, self.path, seq)
            if not isinstance(first, str) and first.config is not None:
                self.on_restart(first.config)
        for lane in self.lanes:  # the first is alive: its refusal stopped the fold
            if not lane.alive:
                continue
            state = restore_snapshot(checkpoint.snapshot, checkpoint.digest, self.path, seq)
            if isinstance(state, str):
                self._bad_snapshot(seq, checkpoint, state)
                self.stopped = True
                return
            self._seat(lane, state)
        self.seq = seq
        self.last_event_seq = self.last_verified_seq = checkpoint.seq
        self.last_event = None

    def _past_damage(self, seq: int, record: Record) -> bool:
        """Whether ``record`` lies after damage the reader went past and before the next
        snapshot (read, not folded: the state misses the records not read); the snapshot
        itself seats the lanes and the fold goes on from it."""
        self._take_damage()
        if self._lost_from < 0:
            return False
        if type(record) is Checkpoint and record.snapshot:
            self.unverified.append((self._lost_from, seq - 1))
            self._lost_from = -1
            self._go_on_from(seq, record)
        else:
            self.num_records += 1
            self.counts[type(record).__name__] += 1
        return True

    def _take_damage(self) -> None:
        """The fold is lost from the first record of the damage gone past since it last
        looked (a range that lost no record loses nothing)."""
        damaged = self.reader.damaged
        for damage in damaged[self._damage_seen :]:
            if self._lost_from < 0 and damage.first_seq < damage.resume_seq:
                self._lost_from = damage.first_seq
        self._damage_seen = len(damaged)

    def _end_damage(self) -> None:
        """At the end of the read: the records from damage on that no snapshot followed."""
        self._take_damage()
        if self._lost_from >= 0:
            last = max(self.reader.last_seq, self.reader.damaged[-1].resume_seq - 1)
            self.unverified.append((self._lost_from, last))
            self._lost_from = -1

    def _event(self, seq: int, event: Event) -> None:
        self.num_events += 1
        if type(event) is CacheConfigured and not self.configured:
            if self.on_configured is not None:
                self.on_configured(event)
        elif not self.configured:
            message = f"seq {seq}: the log does not start with CacheConfigured"
            self.record_divergence(Divergence("rejected", seq, -1, message, to_dict(event)))
            self.stopped = True
            return
        first, *others = self.lanes
        try:
            plans = first.machine.apply_decoded(self._lane_event(first, event))
        except InvalidEvent as exc:
            message = f"seq {seq}: {exc}"
            self.record_divergence(
                Divergence("rejected", seq, self.last_event_seq, message, to_dict(event))
            )
            self.stopped = True
            return
        for lane in others:
            if lane.alive:
                self._feed(lane, seq, event)
        self.last_event_seq, self.last_event = seq, event
        for hook in self.on_event:
            hook(seq, event, plans)

    def _lane_event(self, lane: Lane, event: Event) -> Event:
        if type(event) is not CacheConfigured:
            return event
        config = lane.configured(event)
        if type(config.num_gpu_blocks) is int:  # a bad one is refused by the reducers
            check_state_memory(config)
        return config

    def _feed(self, lane: Lane, seq: int, event: Event) -> None:
        """A what-if lane takes the event; its refusal stops it alone."""
        try:
            lane.machine.apply_decoded(self._lane_event(lane, event))
        except InvalidEvent as exc:
            message = f"{lane.label or 'what-if'} refused seq {seq}: {exc}"
            lane.rejected = Divergence(
                "rejected", seq, self.last_event_seq, message, to_dict(event)
            )

    # -- checkpoints ---------------------------------------------------------------------
    def _checkpoint(self, seq: int, checkpoint: Checkpoint) -> None:
        self.num_checkpoints += 1
        if not self.verify or not self.configured:
            return
        if checkpoint.seq != self.last_event_seq:
            message = (
                f"checkpoint at seq {seq} covers seq {checkpoint.seq}, but the last "
                f"event before it is seq {self.last_event_seq}"
            )
            self.record_divergence(
                Divergence("checkpoint-seq", seq, self.last_verified_seq, message)
            )
            return
        actual = checkpoint_digest(self.state, checkpoint.digest)
        if actual == checkpoint.digest:
            self.num_verified += 1
            self.last_verified_seq = checkpoint.seq
            if checkpoint.snapshot and seq != self.start_snapshot:
                self._check_snapshot(seq, checkpoint)
            return
        message = (
            f"state digest differs at the checkpoint after seq {checkpoint.seq}: it "
            f"diverged after seq {self.last_verified_seq} and at or before seq {checkpoint.seq}"
        )
        event = None if self.last_event is None else to_dict(self.last_event)
        self.record_divergence(
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
        """A snapshot passed on the way must restore to the state folded up to it (whose
        digest its checkpoint just matched): flipped bytes under a valid frame CRC, or
        another checkpoint's snapshot, are a divergence. O(pool) per snapshot, as writing
        it was."""
        if seq in self.skip_snapshots:
            return
        try:
            state = restore_snapshot(checkpoint.snapshot, checkpoint.digest, self.path, seq)
        except CorruptLogError as exc:  # no configuration: not the state folded here
            state = str(exc)
        if isinstance(state, str):
            self._bad_snapshot(seq, checkpoint, state)

    def _bad_snapshot(self, seq: int, checkpoint: Checkpoint, why: str) -> None:
        message = f"the snapshot of the checkpoint at seq {seq} (after seq {checkpoint.seq}): {why}"
        self.record_divergence(Divergence("snapshot", seq, self.last_verified_seq, message))

    def record_divergence(self, divergence: Divergence) -> None:
        """Keep the first divergence (a checkpoint's does not stop the fold); a caller's
        hook (``against``) records what it finds here too."""
        if self.divergence is None:
            self.divergence = divergence


def state_at_end(path: str | os.PathLike[str]) -> tuple[reducers.State, int]:
    """The state at the end of a log (from its latest snapshot, verified) and the sequence
    number of its last event (``fold_to_end``)."""
    fold = fold_to_end(path)
    return fold.state, fold.last_event_seq


def fold_to_end(path: str | os.PathLike[str]) -> Fold:
    """The fold of a log from its latest snapshot to its end, verified; raises
    ``CorruptLogError`` on a divergence, so a resumed engine never continues a wrong state.
    In a log directory the segments before that snapshot are not read
    (``fold.reader.segments_before(fold.start_seq)``).

    A bad snapshot (one that does not restore, or restores another state than the log's
    events give there) is skipped with a warning: the fold starts again from the snapshot
    before it (or the log's start), and checks the bad one no more. Any other divergence
    raises."""
    path = os.fspath(path)
    skip: set[int] = set()
    while True:
        fold = Fold(path, verify=True, skip_snapshots=frozenset(skip))
        fold.start_from_latest_snapshot()
        fold.run()
        d = fold.divergence
        if d is None:
            return fold
        if d.kind != "snapshot" or d.seq in skip:
            raise CorruptLogError(f"replay diverged: {d.message}", path=path, seq=d.seq)
        _log.warning("%s: %s; replaying from the snapshot before it", path, d.message)
        skip.add(d.seq)

"""Ranks agree: the logs of the tensor-parallel workers of one server made the same decisions.

Under tensor parallelism every worker runs the same defragmenter on the same scheduler output
(``KVLOG_PATH=.../worker-{pid}.kvlog``: one log per rank). ``compare_ranks`` reads the logs in
lockstep and checks, record by record, that

- their events are the same modulo rank-local fields: ``CacheConfigured.page_size_bytes``
  (each rank holds its own shard of the heads) and the random per-process nonce in the
  request ids of load placeholders (``kvlog.integrations.session.HOLD_PREFIX``);
- every rank's checkpoints verify against its own events re-run (its live state was what its
  events say), wherever its log put them (a log directory adds one at each segment's start,
  and ranks rotate at their own byte counts);
- while the ranks' events are byte-identical, checkpoints taken after the same number of
  events carry the same digest on every rank. (Once a rank-local field differs the digests
  differ too, as they hash request ids; equal normalized events re-run to equal states, so
  the checks together say the ranks' states agree modulo those names.)

The first event where one rank differs from rank 0 is named: its sequence number (rank 0's;
the other rank's when they differ), the scheduler step it falls in, and both events. A rank
whose log ends early differs there too. Every log may be a file or a directory of segments;
directories whose retention removed different oldest segments (the logs start at different
sequence numbers) cannot be read in lockstep and are refused (ConfigError), not reported as
ranks that differ.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvlog import reducers
from kvlog.errors import ConfigError, InvalidEvent
from kvlog.events import STEP_EVENTS, CacheConfigured, Checkpoint, Event, Record, to_dict
from kvlog.log import LogReader
from kvlog.machine import Machine
from kvlog.reducers import running

__all__ = ["HOLD_PREFIX", "RankDifference", "RanksResult", "compare_ranks", "normalize"]

HOLD_PREFIX = "kvlog-load-hold-"
"""``kvlog.integrations.session.HOLD_PREFIX`` (not imported: that module needs torch)."""
_HOLD_NONCE = re.compile(re.escape(HOLD_PREFIX) + r"[0-9a-f]{16}-")
_RANK_LOCAL = {"CacheConfigured": ("page_size_bytes",)}


@dataclass
class RankDifference:
    """Where rank ``rank`` first differs from rank 0."""

    rank: int
    seq: int
    step: int
    what: str
    expected: dict[str, Any] | None
    actual: dict[str, Any] | None

    def __str__(self) -> str:
        return (
            f"rank {self.rank} differs from rank 0 at seq {self.seq} (step {self.step}): "
            f"{self.what}\n  rank 0: {self.expected}\n  rank {self.rank}: {self.actual}"
        )


@dataclass
class RanksResult:
    paths: list[str]
    num_records: int = 0
    num_events: int = 0
    num_checkpoints: int = 0
    num_steps: int = 0
    difference: RankDifference | None = None
    normalized: list[str] = field(default_factory=list)
    """The rank-local fields that differed (and were normalized)."""

    @property
    def ok(self) -> bool:
        return self.difference is None


def normalize(record: Record) -> dict[str, Any]:
    """A record as a dict with its rank-local fields made the same on every rank."""
    out = _plain(to_dict(record))
    for name in _RANK_LOCAL.get(type(record).__name__, ()):
        out[name] = 0
    if type(record) is Checkpoint:  # its digest and snapshot hash request ids: the digest
        out.pop("snapshot", None)  # is compared on its own (``_digests_differ``)
        out.pop("digest", None)
    return out  # type: ignore[no-any-return]


def _plain(value: Any) -> Any:
    if isinstance(value, str):
        return _HOLD_NONCE.sub(HOLD_PREFIX, value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


class _Rank:
    """One rank's log, read event by event; its checkpoints checked against its re-run."""

    def __init__(self, path: str) -> None:
        self.path = path
        reader = LogReader(path)
        self.first_seq = reader.first_seq
        """The sequence number of its first record (above 0: retention removed segments)."""
        self.records: Iterator[tuple[int, Record]] = reader.records()
        self.machine: Machine | None = None
        self.num_events = 0
        self.num_checkpoints = 0
        self.digests: dict[int, str] = {}
        """Recorded digest of the checkpoint after each number of events (the latest)."""

    def next_event(self, step: int) -> tuple[int, Event] | RankDifference | None:
        """The next event (its checkpoints on the way verified), None at the end, or the
        difference a checkpoint that does not verify is (``rank`` filled in by the caller)."""
        for seq, record in self.records:
            if type(record) is not Checkpoint:
                return seq, record  # type: ignore[return-value]
            self.num_checkpoints += 1
            actual = "" if self.machine is None else running.checkpoint_digest(self.machine.state)
            if actual and actual != record.digest:
                what = "its recorded state digest is not its events' (its live state diverged)"
                return RankDifference(
                    -1, seq, step, what, {"digest": actual}, {"digest": record.digest}
                )
            self.digests[self.num_events] = record.digest
        return None

    def apply(self, event: Event) -> None:
        if type(event) is CacheConfigured:
            self.machine = Machine(reducers.initial_state())
        if self.machine is not None:
            self.machine.apply(event)
        self.num_events += 1


def compare_ranks(paths: Sequence[str | os.PathLike[str]]) -> RanksResult:
    """Compare the logs of the ranks of one server (see the module docstring)."""
    ranks = [_Rank(os.fspath(p)) for p in paths]
    _check_same_start(ranks)
    result = RanksResult([r.path for r in ranks])
    identical = True  # every rank's events byte-identical so far
    step = 0
    while result.difference is None:
        row: Row = []
        for index, rank in enumerate(ranks):
            item = rank.next_event(step)
            if isinstance(item, RankDifference):
                result.difference = _ranked(index, item)
                break
            row.append(item)
        result.difference = result.difference or _first_difference(row, step)
        events = [item for item in row if item is not None]
        if result.difference is not None or len(events) < len(ranks):
            break
        event = events[0][1]
        identical = identical and all(e == event for _, e in events)
        if not identical and not result.normalized:
            result.normalized = _local_fields(events)
        result.difference = _apply_all(ranks, events, step)
        result.difference = result.difference or _digests_differ(ranks, identical, events, step)
        result.num_events += 1
        step += type(event) in STEP_EVENTS
    result.num_checkpoints = ranks[0].num_checkpoints
    result.num_records = result.num_events + result.num_checkpoints
    result.num_steps = step
    return result


def _check_same_start(ranks: Sequence[_Rank]) -> None:
    """Lockstep pairs the ranks' events from their logs' first records: a log that lost its
    oldest segments to retention while another kept them would differ at its first event
    though the ranks agreed, so it is refused (naming it) instead."""
    for rank in ranks[1:]:
        if rank.first_seq != ranks[0].first_seq:
            raise ConfigError(
                "LOG",
                rank.path,
                f"a log that starts where {ranks[0].path!r} does (sequence number "
                f"{ranks[0].first_seq:,}), not at {rank.first_seq:,}: retention removed one "
                "log's oldest segments, so the ranks cannot be read in lockstep",
            )


def _ranked(rank: int, difference: RankDifference) -> RankDifference:
    difference.rank = rank
    return difference


Row = list[tuple[int, Event] | None]


def _first_difference(row: Row, step: int) -> RankDifference | None:
    first = row[0]
    expected = None if first is None else normalize(first[1])
    for rank, item in enumerate(row[1:], 1):
        if item is None and first is None:
            continue
        actual = None if item is None else normalize(item[1])
        if item is None or first is None:
            what = "the log ends here" if item is None else "rank 0's log ends here"
            seq = first[0] if first is not None else item[0] if item is not None else -1
            return RankDifference(rank, seq, step, what, expected, actual)
        if actual != expected:
            what = f"a different {type(item[1]).__name__}"
            if type(item[1]) is not type(first[1]):
                what = f"a {type(item[1]).__name__} where rank 0 has a {type(first[1]).__name__}"
            if item[0] != first[0]:
                what += f" (its seq {item[0]})"
            return RankDifference(rank, first[0], step, what, expected, actual)
    return None


def _local_fields(row: list[tuple[int, Event]]) -> list[str]:
    """Which rank-local fields differ in this row (for the report)."""
    names = []
    events = [r[1] for r in row]
    for name in _RANK_LOCAL.get(type(events[0]).__name__, ()):
        if len({getattr(e, name) for e in events}) > 1:
            names.append(f"{type(events[0]).__name__}.{name}")
    return names or ["load placeholder ids"]


def _apply_all(
    ranks: list[_Rank], row: list[tuple[int, Event]], step: int
) -> RankDifference | None:
    for rank, (state, (seq, event)) in enumerate(zip(ranks, row, strict=True)):
        try:
            state.apply(event)
        except InvalidEvent as exc:
            return RankDifference(rank, seq, step, f"its events do not replay: {exc}", None, None)
    return None


def _digests_differ(
    ranks: list[_Rank], identical: bool, row: list[tuple[int, Event]], step: int
) -> RankDifference | None:
    """While the events are identical: the checkpoints every rank took after the same
    number of events (before this one) carry the same digest."""
    count = ranks[0].num_events - 1
    if not identical or count not in ranks[0].digests:
        return None
    expected = ranks[0].digests.pop(count)
    for rank, state in enumerate(ranks[1:], 1):
        digest = state.digests.pop(count, None)
        if digest is not None and digest != expected:
            what = "the recorded state digest differs at the checkpoint before this event"
            return RankDifference(
                rank, row[0][0], step, what, {"digest": expected}, {"digest": digest}
            )
    return None

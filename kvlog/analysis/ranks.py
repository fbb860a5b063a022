"""Ranks agree: the logs of the tensor-parallel workers of one server made the same decisions.

Under tensor parallelism every worker runs the same defragmenter on the same scheduler output
(``KVLOG_PATH=.../worker-{pid}.kvlog``: one log per rank). ``compare_ranks`` reads the logs in
lockstep and checks, record by record, that

- their events are the same modulo rank-local fields: ``CacheConfigured.page_size_bytes``
  (each rank holds its own shard of the heads) and the random per-process nonce in the
  request ids of load placeholders (``kvlog.events.HOLD_PREFIX``);
- every rank's checkpoints verify against its own events re-run (its live state was what its
  events say), wherever its log put them (a log directory adds one at each segment's start,
  and ranks rotate at their own byte counts);
- while the ranks' events are byte-identical, checkpoints taken after the same number of
  events carry the same digest on every rank. (Once a rank-local field differs the digests
  differ too, as they hash request ids; equal normalized events re-run to equal states, so
  the checks together say the ranks' states agree modulo those names.)

The first event where one rank differs from rank 0 is named: its sequence number (rank 0's;
the other rank's when they differ), the scheduler step it falls in, and both events. A rank
whose log ends while another's goes on, after agreeing on every event it holds, is behind
(``RanksResult.behind``), not different: the logs of a live server are read as far as each
is written, and one rank's writer is often ahead; the ranks still going on are compared with
each other (with the first of them where rank 0 is behind). Every log may be a file or a
directory of segments; directories whose retention removed different oldest segments (the
logs start at different sequence numbers) cannot be read in lockstep and are refused
(ConfigError), not reported as ranks that differ.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvlog import reducers
from kvlog.errors import ConfigError, InvalidEvent
from kvlog.events import (
    HOLD_PREFIX,
    STEP_EVENTS,
    CacheConfigured,
    Checkpoint,
    Event,
    Record,
    to_dict,
)
from kvlog.log import LogReader
from kvlog.reducers import checkpoint
from kvlog.runtime.machine import Machine

__all__ = [
    "RankBehind",
    "RankDifference",
    "RanksResult",
    "compare_ranks",
    "normalize",
]

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
    reference: int = 0
    """The rank compared with: rank 0, or the first whose log still went on."""

    def __str__(self) -> str:
        ref = self.reference
        return (
            f"rank {self.rank} differs from rank {ref} at seq {self.seq} (step {self.step}): "
            f"{self.what}\n  rank {ref}: {self.expected}\n  rank {self.rank}: {self.actual}"
        )


@dataclass
class RankBehind:
    """A rank whose log ended while another's went on, after agreeing on every event it
    holds: behind (a log still being written, or a rank that stopped), not different."""

    rank: int
    num_events: int
    last_seq: int
    step: int

    def __str__(self) -> str:
        return (
            f"rank {self.rank} is behind: its log ends after {self.num_events:,} events "
            f"(seq {self.last_seq:,}, step {self.step:,}), and agrees with the others on "
            "every one"
        )


@dataclass
class RanksResult:
    paths: list[str]
    num_records: int = 0
    num_events: int = 0
    num_checkpoints: int = 0
    num_steps: int = 0
    difference: RankDifference | None = None
    behind: list[RankBehind] = field(default_factory=list)
    """The ranks whose logs ended early, in the order they did (none ahead of another)."""
    normalized: list[str] = field(default_factory=list)
    """The rank-local fields that differed (and were normalized)."""

    @property
    def ok(self) -> bool:
        return self.difference is None

    @property
    def complete(self) -> bool:
        """The logs agree and all hold the same events (no rank behind)."""
        return self.ok and not self.behind


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
        self.last_seq = -1
        """The sequence number of its latest event."""
        self.num_checkpoints = 0
        self.digests: dict[int, str] = {}
        """Recorded digest of the checkpoint after each number of events (the latest)."""

    def next_event(self, step: int) -> tuple[int, Event] | RankDifference | None:
        """The next event (its checkpoints on the way verified), None at the end, or the
        difference a checkpoint that does not verify is (``rank`` filled in by the caller)."""
        for seq, record in self.records:
            if type(record) is not Checkpoint:
                self.last_seq = seq
                return seq, record  # type: ignore[return-value]
            self.num_checkpoints += 1
            machine = self.machine
            actual = "" if machine is None else checkpoint.checkpoint_digest(machine.state)
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
    active = list(range(len(ranks)))  # the ranks whose logs go on
    identical = True  # every active rank's events byte-identical so far
    step = 0
    while result.difference is None:
        row = _next_row(ranks, active, step, result)
        if row is None:  # a checkpoint did not verify, or every log ended
            break
        event = row[0][1]
        identical = identical and all(e == event for _, e in row)
        if not identical and not result.normalized:
            result.normalized = _local_fields(row)
        live = [ranks[i] for i in active]
        result.difference = _first_difference(active, row, step)
        result.difference = result.difference or _apply_all(live, active, row, step)
        result.difference = result.difference or _digests_differ(live, active, identical, row, step)
        result.num_events += 1
        step += type(event) in STEP_EVENTS
    result.num_checkpoints = max(r.num_checkpoints for r in ranks)
    result.num_records = result.num_events + result.num_checkpoints
    result.num_steps = step
    return result


def _next_row(
    ranks: Sequence[_Rank], active: list[int], step: int, result: RanksResult
) -> list[tuple[int, Event]] | None:
    """The next event of every active rank; a rank whose log ended while another's goes on
    leaves ``active`` and is noted behind (it agreed on every event it holds). None when
    a checkpoint does not verify (``result.difference`` set) or every log ended."""
    row: list[tuple[int, Event]] = []
    ended: list[int] = []
    for index in list(active):
        item = ranks[index].next_event(step)
        if isinstance(item, RankDifference):
            result.difference = _ranked(index, item)
            return None
        if item is None:
            ended.append(index)
        else:
            row.append(item)
    if not row:
        return None
    for index in ended:
        active.remove(index)
        rank = ranks[index]
        result.behind.append(RankBehind(index, rank.num_events, rank.last_seq, step))
    return row


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


def _first_difference(
    active: Sequence[int], row: list[tuple[int, Event]], step: int
) -> RankDifference | None:
    """The first active rank whose event differs (rank-local fields aside) from the first
    active rank's (rank 0's, unless its log ended: then the ranks compared go on)."""
    first = row[0]
    expected = normalize(first[1])
    for rank, item in zip(active[1:], row[1:], strict=True):
        actual = normalize(item[1])
        if actual != expected:
            what = f"a different {type(item[1]).__name__}"
            if type(item[1]) is not type(first[1]):
                what = f"a {type(item[1]).__name__} where rank {active[0]} has a " + (
                    type(first[1]).__name__
                )
            if item[0] != first[0]:
                what += f" (its seq {item[0]})"
            return RankDifference(rank, first[0], step, what, expected, actual, active[0])
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
    ranks: list[_Rank], active: Sequence[int], row: list[tuple[int, Event]], step: int
) -> RankDifference | None:
    for rank, state, (seq, event) in zip(active, ranks, row, strict=True):
        try:
            state.apply(event)
        except InvalidEvent as exc:
            return RankDifference(rank, seq, step, f"its events do not replay: {exc}", None, None)
    return None


def _digests_differ(
    ranks: list[_Rank],
    active: Sequence[int],
    identical: bool,
    row: list[tuple[int, Event]],
    step: int,
) -> RankDifference | None:
    """While the events are identical: the checkpoints every rank took after the same
    number of events (before this one) carry the same digest."""
    count = ranks[0].num_events - 1
    if not identical or count not in ranks[0].digests:
        return None
    expected = ranks[0].digests.pop(count)
    for rank, state in zip(active[1:], ranks[1:], strict=True):
        digest = state.digests.pop(count, None)
        if digest is not None and digest != expected:
            what = "the recorded state digest differs at the checkpoint before this event"
            return RankDifference(
                rank, row[0][0], step, what, {"digest": expected}, {"digest": digest}, active[0]
            )
    return None

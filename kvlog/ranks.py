"""Ranks agree: the logs of the tensor-parallel workers of one server made the same decisions.

Under tensor parallelism every worker runs the same defragmenter on the same scheduler output
(``KVLOG_PATH=.../worker-{pid}.kvlog``: one log per rank). ``compare_ranks`` reads the logs in
lockstep and checks, record by record, that

- their events are the same modulo rank-local fields: ``CacheConfigured.page_size_bytes``
  (each rank holds its own shard of the heads) and the random per-process nonce in the
  request ids of load placeholders (``kvlog.integrations.session.HOLD_PREFIX``);
- their checkpoints come at the same place and cover the same sequence number and step; every
  rank's recorded state digest is the digest of its own events re-run (its live state was
  what its events say), and while the ranks' records are byte-identical the recorded digests
  are the same on every rank. (Once a rank-local field differs the digests differ too, as they
  hash request ids; equal normalized events re-run to equal states, so the two checks
  together say the ranks' states agree modulo those names.)

The first record where one rank differs from rank 0 is named: its sequence number, the
scheduler step it falls in, and both records. A rank whose log ends early differs there too.
Every log may be a file or a directory of segments.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvlog import reducers
from kvlog.errors import InvalidEvent
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
    if type(record) is Checkpoint:
        out.pop("snapshot", None)  # its bytes name the placeholders: compared by digest
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
    """One rank's log, read in lockstep, with the re-run of its events."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.records: Iterator[tuple[int, Record]] = LogReader(path).records()
        self.machine: Machine | None = None

    def apply(self, event: Event) -> None:
        if type(event) is CacheConfigured:
            self.machine = Machine(reducers.initial_state())
        if self.machine is not None:
            self.machine.apply(event)

    def digest(self) -> str:
        if self.machine is None:
            return ""
        return running.checkpoint_digest(self.machine.state)


def compare_ranks(paths: Sequence[str | os.PathLike[str]]) -> RanksResult:
    """Compare the logs of the ranks of one server (see the module docstring)."""
    ranks = [_Rank(os.fspath(p)) for p in paths]
    result = RanksResult([r.path for r in ranks])
    identical = True  # every rank's records byte-identical so far
    step = 0
    for row in itertools.zip_longest(*(r.records for r in ranks)):
        first = row[0]
        seq = first[0] if first is not None else next(r[0] for r in row if r is not None)
        difference = _first_difference(row, seq, step)
        if difference is not None:
            result.difference = difference
            return result
        assert first is not None, "a missing record is a difference"
        record = first[1]
        identical = identical and all(r is not None and r[1] == record for r in row)
        if not identical and not result.normalized:
            result.normalized = _local_fields(row)
        result.num_records += 1
        if isinstance(record, Checkpoint):
            result.num_checkpoints += 1
            difference = _digests_differ(ranks, row, seq, step, identical)
        else:
            result.num_events += 1
            difference = _apply_all(ranks, row, seq, step)
            step += type(record) in STEP_EVENTS
        if difference is not None:
            result.difference = difference
            return result
    result.num_steps = step
    return result


def _first_difference(
    row: tuple[tuple[int, Record] | None, ...], seq: int, step: int
) -> RankDifference | None:
    first = row[0]
    expected = None if first is None else normalize(first[1])
    for rank, item in enumerate(row[1:], 1):
        actual = None if item is None else normalize(item[1])
        if item is None or first is None:
            what = "the log ends here" if item is None else "rank 0's log ends here"
            return RankDifference(rank, seq, step, what, expected, actual)
        if item[0] != first[0] or actual != expected:
            what = f"a different {type(item[1]).__name__}"
            if type(item[1]) is not type(first[1]):
                what = f"a {type(item[1]).__name__} where rank 0 has a {type(first[1]).__name__}"
            return RankDifference(rank, item[0], step, what, expected, actual)
    return None


def _local_fields(row: tuple[tuple[int, Record] | None, ...]) -> list[str]:
    """Which rank-local fields differ in this row (for the report)."""
    names = []
    records = [r[1] for r in row if r is not None]
    for name in _RANK_LOCAL.get(type(records[0]).__name__, ()):
        if len({getattr(r, name) for r in records}) > 1:
            names.append(f"{type(records[0]).__name__}.{name}")
    return names or ["load placeholder ids"]


def _apply_all(
    ranks: list[_Rank], row: tuple[tuple[int, Record] | None, ...], seq: int, step: int
) -> RankDifference | None:
    for rank, (state, item) in enumerate(zip(ranks, row, strict=True)):
        assert item is not None, "checked by _first_difference"
        try:
            state.apply(item[1])  # type: ignore[arg-type]
        except InvalidEvent as exc:
            return RankDifference(rank, seq, step, f"its events do not replay: {exc}", None, None)
    return None


def _digests_differ(
    ranks: list[_Rank],
    row: tuple[tuple[int, Record] | None, ...],
    seq: int,
    step: int,
    identical: bool,
) -> RankDifference | None:
    """Each rank's recorded digest against its own re-run; across ranks while identical."""
    recorded = [item[1].digest for item in row if item is not None]  # type: ignore[union-attr]
    for rank, (state, digest) in enumerate(zip(ranks, recorded, strict=True)):
        actual = state.digest()
        if actual and actual != digest:
            return RankDifference(
                rank,
                seq,
                step,
                "its recorded state digest is not its events' (its live state diverged)",
                {"digest": actual},
                {"digest": digest},
            )
    for rank, digest in enumerate(recorded[1:], 1):
        if identical and digest != recorded[0]:
            what = "the recorded state digest differs at this checkpoint"
            return RankDifference(
                rank, seq, step, what, {"digest": recorded[0]}, {"digest": digest}
            )
    return None

"""Segment-parallel replay (``kvlog replay --parallel``): a long log replayed in pieces cut
at its snapshot checkpoints, on a Ray pool.

``replay_segments(path)`` replays a long log in parallel segments cut at its snapshot
checkpoints: each segment restores its snapshot (checking it against the checkpoint's
digest), replays its events verifying every checkpoint up to and including the one that
starts the next segment, so the segments chain into exactly the sequential replay: the same
events, the same verified checkpoints, the same final digest."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field

from kvlog import reducers
from kvlog.analysis.pool import Progress, read_bytes, run_all
from kvlog.events import Checkpoint
from kvlog.log import LogReader, list_segments
from kvlog.runtime.fold import Fold, restore_snapshot

__all__ = ["SegmentResult", "SegmentedReplay", "replay_segments"]


@dataclass(frozen=True)
class _Segment:
    index: int
    start_seq: int  # first record to replay
    stop_seq: int  # the snapshot checkpoint that ends it (-1: the end of the log)
    start_event_seq: int = -1  # the last event the starting snapshot covers
    start_digest: str = ""
    snapshot: bytes = b""
    opens_with_snapshot: bool = False  # its first record is the snapshot it starts from
    counts_opening: bool = False  # ... and no piece before it verifies that checkpoint


@dataclass
class SegmentResult:
    """What one segment found."""

    index: int
    start_seq: int
    stop_seq: int
    num_events: int = 0
    num_checkpoints: int = 0
    num_verified: int = 0
    last_event_seq: int = -1
    final_digest: str = ""
    divergence: str = ""


@dataclass
class SegmentedReplay:
    """The chained segments: the sequential replay's figures, and each segment's."""

    path: str
    segments: list[SegmentResult] = field(default_factory=list)
    closed_cleanly: bool = True
    """Whether the log's writer closed it (False: killed, crashed, never closed, or still
    writing): what the sequential replay says, read from the log's header."""

    @property
    def ok(self) -> bool:
        return all(not s.divergence for s in self.segments)

    @property
    def num_events(self) -> int:
        return sum(s.num_events for s in self.segments)

    @property
    def num_verified(self) -> int:
        return sum(s.num_verified for s in self.segments)

    @property
    def final_digest(self) -> str:
        return self.segments[-1].final_digest if self.segments else ""

    @property
    def divergence(self) -> str:
        return next((s.divergence for s in self.segments if s.divergence), "")


def _plan_segments(path: str, max_segments: int) -> list[_Segment]:
    """Cut at snapshot checkpoints, at most ``max_segments`` pieces of similar length; a
    log directory: one piece per segment file, planned from the manifest without reading."""
    if os.path.isdir(path):
        return _directory_segments(path)
    snaps: list[tuple[int, Checkpoint]] = []
    last = -1
    for seq, record in LogReader(path).records():
        last = seq
        if type(record) is Checkpoint and record.snapshot:
            snaps.append((seq, record))
    snaps = [s for s in snaps if s[0] < last]  # a snapshot at the very end starts nothing
    if max_segments > 1 and len(snaps) >= max_segments:
        every = len(snaps) / max_segments
        snaps = [snaps[int(every * (i + 1)) - 1] for i in range(max_segments - 1)]
    cuts: list[_Segment] = []
    start, covered, digest, blob = 0, -1, "", b""
    for i, (seq, checkpoint) in enumerate(snaps):
        cuts.append(_Segment(i, start, seq, covered, digest, blob))
        start, covered = seq + 1, checkpoint.seq
        digest, blob = checkpoint.digest, checkpoint.snapshot
    cuts.append(_Segment(len(snaps), start, -1, covered, digest, blob))
    return cuts


def _directory_segments(path: str) -> list[_Segment]:
    """One piece per segment of a log directory: each starts from its own opening snapshot
    (read by its task) and verifies the next one's opening checkpoint too, which the next
    piece therefore does not count again (its range starts after it); only the first
    piece of a directory retention cut counts its own."""
    infos = list_segments(path)
    cuts = []
    for i, info in enumerate(infos):
        stop = infos[i + 1].first_seq if i + 1 < len(infos) else -1
        opens = info.first_seq > 0
        cuts.append(
            _Segment(i, info.first_seq, stop, opens_with_snapshot=opens, counts_opening=i == 0)
        )
    return cuts


def _start_at_opening_snapshot(fold: Fold, path: str, out: SegmentResult, counts: bool) -> bool:
    """Start ``fold`` from the snapshot checkpoint that opens its segment (at
    ``out.start_seq``), checked against its digest; False (``out.divergence`` set) when
    there is none or it does not check out. ``counts``: that checkpoint is this piece's
    to count (no piece before it verified it); else the piece starts after it."""
    seq, checkpoint = next(iter(LogReader(path).records(out.start_seq)), (-1, None))
    if not isinstance(checkpoint, Checkpoint) or not checkpoint.snapshot:
        out.divergence = f"the segment at seq {out.start_seq} does not open with a snapshot"
        return False
    state = restore_snapshot(checkpoint.snapshot, checkpoint.digest, path, seq)
    if isinstance(state, str):
        out.divergence = f"the snapshot at seq {seq}: {state}"
        return False
    fold.start_at(state, checkpoint.seq, seq + 1)
    fold.num_checkpoints = fold.num_verified = int(counts)
    if not counts:
        out.start_seq = seq + 1
    return True


def _replay_segment(source: str | bytes, seg: _Segment) -> SegmentResult:
    """A Ray task: replay one segment of the log (a path here, or its bytes), verifying
    every checkpoint in it, the one that starts the next segment included."""
    if isinstance(source, bytes):
        with tempfile.TemporaryDirectory(prefix="kvlog-segment-") as tmp:
            path = os.path.join(tmp, "log.kvlog")
            with open(path, "wb") as f:
                f.write(source)
            return _replay_segment(path, seg)
    out = SegmentResult(seg.index, seg.start_seq, seg.stop_seq, last_event_seq=seg.start_event_seq)
    fold = Fold(
        source, verify=True, stop_seq=seg.stop_seq, skip_snapshots=frozenset([seg.stop_seq])
    )
    fold.lane.machine.counted_swaps = True  # only digests are checked: no plan is needed
    opening = seg.opens_with_snapshot
    if opening and not _start_at_opening_snapshot(fold, source, out, seg.counts_opening):
        return out
    if seg.snapshot:  # the next segment checks the snapshot that ends this one
        state = restore_snapshot(seg.snapshot, seg.start_digest, source, seg.start_seq - 1)
        if isinstance(state, str):
            out.divergence = f"the snapshot before seq {seg.start_seq} does not match its digest"
            return out
        fold.start_at(state, seg.start_event_seq, seg.start_seq)
    fold.run()
    out.num_events, out.last_event_seq = fold.num_events, fold.last_event_seq
    out.num_checkpoints, out.num_verified = fold.num_checkpoints, fold.num_verified
    d = fold.divergence
    if d is not None:
        out.divergence = (
            d.message if d.kind == "rejected" else f"a checkpoint does not verify: {d.message}"
        )
    out.final_digest = str(reducers.digest(fold.state))
    return out


def replay_segments(
    path: str | os.PathLike[str],
    *,
    use_ray: bool = True,
    address: str | None = None,
    num_cpus: int | None = None,
    max_segments: int | None = None,
    progress: Progress | None = None,
) -> SegmentedReplay:
    """The log at ``path`` replayed in segments (module docstring), on Ray or here."""
    p = os.fspath(path)
    pieces = max_segments or max(2, 2 * (num_cpus or os.cpu_count() or 2))
    segments = _plan_segments(p, pieces)
    remote = use_ray and address is not None and not os.path.isdir(p)  # a directory: shared
    source: str | bytes = read_bytes(p) if remote else p
    calls = [(source, seg) for seg in segments]
    results = run_all(_replay_segment, calls, use_ray, address, num_cpus, progress)
    return SegmentedReplay(p, list(results), LogReader(p).closed_cleanly)

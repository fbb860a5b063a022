"""Finding a log's snapshots without replaying it: the latest (resume, ``--from-snapshot``)
and the first (a log directory whose oldest segments retention removed starts there).

In a log directory the manifest says where each segment's latest snapshot starts, so the
latest one of the whole log is read in O(segments) plus the snapshot's own bytes; a hint
that does not check out (a stale or damaged manifest, a snapshot that never became durable)
falls back to scanning that one segment. A single file is scanned whole.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

from kvlog.errors import CorruptLogError
from kvlog.events import Checkpoint
from kvlog.log.format import FRAME, FRAME_BYTES, record_seed
from kvlog.log.manifest import SegmentInfo, open_segment
from kvlog.log.reader import LogReader, RecordAssembler
from kvlog.log.scan import FrameScanner

__all__ = ["first_snapshot", "latest_snapshot"]

Found = tuple[int, Checkpoint | None]

_RELISTS = 3
"""How many times ``latest_snapshot`` and ``first_snapshot`` list a live directory again when
a segment they listed went away before they read it (retention removed it, or the sealer
compressed it under a new name); the try after these lets the error through."""


def latest_snapshot(
    path: str | os.PathLike[str], skip: frozenset[int] = frozenset()
) -> tuple[int, Checkpoint | None]:
    """Sequence number and record of the log's last checkpoint that carries a snapshot
    (but those at a sequence number in ``skip``); ``(-1, None)`` when there is none."""
    text = os.fspath(path)
    if not os.path.isdir(text):
        return _scan(text, skip)
    return _listed_again(lambda: _latest_in_directory(text, skip))


def _listed_again(search: Callable[[], Found]) -> Found:
    """``search`` of a log, run again from a fresh listing when a segment it listed went
    away before it read it (a live directory: ``_RELISTS`` times, then the error)."""
    for _ in range(_RELISTS):
        try:
            return search()
        except FileNotFoundError:  # a segment retired or compressed since the listing
            continue  # (SegmentsRetired included)
    return search()


def _latest_in_directory(text: str, skip: frozenset[int]) -> Found:
    """``latest_snapshot`` of a log directory, from one listing of its segments."""
    for info in reversed(LogReader(text).stored_segments):
        if info.snapshot_seq >= 0 and info.snapshot_seq not in skip:
            found = _read_hint(text, info)
            if found is not None:
                return found
        with open_segment(text, info) as plain:
            seq, checkpoint = _scan(plain, skip)
        if checkpoint is not None:
            return seq, checkpoint
    return -1, None


def first_snapshot(path: str | os.PathLike[str]) -> tuple[int, Checkpoint | None]:
    """The log's first record when it is a checkpoint with a snapshot (a segment's
    start), else ``(-1, None)``."""
    return _listed_again(lambda: _first_record_snapshot(path))


def _first_record_snapshot(path: str | os.PathLike[str]) -> Found:
    """``first_snapshot`` from one listing of the log."""
    reader = LogReader(path)
    for seq, record in reader.records(reader.first_seq):
        if type(record) is Checkpoint and record.snapshot:
            return seq, record
        break
    return -1, None


def _scan(path: str, skip: frozenset[int]) -> Found:
    found: Found = (-1, None)
    for seq, record in LogReader(path).records():
        if type(record) is Checkpoint and record.snapshot and seq not in skip:
            found = (seq, record)
    return found


def _read_hint(directory: str, info: SegmentInfo) -> Found | None:
    """The snapshot checkpoint the manifest says starts at ``snapshot_offset`` of the
    segment, verified (frame checksums, sequence number, a snapshot there); None when the
    hint does not check out."""
    with contextlib.suppress(CorruptLogError, OSError), open_segment(directory, info) as plain:
        reader = LogReader(plain)
        with open(plain, "rb", buffering=0) as file:
            size = os.fstat(file.fileno()).st_size
            head = os.pread(file.fileno(), FRAME_BYTES, info.snapshot_offset)
            if len(head) < FRAME_BYTES or info.snapshot_offset < reader.end_offset:
                return None
            local = FRAME.unpack(head)[2]
            seed = record_seed(reader.header.file_id)
            scanner = FrameScanner(file, plain, info.snapshot_offset, size, seed)
            scanner.last_seq = local - 1
            for seq, record in RecordAssembler(plain, scanner, local).records():
                seq += reader.first_seq
                if type(record) is Checkpoint and record.snapshot and seq == info.snapshot_seq:
                    return seq, record
                return None
    return None

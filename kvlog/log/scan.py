"""Walk and verify the record frames of a log file; tell a torn tail from corruption.

The rule, applied at the first frame that is not a valid record with the expected
sequence number ``E`` (incomplete, implausible length, or checksum mismatch):

- if some byte offset after it starts a *valid* frame (plausible length that fits in the
  file, checksum right) whose sequence number is ``>= E``, the log is corrupt: the bad
  frame is followed by good data, so truncating would lose durable records.
  ``CorruptLogError`` names the bad frame's byte offset and ``E``, and where that valid
  frame is (``resume_offset``, ``resume_seq``): ``FrameScanner.resume_at`` goes on there;
- otherwise everything from the bad frame on is a torn tail (a write cut short by a crash),
  reported as a ``Recovery``.

A frame with a valid checksum but the wrong sequence number is corruption too (it can
only be misplaced data, never a torn write). The forward search looks at every byte
offset, vectorized with numpy, and only checksums candidates whose length fits and whose
sequence number lies in ``[E, E + remaining_bytes // 17]``, so it costs little even when
the tail is long garbage.

Three more rules make a torn tail something only a crash can leave:

- a log whose header says it was closed cleanly (``FLAG_CLOSED``) has no torn tail: any
  bad frame is corruption, and so is a last record other than its ``LogEnd`` (a cut at a
  record boundary);
- a bad frame that is whole (its length fits, its sequence number is ``E``) and is followed
  by another whole frame numbered ``E + 1``, both failing their checksums, is corruption:
  a crash leaves a prefix of what was written, never two whole frames with wrong sums
  (e.g. another log's header in front of these records: every checksum fails);
- ``SnapshotPart`` frames at the end without the ``Checkpoint`` they belong to are part of
  the torn tail (the checkpoint was never durable).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import BinaryIO

import numpy as np

from kvlog.errors import CorruptLogError
from kvlog.log.format import (
    END,
    FRAME,
    FRAME_BYTES,
    MAX_RECORD_BYTES,
    PART,
    Recovery,
    frame_crc,
    frame_kind,
    read_up_to,
)
from kvlog.util import crc32c as _crc32c

__all__ = ["FrameScanner", "find_valid_frame"]

_CHUNK_BYTES = 1 << 20
_MIN_FRAME_BYTES = FRAME_BYTES + 1  # an encoded record is never empty


class FrameScanner:
    """Streams the verified frames of one open log file, from ``start_offset`` on.

    After ``frames()`` is exhausted: ``last_seq`` (-1 if none), ``end_offset`` (the end of
    the last good frame) and ``tail`` (a ``Recovery`` when a torn tail follows, else None);
    trailing ``SnapshotPart`` frames are then in the tail, not in ``last_seq``. ``closed``:
    the header says the log was closed cleanly (no torn tail allowed).
    """

    def __init__(
        self,
        file: BinaryIO,
        path: str,
        start_offset: int,
        file_size: int,
        seed: int = 0,
        *,
        closed: bool = False,
    ) -> None:
        self._closed = closed
        self._run = (-1, -1)  # (offset, seq) of the first SnapshotPart of a pending run
        self._last_kind = -1  # frame_kind of the last good frame (-1: none)
        self._last_frame = (-1, -1)  # (offset, seq) of the last good frame
        self.close_offset = -1
        """Byte offset of the ``LogEnd`` that ends the log, -1 if it does not end with one
        (``last_seq`` and ``end_offset`` then leave that record out)."""
        self._seed = seed  # record_seed of the log's file_id
        self._file = file
        self._path = path
        self._size = file_size
        self._buf = b""
        self._view = memoryview(self._buf)
        self._buf_start = start_offset  # file offset of _buf[0]
        self._pos = 0  # read position inside _buf
        self.last_seq = -1
        self.end_offset = start_offset
        self.tail: Recovery | None = None
        self.reason = ""
        """Why the last bad frame met was bad (a few words, without where)."""

    def frames(self) -> Iterator[tuple[int, int, memoryview]]:
        """Yield ``(offset, seq, payload)``; a payload view is valid until the next one."""
        for offset, seq, payload in self._all_frames():
            kind = frame_kind(payload)
            if kind == PART:
                if self._run[0] < 0:
                    self._run = (offset, seq)
            else:
                self._run = (-1, -1)
            self._last_kind, self._last_frame = kind, (offset, seq)
            yield offset, seq, payload
        self._check_end()

    def _all_frames(self) -> Iterator[tuple[int, int, memoryview]]:
        self._file.seek(self._buf_start)
        while self._buf_start + self._pos < self._size:
            yield from self._buffered_frames()
            offset = self._buf_start + self._pos
            if offset >= self._size:
                return
            reason = self._check_frame()  # refills the buffer, or says why the frame is bad
            if reason:
                self._bad_frame(offset, reason)
                return

    def _check_end(self) -> None:
        """The end-of-log rules: a closed log ends in its ``LogEnd``; pending snapshot
        parts join the torn tail."""
        if self._closed and self._last_kind != END:
            raise CorruptLogError(
                "the log was closed cleanly but does not end with its close record: "
                "records after it were cut off",
                path=self._path,
                offset=self.end_offset,
                seq=self.last_seq + 1,
            )
        if self._last_kind == END and self.tail is None:
            self.close_offset, close_seq = self._last_frame
            self.last_seq, self.end_offset = close_seq - 1, self.close_offset
        run_offset, run_seq = self._run
        if run_offset < 0:
            return
        reason = "snapshot parts without their checkpoint"
        if self.tail is not None:
            reason = f"{reason}, then {self.tail.reason}"
        self.tail = Recovery(self._size - run_offset, run_seq - 1, run_offset, reason)
        self.last_seq, self.end_offset = run_seq - 1, run_offset

    def _buffered_frames(self) -> Iterator[tuple[int, int, memoryview]]:
        """The hot loop: the good frames lying wholly in the buffer, from the read position."""
        unpack, checksum, seed = FRAME.unpack_from, _crc32c.crc32c, self._seed
        buf, view, base = self._buf, self._view, self._buf_start
        pos, expected, buf_len = self._pos, self.last_seq + 1, len(self._buf)
        try:
            while pos + FRAME_BYTES <= buf_len:
                crc, length, seq = unpack(buf, pos)
                end = pos + FRAME_BYTES + length
                if not (0 < length <= MAX_RECORD_BYTES and end <= buf_len and seq == expected):
                    break
                if checksum(view[pos + 4 : end], seed) != crc:
                    break
                yield base + pos, seq, view[pos + FRAME_BYTES : end]
                pos, expected = end, seq + 1
        finally:
            self._pos, self.last_seq, self.end_offset = pos, expected - 1, base + pos

    def _check_frame(self) -> str:
        """Why the frame at the read position is not the next record ('' if it is)."""
        if len(self._buf) - self._pos < FRAME_BYTES and not self._fill(FRAME_BYTES):
            return "incomplete record header"
        crc, length, seq = FRAME.unpack_from(self._buf, self._pos)
        if not 0 < length <= MAX_RECORD_BYTES:
            return f"implausible record length {length}"
        end = self._pos + FRAME_BYTES + length
        if end > len(self._buf):
            if not self._fill(FRAME_BYTES + length):
                return "incomplete record"
            end = FRAME_BYTES + length
        if _crc32c.crc32c(self._view[self._pos + 4 : end], self._seed) != crc:
            return "record checksum mismatch"
        if seq != self.last_seq + 1:
            raise CorruptLogError(
                f"valid record with sequence number {seq} out of order",
                path=self._path,
                offset=self._buf_start + self._pos,
                seq=self.last_seq + 1,
            )
        return ""

    def _bad_frame(self, offset: int, reason: str) -> None:
        expected, self.reason = self.last_seq + 1, reason
        fd = self._file.fileno()
        found = find_valid_frame(fd, offset + 1, self._size, expected, self._seed)
        why = ""
        found_offset, found_seq = found if found is not None else (-1, -1)
        if found is not None:
            why = (
                f"{reason}, but a valid record (sequence number {found_seq}) "
                f"follows at byte offset {found_offset}"
            )
        elif self._closed:
            why = f"{reason} in a log closed cleanly (no torn tail can follow a clean close)"
        elif _whole_frames_follow(fd, offset, self._size, expected):
            why = (
                f"{reason}, and whole frames numbered {expected} and {expected + 1} with "
                "failing checksums are there: damage (or another log's header), not a torn write"
            )
        if why:
            raise CorruptLogError(
                why,
                path=self._path,
                offset=offset,
                seq=expected,
                resume_offset=found_offset,
                resume_seq=found_seq,
            )
        self.tail = Recovery(self._size - offset, self.last_seq, offset, reason)

    def resume_at(self, offset: int, seq: int) -> None:
        """Go on past damage: the next ``frames()`` starts at the valid frame ``seq`` at
        ``offset`` (a ``CorruptLogError``'s ``resume_offset``/``resume_seq``); snapshot
        parts pending before the damage are forgotten."""
        if not self.end_offset < offset < self._size or seq <= self.last_seq:
            raise ValueError(f"cannot resume at byte offset {offset}, sequence number {seq}")
        self._buf, self._view = b"", memoryview(b"")
        self._buf_start, self._pos = offset, 0
        self.last_seq, self.end_offset, self.tail = seq - 1, offset, None
        self._run, self._last_kind, self._last_frame = (-1, -1), -1, (-1, -1)

    def _fill(self, need: int) -> bool:
        """Make ``need`` bytes from the read position available; False at end of file."""
        have = len(self._buf) - self._pos
        if have >= need:
            return True
        in_file = self._size - (self._buf_start + len(self._buf))
        if have + in_file < need:
            return False
        data = read_up_to(self._file, min(in_file, max(need - have, _CHUNK_BYTES)))
        self._buf = self._buf[self._pos :] + data
        self._view = memoryview(self._buf)
        self._buf_start += self._pos
        self._pos = 0
        return len(self._buf) >= need


def _whole_frames_follow(fd: int, offset: int, file_size: int, expected: int) -> bool:
    """Whether whole frames numbered ``expected`` and ``expected + 1`` (plausible lengths
    that fit in the file) start at ``offset``, checksums aside."""
    for seq in (expected, expected + 1):
        head = os.pread(fd, FRAME_BYTES, offset)
        if len(head) < FRAME_BYTES:
            return False
        _, length, found_seq = FRAME.unpack(head)
        offset += FRAME_BYTES + length
        if found_seq != seq or not 0 < length <= MAX_RECORD_BYTES or offset > file_size:
            return False
    return True


def find_valid_frame(
    fd: int, start: int, file_size: int, min_seq: int, seed: int = 0
) -> tuple[int, int] | None:
    """The first ``(offset, seq)`` at or after ``start`` holding a valid frame with a
    sequence number of at least ``min_seq``, or None."""
    max_seq = min_seq + (file_size - start) // _MIN_FRAME_BYTES
    position = start
    while position + _MIN_FRAME_BYTES <= file_size:
        chunk = os.pread(fd, min(_CHUNK_BYTES + FRAME_BYTES, file_size - position), position)
        for offset, length, seq, crc in _candidates(chunk, position, file_size, min_seq, max_seq):
            payload = os.pread(fd, length, offset + FRAME_BYTES)
            if len(payload) == length and frame_crc(length, seq, payload, seed) == crc:
                return offset, seq
        position += _CHUNK_BYTES
    return None


def _candidates(
    chunk: bytes, position: int, file_size: int, min_seq: int, max_seq: int
) -> list[tuple[int, int, int, int]]:
    """Offsets in ``chunk`` whose frame header is plausible: ``(offset, length, seq, crc)``."""
    count = min(_CHUNK_BYTES, len(chunk) - FRAME_BYTES + 1)
    if count <= 0:
        return []
    # One unaligned little-endian view per field, starting at every byte offset.
    crcs = np.ndarray((count,), "<u4", buffer=chunk, offset=0, strides=(1,))
    lengths = np.ndarray((count,), "<u4", buffer=chunk, offset=4, strides=(1,))
    seqs = np.ndarray((count,), "<u8", buffer=chunk, offset=8, strides=(1,))
    ends = np.arange(position, position + count, dtype=np.int64) + FRAME_BYTES + lengths
    mask = (lengths > 0) & (lengths <= MAX_RECORD_BYTES) & (ends <= file_size)
    mask &= (seqs >= np.uint64(min_seq)) & (seqs <= np.uint64(max_seq))
    found = np.flatnonzero(mask)
    return [
        (position + int(i), int(lengths[i]), int(seqs[i]), int(crcs[i])) for i in found.tolist()
    ]

"""Reading a log: stream its records, verified, without loading the file or changing it.

A torn tail is not an error for a reader: the good records before it are yielded and the
tail is reported on ``LogReader.tail`` (and logged as a warning) once the records are
exhausted. Damage followed by valid data, and any damage in a log closed cleanly, raises
``CorruptLogError`` (see ``kvlog.log.scan`` for the rule). Starting at a sequence number
still verifies the checksum of every record before it, but decodes none of them.

Log-internal records are never yielded: ``SnapshotPart`` pieces are joined into the
snapshot of the ``Checkpoint`` that follows them, and ``LogEnd`` (a clean close) is
skipped, so sequence numbers of yielded records can have gaps.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Iterator
from typing import BinaryIO

import msgspec

from kvlog.errors import CorruptLogError, LogNotFound
from kvlog.events import Checkpoint, Record
from kvlog.log.format import (
    FLAG_CLOSED,
    PART,
    LogEnd,
    LogHeader,
    LogRecord,
    Recovery,
    SnapshotPart,
    frame_kind,
    read_header_info,
    record_seed,
)
from kvlog.log.scan import FrameScanner
from kvlog.log.writer import check_kind, path_error

__all__ = ["LogReader", "read_header", "read_log"]

_logger = logging.getLogger("kvlog.log")
_decoder: msgspec.msgpack.Decoder[LogRecord] = msgspec.msgpack.Decoder(LogRecord)


class LogReader:
    """A read-only view of one log file. The header is read (and checked) at once."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        with _open(self.path) as file:
            info = read_header_info(file, self.path)
        self.header, self._data_offset, self.flags = info.header, info.data_offset, info.flags
        self.tail: Recovery | None = None
        self.last_seq = -1
        self.end_offset = self._data_offset

    @property
    def closed_cleanly(self) -> bool:
        """Whether the header says the last writer closed the log cleanly."""
        return bool(self.flags & FLAG_CLOSED)

    @property
    def recovery(self) -> Recovery | None:
        """The torn tail found by the last full pass of ``records()`` (alias of ``tail``)."""
        return self.tail

    def records(self, start_seq: int = 0) -> Iterator[tuple[int, Record]]:
        """Yield ``(seq, record)`` for every record with ``seq >= start_seq``, in order.

        The file is read in 1 MiB chunks as the iteration goes; records appended while
        it runs are not seen. ``tail``, ``last_seq`` and ``end_offset`` are set when the
        iteration reaches the end. A checkpoint whose snapshot parts lie before
        ``start_seq`` comes without its snapshot.
        """
        if start_seq < 0:
            raise ValueError(f"start_seq must be >= 0, not {start_seq}")
        with _open(self.path) as file:
            size = os.fstat(file.fileno()).st_size
            seed = record_seed(self.header.file_id)
            scanner = FrameScanner(
                file, self.path, self._data_offset, size, seed, closed=self.closed_cleanly
            )
            yield from _Assembler(self.path, scanner, start_seq).records()
        self.tail, self.last_seq = scanner.tail, scanner.last_seq
        self.end_offset = scanner.end_offset
        if scanner.tail is not None:
            _logger.warning("%s: torn tail (not modified): %s", self.path, scanner.tail)

    def __iter__(self) -> Iterator[tuple[int, Record]]:
        return self.records()


def _open(path: str) -> BinaryIO:
    """The log file, opened for reading: ``LogNotFound`` when it is not there,
    ``LogPathError`` for anything but a regular file (a FIFO is never opened)."""
    if check_kind(path) is None:
        raise LogNotFound(errno.ENOENT, f"{path}: no such log")
    try:
        return open(path, "rb", buffering=0)
    except OSError as exc:
        raise path_error(path, "cannot open the log", exc) from exc


class _Assembler:
    """Decodes frames into records: joins snapshot parts, skips close records."""

    def __init__(self, path: str, scanner: FrameScanner, start_seq: int) -> None:
        self.path = path
        self.scanner = scanner
        self.start_seq = start_seq
        self.parts: list[bytes] = []
        self.count = 0  # the number of parts the current run announces
        self.skipped_parts = False  # parts of the current run lay before start_seq

    def records(self) -> Iterator[tuple[int, Record]]:
        offset, seq = -1, -1
        try:
            for offset, seq, payload in self.scanner.frames():
                if seq < self.start_seq:
                    self.skipped_parts = frame_kind(payload) == PART
                    continue
                record = self._record(offset, seq, _decoder.decode(payload))
                if record is not None:
                    yield seq, record
        except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
            message = f"record with a valid checksum does not decode: {exc}"
            raise self._corrupt(message, offset, seq) from exc
        if self.parts and self.scanner.tail is None:  # the scanner cuts pending parts
            raise self._corrupt("snapshot parts without their checkpoint", offset, seq)

    def _record(self, offset: int, seq: int, record: LogRecord) -> Record | None:
        kind = type(record)
        if kind is SnapshotPart:
            assert isinstance(record, SnapshotPart)
            self._part(offset, seq, record)
            return None
        parts, skipped = self.parts, self.skipped_parts
        self.parts, self.skipped_parts = [], False
        if kind is LogEnd:
            assert isinstance(record, LogEnd)
            if parts or record.offset != offset:
                raise self._corrupt("misplaced close record", offset, seq)
            return None
        if not parts:
            return record  # type: ignore[return-value]
        if kind is not Checkpoint or skipped or len(parts) != self.count:
            raise self._corrupt("snapshot parts not followed by their checkpoint", offset, seq)
        assert isinstance(record, Checkpoint)
        if record.snapshot:
            raise self._corrupt("a checkpoint with a snapshot after snapshot parts", offset, seq)
        return msgspec.structs.replace(record, snapshot=b"".join(parts))

    def _part(self, offset: int, seq: int, part: SnapshotPart) -> None:
        if self.skipped_parts and not self.parts:
            return  # the run began before start_seq: its checkpoint comes without it
        count = part.count if not self.parts else self.count
        if part.index != len(self.parts) or part.count != count or part.index >= count:
            raise self._corrupt(
                f"snapshot part {part.index} of {part.count} out of order", offset, seq
            )
        self.count = count
        self.parts.append(part.data)

    def _corrupt(self, message: str, offset: int, seq: int) -> CorruptLogError:
        return CorruptLogError(message, path=self.path, offset=offset, seq=seq)


def read_log(path: str | os.PathLike[str], start_seq: int = 0) -> Iterator[tuple[int, Record]]:
    """Stream ``(seq, record)`` from ``start_seq`` on; a torn tail ends the stream quietly
    (a warning is logged; use ``LogReader`` to inspect it)."""
    return LogReader(path).records(start_seq)  # the header is checked here, at the call


def read_header(path: str | os.PathLike[str]) -> LogHeader:
    """The header of a log file (raises ``CorruptLogError`` or ``SchemaVersionError``)."""
    return LogReader(path).header

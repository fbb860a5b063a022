"""Reading a log: stream its records, verified, without loading the file or changing it.

A torn tail is not an error for a reader: the good records before it are yielded and the
tail is reported on ``LogReader.tail`` (and logged as a warning) once the records are
exhausted. Damage followed by valid data raises ``CorruptLogError`` (see
``kvlog.log.scan`` for the rule). Starting at a sequence number still verifies the
checksum of every record before it, but decodes none of them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import msgspec

from kvlog.errors import CorruptLogError
from kvlog.events import Record, decode
from kvlog.log.format import LogHeader, Recovery, parse_header, record_seed
from kvlog.log.scan import FrameScanner

__all__ = ["LogReader", "read_header", "read_log"]

_logger = logging.getLogger("kvlog.log")


class LogReader:
    """A read-only view of one log file. The header is read (and checked) at once."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        with open(self.path, "rb", buffering=0) as file:
            self.header, self._data_offset = parse_header(file, self.path)
        self.tail: Recovery | None = None
        self.last_seq = -1
        self.end_offset = self._data_offset

    @property
    def recovery(self) -> Recovery | None:
        """The torn tail found by the last full pass of ``records()`` (alias of ``tail``)."""
        return self.tail

    def records(self, start_seq: int = 0) -> Iterator[tuple[int, Record]]:
        """Yield ``(seq, record)`` for every record with ``seq >= start_seq``, in order.

        The file is read in 1 MiB chunks as the iteration goes; records appended while
        it runs are not seen. ``tail``, ``last_seq`` and ``end_offset`` are set when the
        iteration reaches the end.
        """
        if start_seq < 0:
            raise ValueError(f"start_seq must be >= 0, not {start_seq}")
        with open(self.path, "rb", buffering=0) as file:
            size = os.fstat(file.fileno()).st_size
            seed = record_seed(self.header.file_id)
            scanner = FrameScanner(file, self.path, self._data_offset, size, seed)
            offset, seq = -1, -1
            try:
                for offset, seq, payload in scanner.frames():  # noqa: B007 (used in except)
                    if seq >= start_seq:
                        yield seq, decode(payload)
            except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
                raise CorruptLogError(
                    f"record with a valid checksum does not decode: {exc}",
                    path=self.path,
                    offset=offset,
                    seq=seq,
                ) from exc
        self.tail, self.last_seq = scanner.tail, scanner.last_seq
        self.end_offset = scanner.end_offset
        if scanner.tail is not None:
            _logger.warning("%s: torn tail (not modified): %s", self.path, scanner.tail)

    def __iter__(self) -> Iterator[tuple[int, Record]]:
        return self.records()


def read_log(path: str | os.PathLike[str], start_seq: int = 0) -> Iterator[tuple[int, Record]]:
    """Stream ``(seq, record)`` from ``start_seq`` on; a torn tail ends the stream quietly
    (a warning is logged; use ``LogReader`` to inspect it)."""
    return LogReader(path).records(start_seq)  # the header is checked here, at the call


def read_header(path: str | os.PathLike[str]) -> LogHeader:
    """The header of a log file (raises ``CorruptLogError`` or ``SchemaVersionError``)."""
    return LogReader(path).header

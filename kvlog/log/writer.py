"""The log writer: buffered, CRC-framed appends with group commit, and recovery on reopen.

Appends go into one ``bytearray`` (bounded by ``buffer_bytes``) and reach the file in one
``write`` per group: at each ``StepEnded`` with ``sync="step"`` (then fsync: group
commit), at each record with ``sync="always"`` (then fsync), and when the buffer passes
``buffer_bytes``, on ``flush()`` and on ``close()`` (then fsync) otherwise. Any
``OSError`` from a write or an fsync poisons the writer: the bytes on disk are then
unknown (after a failed fsync the kernel may have dropped dirty pages), so that append
and every later one raise ``LogPoisoned``; reopen the log to recover what is on disk.

A new log is created atomically (header written to a temporary file, fsynced, then
linked into place), so a crash during creation leaves either no file or a whole header:
a non-empty file with a short or damaged header is corrupt and never rewritten. An
existing empty file (``touch``, ``NamedTemporaryFile``) counts as absent. On reopen, the
existing header is kept (``meta`` and ``file_id``, random unless given for byte-identical
files, are only written at creation); a torn tail is truncated
(and fsynced) and reported on ``.recovery``; other damage raises ``CorruptLogError``.
One writer per file: an exclusive ``flock`` raises ``LogLocked`` for a second one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import tempfile
import typing
from types import TracebackType
from typing import Literal

import msgspec

from kvlog import __version__
from kvlog import crc32c as _crc32c
from kvlog.errors import LogClosed, LogLocked, LogPoisoned, RecordRejected, SchemaVersionError
from kvlog.events import SCHEMA_VERSION, Record, StepEnded
from kvlog.log.format import (
    FRAME_BYTES,
    FRAME_HEAD,
    MAX_RECORD_BYTES,
    LogHeader,
    Recovery,
    encode_header,
    new_file_id,
    parse_header,
    record_seed,
)
from kvlog.log.scan import FrameScanner

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]

__all__ = ["SYNC_MODES", "LogWriter", "SyncMode"]

SyncMode = Literal["none", "step", "always"]
SYNC_MODES: tuple[str, ...] = ("none", "step", "always")
_RECORD_TYPES = frozenset(typing.get_args(Record))
_EMPTY_FRAME = bytes(FRAME_BYTES)
_CRC = struct.Struct("<I")
_encoder = msgspec.msgpack.Encoder()  # the configuration of kvlog.events.encode
_logger = logging.getLogger("kvlog.log")


class LogWriter:
    """Appends records to a log file; see the module docstring for durability."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        sync: SyncMode = "step",
        *,
        meta: dict[str, str] | None = None,
        buffer_bytes: int = 1 << 20,
        file_id: int | None = None,
    ) -> None:
        if sync not in SYNC_MODES:
            raise ValueError(f"sync must be one of {SYNC_MODES}, not {sync!r}")
        self.path = os.fspath(path)
        self.sync_mode: SyncMode = sync
        self._fsync_each, self._fsync_step = sync == "always", sync == "step"
        self._buffer_bytes = buffer_bytes
        self._buffer = bytearray()
        self._poison: OSError | None = None
        self._closed = False
        self._seed = 0
        if not os.path.exists(self.path) or os.path.getsize(self.path) == 0:
            _create(self.path, _new_header(meta, file_id))
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | getattr(os, "O_CLOEXEC", 0))
        try:
            _lock(self._fd, self.path)
            self.header, self.next_seq, self.recovery = self._recover()
        except BaseException:
            os.close(self._fd)
            raise

    def _seed_of(self, header: LogHeader) -> int:
        self._seed = record_seed(header.file_id)
        return self._seed

    def _recover(self) -> tuple[LogHeader, int, Recovery | None]:
        """Verify every frame; cut a torn tail. Returns the header, next seq and recovery."""
        with open(self.path, "rb", buffering=0) as file:
            header, data_offset = parse_header(file, self.path)
            if header.schema_version != SCHEMA_VERSION:
                raise SchemaVersionError(
                    f"cannot append schema {SCHEMA_VERSION} records to a schema "
                    f"{header.schema_version} log; start a new log",
                    path=self.path,
                )
            size = os.fstat(file.fileno()).st_size
            scanner = FrameScanner(file, self.path, data_offset, size, self._seed_of(header))
            for _ in scanner.frames():
                pass
        if scanner.tail is not None:
            os.ftruncate(self._fd, scanner.tail.offset)
            _datasync(self._fd)
            _logger.warning("%s: cut a torn tail: %s", self.path, scanner.tail)
        return header, scanner.last_seq + 1, scanner.tail

    def append(self, record: Record) -> int:
        """Append one event or checkpoint; return its sequence number."""
        if self._poison is not None or self._closed:
            self._check_usable()
        record_type = type(record)
        if record_type not in _RECORD_TYPES:  # exact types: a subclass would not decode
            raise RecordRejected(f"not a log record: {record_type.__name__}")
        buffer, seq = self._buffer, self.next_seq
        start = len(buffer)
        buffer += _EMPTY_FRAME
        _encoder.encode_into(record, buffer, start + FRAME_BYTES)  # the payload, in place
        length = len(buffer) - start - FRAME_BYTES
        if length > MAX_RECORD_BYTES:
            del buffer[start:]
            raise RecordRejected(f"record of {length} bytes > {MAX_RECORD_BYTES}")
        FRAME_HEAD.pack_into(buffer, start + 4, length, seq)
        with memoryview(buffer)[start + 4 :] as checked:
            _CRC.pack_into(buffer, start, _crc32c.crc32c(checked, self._seed))
        self.next_seq = seq + 1
        if self._fsync_each or (self._fsync_step and record_type is StepEnded):
            self._commit(fsync=True)
        elif len(buffer) >= self._buffer_bytes:
            self._commit(fsync=False)
        return seq

    def flush(self) -> None:
        """Hand the buffered records to the OS (no fsync)."""
        self._check_usable()
        self._commit(fsync=False)

    def sync(self) -> None:
        """Write the buffered records and fsync: everything appended so far is durable."""
        self._check_usable()
        self._commit(fsync=True)

    def close(self) -> None:
        """Write, fsync and close; idempotent. A poisoned writer just closes its file."""
        if self._closed:
            return
        try:
            if self._poison is None:
                self._commit(fsync=True)
        finally:
            self._closed = True
            os.close(self._fd)  # releases the lock

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def poisoned(self) -> bool:
        return self._poison is not None

    def __enter__(self) -> LogWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _check_usable(self) -> None:
        if self._poison is not None:
            raise LogPoisoned(
                f"{self.path}: an earlier write or fsync failed ({self._poison}); "
                "no more appends, reopen the log to recover"
            ) from self._poison
        if self._closed:
            raise LogClosed(f"{self.path}: log writer is closed")

    def _commit(self, *, fsync: bool) -> None:
        try:
            if self._buffer:
                _write_all(self._fd, self._buffer)
                self._buffer.clear()
            if fsync:
                _datasync(self._fd)
        except OSError as exc:
            self._poison = exc
            self._buffer.clear()
            raise LogPoisoned(f"{self.path}: log write or fsync failed: {exc}") from exc


def _new_header(meta: dict[str, str] | None, file_id: int | None) -> LogHeader:
    meta = dict(meta or {})
    for key, value in meta.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"log meta must map str to str, got {key!r}: {value!r}")
    if file_id is None:
        file_id = new_file_id()
    elif not 0 < file_id < 1 << 64:
        raise ValueError(f"file_id must be in 1..2**64-1, not {file_id}")
    return LogHeader(SCHEMA_VERSION, __version__, meta, file_id=file_id)


def _create(path: str, header: LogHeader) -> None:
    """Create the log atomically: a whole header or no file (or the old empty file)."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp_path = tempfile.mkstemp(
        prefix=f".{os.path.basename(path)}.", suffix=".kvlog.tmp", dir=directory
    )
    try:
        try:
            _write_all(fd, encode_header(header))
            os.fsync(fd)
        finally:
            os.close(fd)
        if os.path.exists(path):  # an empty file stands in for a new log
            os.replace(tmp_path, path)
        else:
            with contextlib.suppress(FileExistsError):
                os.link(tmp_path, path)  # never replaces a log another writer just made
    finally:
        if os.path.exists(tmp_path):
            os.unlink(tmp_path)
    _fsync_directory(directory)


def _write_all(fd: int, data: bytes | bytearray) -> None:
    """Write all of ``data``, looping over short writes; no view outlives the call."""
    done = 0
    with memoryview(data) as view:
        while done < len(view):
            with view[done:] as rest:
                written = os.write(fd, rest)
            if written <= 0:
                raise OSError(f"write returned {written}")
            done += written


def _datasync(fd: int) -> None:
    if hasattr(os, "fdatasync"):
        os.fdatasync(fd)
    else:  # pragma: no cover - macOS, Windows
        os.fsync(fd)


def _fsync_directory(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _lock(fd: int, path: str) -> None:
    if fcntl is None:  # pragma: no cover
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as exc:
        raise LogLocked(f"{path}: another LogWriter has this log open for append") from exc

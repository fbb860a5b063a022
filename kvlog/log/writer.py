"""The log writer: buffered, CRC-framed appends with group commit, and recovery on reopen.

Appends go into one ``bytearray`` (bounded by ``buffer_bytes``) and reach the file in one
``write`` per group: at each step-ending record (``StepEnded``, ``StepScheduled``) with
``sync="step"`` (then fsync: group commit) or ``sync="background"`` (no fsync on the
serving thread), at each record with ``sync="always"`` (then fsync), and when the buffer
passes ``buffer_bytes``, on ``flush()`` and on ``close()`` (then fsync) otherwise. Any
``OSError`` from a write or an fsync poisons the writer: the bytes on disk are then
unknown (after a failed fsync the kernel may have dropped dirty pages), so that append
and every later one raise ``LogPoisoned``; reopen the log to recover what is on disk.

``sync="background"``: a daemon thread ("kvlog-log-flusher", started at open) calls
``fdatasync`` every ``sync_interval_s`` when something was written since its last one, so
a step's records are durable within about ``sync_interval_s`` plus one fsync of its
``append`` returning, and the serving thread pays one ``write`` per step instead of a
write and an fsync. ``written_seq`` (last record handed to the OS), ``durable_seq`` (last
record known synced) and ``max_lag_s`` (the longest a write waited for its sync) say where
it stands. A failed background fsync poisons the writer like an inline one: the next call
raises ``LogPoisoned``. The flusher only syncs the fd and updates its counters under a
small lock; ``close()`` and ``abandon()`` stop and join it before the fd is closed.

An exception or ``KeyboardInterrupt`` at any point of an append, flush or close leaves
the record wholly in the buffer or wholly absent (the writer still usable), or poisons
the writer where bytes may have reached the file without the bookkeeping that follows
(a later ``close()`` then writes nothing more but still releases the fd and its lock).

Opening, in this order, so that two writers can never both win: the path must be a
regular file or absent (a directory, device, FIFO or socket raises ``LogPathError`` and is
never replaced or written; a symlink is followed to its target, the link stays, and a
dangling one is refused). An absent file is created atomically (header written to a
temporary file, fsynced, then linked into place; a crash leaves no file or a whole
header). Then the file is opened and locked (an exclusive ``flock``; a second writer gets
``LogLocked``), and only then is it judged: an empty file (``touch``) gets its header
written in place; a non-empty file with a short or damaged header is corrupt and never
rewritten; with ``new=True`` a file that holds records raises ``LogExists`` untouched.
On reopen the existing header is kept (``meta`` and ``file_id``, random unless given for
byte-identical files, are only written at creation); a torn tail is truncated (and
fsynced) and reported on ``.recovery``; other damage raises ``CorruptLogError``.

``close()`` appends a ``LogEnd`` record, writes and syncs, then sets ``FLAG_CLOSED`` in
the header and syncs; a reopening writer clears the flag (synced), then cuts the ``LogEnd``
(synced) and appends after the last record, so sequence numbers stay dense. A
``Checkpoint`` whose snapshot is over ``SNAPSHOT_PART_BYTES`` is written as
``SnapshotPart`` records and the checkpoint (see ``kvlog.log.format``).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import stat
import struct
import tempfile
import threading
import time
import typing
import weakref
from types import TracebackType
from typing import Literal

import msgspec

from kvlog._version import __version__
from kvlog.errors import (
    ConfigError,
    LogClosed,
    LogExists,
    LogLocked,
    LogPathError,
    LogPoisoned,
    RecordRejected,
    SchemaVersionError,
)
from kvlog.events import SCHEMA_VERSION, STEP_EVENTS, Checkpoint, Record
from kvlog.log.format import (
    FLAG_CLOSED,
    FLAGS_OFFSET,
    FRAME_BYTES,
    FRAME_HEAD,
    MAX_RECORD_BYTES,
    RECORD,
    SNAPSHOT_PART_BYTES,
    LogDetached,
    LogEnd,
    LogHeader,
    LogRecord,
    Recovery,
    SnapshotPart,
    encode_header,
    flags_patch,
    frame_kind,
    new_file_id,
    read_header_info,
    record_seed,
)
from kvlog.log.manifest import fsync_directory
from kvlog.log.scan import FrameScanner
from kvlog.util import crc32c as _crc32c

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "DEFAULT_SYNC_INTERVAL_S",
    "SYNC_INTERVAL_BOUNDS",
    "SYNC_MODES",
    "LogWriter",
    "SyncMode",
    "check_sync_interval",
]

SyncMode = Literal["none", "step", "always", "background"]
SYNC_MODES: tuple[str, ...] = ("none", "step", "always", "background")
SYNC_INTERVAL_BOUNDS = (1e-4, 60.0)
"""``sync_interval_s`` must lie in this closed range (seconds)."""
DEFAULT_SYNC_INTERVAL_S = 0.005
"""The background flusher's default group-commit interval (the durability lag's bound)."""
_RECORD_TYPES = frozenset(typing.get_args(Record))
_STEP_TYPES = STEP_EVENTS
"""Records that end a scheduler step: ``sync="step"`` and ``"background"`` write the group
at each (``"step"`` fsyncs it too)."""
_EMPTY_FRAME = bytes(FRAME_BYTES)
_CRC = struct.Struct("<I")
_COPY_BYTES = 4096
"""Up to this payload size, ``_frame`` checksums a copy of the record (cheaper than a view)."""
_encoder = msgspec.msgpack.Encoder()  # the configuration of kvlog.events.encode
_logger = logging.getLogger("kvlog.log")
_OPEN_FLAGS = os.O_RDWR | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0)


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
        new: bool = False,
        sync_interval_s: float = DEFAULT_SYNC_INTERVAL_S,
    ) -> None:
        if sync not in SYNC_MODES:
            raise ConfigError("sync", sync, f"one of {SYNC_MODES}")
        if type(buffer_bytes) is not int or buffer_bytes < 0:
            raise ConfigError("buffer_bytes", buffer_bytes, "an int >= 0")
        _check_interval(sync_interval_s)
        header = _new_header(meta, file_id)  # arguments are checked before the path
        self.path = os.fspath(path)
        self.sync_mode: SyncMode = sync
        self._fsync_each = sync == "always"
        self._step_commit = sync in ("step", "background")  # write the group at a step's end
        self._commit_fsync = sync != "background"  # ... and fsync it on the serving thread
        self._buffer_bytes = buffer_bytes
        self._buffer = bytearray()
        self._poison: BaseException | None = None
        self._closed = False
        self._seed = 0
        self._flusher: threading.Thread | None = None  # sync="background" only
        self._init_counters(float(sync_interval_s))
        self._fd = -1
        try:
            _open_locked(self.path, header, self)
            self.header, self.next_seq, self.recovery = self._recover(new)
            self._offset = os.lseek(self._fd, 0, os.SEEK_END)  # where the next frame goes
            self.written_seq = self.durable_seq = self.next_seq - 1  # recovery synced them
            if sync == "background":
                self._flusher = threading.Thread(
                    target=_flush_loop,
                    args=(weakref.ref(self), self._stop, self.sync_interval_s),
                    name="kvlog-log-flusher",
                    daemon=True,
                )
                self._flusher.start()
        except BaseException:
            self._release()  # the flusher first, if it started
            raise

    def _init_counters(self, interval: float) -> None:
        """The durability counters and the flusher's state (no thread yet)."""
        self.sync_interval_s = interval
        self.written_seq = -1
        """The last sequence number handed to the OS (written, maybe not synced)."""
        self.durable_seq = -1
        """The last sequence number known synced (fdatasync returned after its write)."""
        self.max_lag_s = 0.0
        """The longest time a write waited for the fsync that made it durable."""
        self._unsynced_since = -1.0  # monotonic time of the oldest unsynced write, or -1
        self._counters = threading.Lock()
        self._stop = threading.Event()

    def _recover(self, new: bool) -> tuple[LogHeader, int, Recovery | None]:
        """Verify every frame; cut a torn tail; clear the closed flag. Returns the header,
        next seq and recovery."""
        with os.fdopen(os.dup(self._fd), "rb", buffering=0) as file:
            info = read_header_info(file, self.path)
            header = info.header
            if header.schema_version != SCHEMA_VERSION:
                raise SchemaVersionError(
                    f"cannot append schema {SCHEMA_VERSION} records to a schema "
                    f"{header.schema_version} log; start a new log",
                    path=self.path,
                )
            size = os.fstat(file.fileno()).st_size
            self._seed = record_seed(header.file_id)
            closed = bool(info.flags & FLAG_CLOSED)
            scanner = FrameScanner(
                file, self.path, info.data_offset, size, self._seed, closed=closed
            )
            for _, _, payload in scanner.frames():
                if new and frame_kind(payload) == RECORD:
                    raise LogExists(
                        errno.EEXIST,
                        f"{self.path} already holds records: not overwritten (the file was "
                        "not touched)",
                    )
        self._body = info.body
        if closed:
            self._write_flags(0)  # first: from here on the log may end torn again
        cut = scanner.tail.offset if scanner.tail is not None else scanner.close_offset
        if cut >= 0:  # a torn tail, or the close record (the log goes on after it)
            os.ftruncate(self._fd, cut)
            _datasync(self._fd)
        if scanner.tail is not None:
            _logger.warning("%s: cut a torn tail: %s", self.path, scanner.tail)
        return header, scanner.last_seq + 1, scanner.tail

    def append(self, record: Record) -> int:
        """Append one event or checkpoint; return its sequence number."""
        if self._poison is not None or self._closed:
            self._check_usable()
        record_type = type(record)
        if record_type not in _RECORD_TYPES:  # exact types: a subclass would not decode
            raise RecordRejected(f"not a log record: {record_type.__name__}")
        if record_type is Checkpoint and len(record.snapshot) > SNAPSHOT_PART_BYTES:  # type: ignore[union-attr]
            return self._append_parts(record)  # type: ignore[arg-type]
        seq = self._frame(record)
        if self._fsync_each or (self._step_commit and record_type in _STEP_TYPES):
            self._commit(fsync=self._commit_fsync)
        elif len(self._buffer) >= self._buffer_bytes:
            self._commit(fsync=False)
        return seq

    def _frame(self, record: LogRecord) -> int:
        """Encode one record into the buffer; its sequence number. On any exception (an
        interrupt included) before ``next_seq`` moves, nothing of the record stays; the
        ``next_seq`` assignment is the commit point."""
        buffer, seq = self._buffer, self.next_seq
        start = len(buffer)
        try:
            buffer += _EMPTY_FRAME
            _encode_frame(record, buffer, start, seq, self._seed)
            self.next_seq = seq + 1
        except BaseException:
            if self.next_seq == seq:
                del buffer[start:]
            raise
        return seq

    def _append_parts(self, checkpoint: Checkpoint) -> int:
        """A checkpoint with a large snapshot: its parts, then itself without the snapshot.
        On an exception part-way the parts are taken back if none reached the file, else
        the writer is poisoned (parts without their checkpoint must not be followed)."""
        first_seq, start, offset = self.next_seq, len(self._buffer), self._offset
        try:
            seq = self._frame_parts(checkpoint)
        except BaseException as exc:
            if self._poison is None and self._offset == offset:
                del self._buffer[start:]
                self.next_seq = first_seq
            elif self._poison is None:
                self._poison = exc
            raise
        self._commit(fsync=self._fsync_each)
        return seq

    def _frame_parts(self, checkpoint: Checkpoint) -> int:
        snapshot = checkpoint.snapshot
        count = -(-len(snapshot) // SNAPSHOT_PART_BYTES)
        with memoryview(snapshot) as view:
            for index in range(count):
                piece = view[index * SNAPSHOT_PART_BYTES : (index + 1) * SNAPSHOT_PART_BYTES]
                self._frame(SnapshotPart(index, count, piece))  # type: ignore[arg-type]
                if len(self._buffer) >= self._buffer_bytes:
                    self._commit(fsync=False)
        return self._frame(msgspec.structs.replace(checkpoint, snapshot=b""))

    @property
    def end_offset(self) -> int:
        """The byte offset where the next frame will start (buffered bytes included)."""
        return self._offset + len(self._buffer)

    def append_detached(self, record: LogDetached) -> int:
        """Append the record that marks where the recorder detached after an I/O error
        (see ``kvlog.log.detach``), written and fsynced at once; its sequence number."""
        self._check_usable()
        if type(record) is not LogDetached:
            raise RecordRejected(f"not a detach record: {type(record).__name__}")
        seq = self._frame(record)
        self._commit(fsync=True)
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
        """Stop the flusher, write, fsync, mark the clean close and close; idempotent. A
        poisoned writer just closes its file (no close mark: its log may end torn). A close
        that was interrupted is finished by the next: that one only releases the fd."""
        if self._fd < 0:
            return
        try:
            if not self._closed:
                self._stop_flusher()
                if self._poison is None:
                    self._frame(LogEnd(self._offset + len(self._buffer)))
                    self._commit(fsync=True)
                    self._write_flags(FLAG_CLOSED)
        finally:
            self._closed = True
            self._release()

    def abandon(self) -> None:
        """Close the file as a crash would leave it: the buffered records are written (not
        synced), no close record, no closed flag (crash tests). Idempotent."""
        if self._fd < 0:
            return
        try:
            if not self._closed:
                self._stop_flusher()
                if self._poison is None:
                    self._commit(fsync=False)
        finally:
            self._closed = True
            self._release()

    def _stop_flusher(self) -> None:
        """Stop the background flusher and wait for it (idempotent)."""
        flusher = self._flusher
        if flusher is not None and flusher.ident is not None:  # started
            self._stop.set()
            flusher.join()

    def _release(self) -> None:
        """Close the fd (releasing the lock), never while the flusher may still use it."""
        self._stop_flusher()
        if self._fd >= 0:
            # one line: no line event (nor interrupt) between the close and its mark
            self._fd = os.close(self._fd) or -1  # type: ignore[func-returns-value]

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
                f"{self.path}: an earlier write or fsync failed ({self._poison!r}); "
                "no more appends, reopen the log to recover"
            ) from self._poison
        if self._closed:
            raise LogClosed(f"{self.path}: log writer is closed")

    def _commit(self, *, fsync: bool) -> None:
        """Write the buffer (and fsync). Any exception poisons: what reached the file is
        then unknown, or the buffer and ``_offset`` no longer say what did."""
        try:
            if self._buffer:
                _write_all(self._fd, self._buffer)
                self._offset += len(self._buffer)
                self._buffer.clear()
                self._note_written()
            if fsync:
                _datasync(self._fd)
                self._note_durable(self.written_seq, -1.0)
        except OSError as exc:
            self._poison = exc
            self._buffer.clear()
            raise LogPoisoned(f"{self.path}: log write or fsync failed: {exc}") from exc
        except BaseException as exc:  # an interrupt: the buffer may be partly on disk
            if self._poison is None:
                self._poison = exc
            raise

    def unsynced_age_s(self) -> float:
        """Seconds the oldest record written to the OS and not yet fsynced has waited (0:
        none waits): the recorder's lag now."""
        with self._counters:
            since = self._unsynced_since
        return 0.0 if since < 0 else max(0.0, time.monotonic() - since)

    def _note_written(self) -> None:
        """Everything framed so far is now with the OS (the buffer is empty)."""
        with self._counters:
            self.written_seq = self.next_seq - 1
            if self._unsynced_since < 0:
                self._unsynced_since = time.monotonic()

    def _note_durable(self, seq: int, since: float) -> None:
        """An fsync made ``seq`` durable; ``since``: when its oldest write happened (or -1:
        an inline fsync, which clears the pending time)."""
        now = time.monotonic()
        with self._counters:
            self.durable_seq = max(self.durable_seq, seq)
            if since >= 0:
                self.max_lag_s = max(self.max_lag_s, now - since)
            else:
                self._unsynced_since = -1.0

    def _background_sync(self) -> None:
        """One round of the flusher: fsync what was written since the last sync, if
        anything was (``_flush_loop`` calls it on its thread)."""
        with self._counters:
            seq, since = self.written_seq, self._unsynced_since
            self._unsynced_since = -1.0
        if seq > self.durable_seq:
            _datasync(self._fd)
            self._note_durable(seq, since)

    def _write_flags(self, flags: int) -> None:
        """Rewrite the header's flags (one 10-byte write in the first sector), synced."""
        try:
            patch = flags_patch(self._body, flags)
            if os.pwrite(self._fd, patch, FLAGS_OFFSET) != len(patch):
                raise OSError(errno.EIO, "short write of the log header flags")
            _datasync(self._fd)
        except OSError as exc:
            self._poison = exc
            raise LogPoisoned(f"{self.path}: writing the header flags failed: {exc}") from exc


def _flush_loop(ref: weakref.ref[LogWriter], stop: threading.Event, interval: float) -> None:
    """The flusher thread's body: a sync round every ``interval`` until ``stop`` is set
    or the writer is gone (a weak reference: a writer dropped unclosed is not kept alive).
    Any exception (an ``OSError`` from fdatasync; anything else would be a bug) poisons the
    writer and ends the thread: nothing escapes into the thread's excepthook."""
    while not stop.wait(interval):
        writer = ref()
        if writer is None:
            return
        try:
            writer._background_sync()
        except BaseException as exc:
            if writer._poison is None:
                writer._poison = exc
            return
        del writer


def _encode_frame(record: LogRecord, buffer: bytearray, start: int, seq: int, seed: int) -> None:
    """Fill the empty frame at ``start`` (its last byte ends the buffer): the payload
    encoded in place, then length, seq and CRC. ``RecordRejected`` when it cannot be."""
    try:
        _encoder.encode_into(record, buffer, start + FRAME_BYTES)  # the payload, in place
    except (TypeError, ValueError, OverflowError) as exc:  # UnicodeEncodeError included
        raise RecordRejected(f"{type(record).__name__} does not encode: {exc}") from exc
    length = len(buffer) - start - FRAME_BYTES
    if length > MAX_RECORD_BYTES:
        raise RecordRejected(f"record of {length} bytes > {MAX_RECORD_BYTES}")
    FRAME_HEAD.pack_into(buffer, start + 4, length, seq)
    if length <= _COPY_BYTES:  # copying a small record is cheaper than a memoryview
        crc = _crc32c.crc32c(buffer[start + 4 :], seed)
    else:
        with memoryview(buffer)[start + 4 :] as checked:
            crc = _crc32c.crc32c(checked, seed)
    _CRC.pack_into(buffer, start, crc)


def check_sync_interval(value: object) -> None:
    """``ConfigError`` unless ``value`` is a finite number of seconds within
    ``SYNC_INTERVAL_BOUNDS``."""
    _check_interval(value)


def _check_interval(value: object) -> None:
    low, high = SYNC_INTERVAL_BOUNDS
    if (
        type(value) not in (int, float)
        or not math.isfinite(value)  # type: ignore[arg-type]
        or not low <= value <= high  # type: ignore[operator]
    ):
        raise ConfigError("sync_interval_s", value, f"a number of seconds in [{low}, {high}]")


def _new_header(meta: dict[str, str] | None, file_id: int | None) -> LogHeader:
    if meta is not None and not isinstance(meta, dict):
        raise ConfigError("meta", meta, "a dict of str to str")
    meta = dict(meta or {})
    for key, value in meta.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise ConfigError("meta", {key: value}, "a dict of str to str")
    if file_id is None:
        file_id = new_file_id()
    elif type(file_id) is not int or not 0 < file_id < 1 << 64:
        raise ConfigError("file_id", file_id, "an int in 1..2**64-1")
    header = LogHeader(SCHEMA_VERSION, __version__, meta, file_id=file_id)
    try:
        encode_header(header)
    except (ValueError, TypeError) as exc:  # too large, or a str that does not encode
        raise ConfigError("meta", "<...>", f"a small dict of encodable str ({exc})") from exc
    return header


class _FdHolder(typing.Protocol):
    _fd: int


def _open_locked(path: str, header: LogHeader, owner: _FdHolder) -> None:
    """Open the log file read-write and lock it, into ``owner._fd`` (the last thing done:
    an interrupt before it closes the fd here, after it the owner's own clean-up does, so
    no interrupt can leak the descriptor and its lock); an absent file is created
    (atomically) and an empty one gets its header, under the lock."""
    if check_kind(path) is None:
        _create(path, header)
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as exc:
        raise path_error(path, "cannot open the log", exc) from exc
    try:
        _check_regular(os.fstat(fd).st_mode, path)  # the checked path may have changed
        _lock(fd, path)
        if os.fstat(fd).st_size == 0:  # decided under the lock: one writer writes it
            _write_header_in_place(fd, path, header)
        owner._fd = fd
    except BaseException:
        if owner._fd != fd:
            os.close(fd)
        raise


def check_kind(path: str) -> os.stat_result | None:
    """The stat of what ``path`` names (through a symlink), None when nothing is there;
    ``LogPathError`` for anything but a regular file, and for a dangling symlink."""
    try:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            try:
                st = os.stat(path)
            except FileNotFoundError as exc:
                raise LogPathError(
                    errno.ENOENT,
                    f"{path} is a dangling symlink: kvlog creates no log through a link",
                ) from exc
    except FileNotFoundError:
        return None
    except LogPathError:
        raise
    except OSError as exc:
        raise path_error(path, "cannot stat the log path", exc) from exc
    _check_regular(st.st_mode, path)
    return st


def _check_regular(mode: int, path: str) -> None:
    if stat.S_ISREG(mode):
        return
    kinds = [(stat.S_ISDIR, "directory"), (stat.S_ISCHR, "character device")]
    kinds += [(stat.S_ISBLK, "block device"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket")]
    kind = next((name for test, name in kinds if test(mode)), "special file")
    code = errno.EISDIR if stat.S_ISDIR(mode) else errno.EINVAL
    raise LogPathError(code, f"{path} is a {kind}, not a regular file: refused, left as it is")


def path_error(path: str, what: str, exc: OSError) -> LogPathError:
    code = exc.errno if exc.errno is not None else errno.EIO
    return LogPathError(code, f"{path}: {what}: {exc.strerror or exc}")


def _write_header_in_place(fd: int, path: str, header: LogHeader) -> None:
    try:
        _pwrite_all(fd, encode_header(header), 0)
        _datasync(fd)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)  # leave the file empty, as it was
        raise path_error(path, "cannot write the log header", exc) from exc


def _create(path: str, header: LogHeader) -> None:
    """Create the log atomically: a whole header or no file. Another writer creating it
    at the same time wins the link; both then race for the lock."""
    directory = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp_path = tempfile.mkstemp(
            prefix=f".{os.path.basename(path)}.", suffix=".kvlog.tmp", dir=directory
        )
    except OSError as exc:
        raise path_error(path, "cannot create the log", exc) from exc
    try:
        try:
            _write_all(fd, encode_header(header))
            os.fsync(fd)
        finally:
            os.close(fd)
        with contextlib.suppress(FileExistsError):
            os.link(tmp_path, path)  # never replaces anything
        fsync_directory(directory)
    except OSError as exc:
        raise path_error(path, "cannot create the log", exc) from exc
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp_path)


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


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    done = 0
    while done < len(data):
        written = os.pwrite(fd, data[done:], offset + done)
        if written <= 0:
            raise OSError(errno.EIO, f"pwrite returned {written}")
        done += written


def _datasync(fd: int) -> None:
    if hasattr(os, "fdatasync"):
        os.fdatasync(fd)
    else:  # pragma: no cover - macOS, Windows
        os.fsync(fd)


def _lock(fd: int, path: str) -> None:
    if fcntl is None:  # pragma: no cover
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as exc:
        raise LogLocked(f"{path}: another LogWriter has this log open for append") from exc

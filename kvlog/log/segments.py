"""The segmented log writer: a log directory grown one segment file at a time.

``SegmentedWriter`` has the ``LogWriter`` interface the Engine uses (``append``,
``next_seq``, ``close``, ...) over a directory (format: ``kvlog.log.manifest``). Segment files
are ``LogWriter`` files whose header carries the whole log's sequence number of their first
record, so sequence numbers run on across segments. The Engine seals the open segment at a
step's end once it holds ``segment_bytes`` (``rotation_due``, ``seal()``) and starts the next
one with a checkpoint that carries a snapshot, so every segment replays on its own.

Sealing closes the segment cleanly and records its last sequence number in the manifest
(fsynced) on the serving thread; a background thread ("kvlog-log-sealer") then computes its
SHA-256 (after compressing it with zstd when ``compress``) and records them. Retention runs at
each seal: the oldest sealed segments go while the sealed ones hold more than
``retain_bytes`` or were sealed more than ``retain_seconds`` ago; the open segment always
stays, and it starts with a snapshot, so what is left replays from its first snapshot.

The settings (``segment_bytes``, ``retain_bytes``, ``retain_seconds``, ``compress``) are
kept in the manifest: a writer that reopens the directory keeps them where it is given
None (so ``Engine.resume(DIR)`` seals and retains as the recording did). Retention moves
the manifest's ``start_seq`` past the segments it removes before it removes their files; a
reopening writer removes the files a crash left before ``start_seq``. It also sets aside a
last segment that holds no header (a torn tail: removed when empty, else renamed to
``NAME.torn``), and adopts into the manifest, as sealed, whole segments it does not list.
A segment the manifest lists whose file is gone is damage: when it is the newest (the
records at the log's end are lost) the directory is not continued (``CorruptLogError``).

One writer per directory: a ``LOCK`` file in it is ``flock``-ed (a second writer gets
``LogLocked``). Any ``OSError`` while sealing or starting a segment poisons the writer
(``LogPoisoned``), as a failed write does.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import threading
import time
from collections.abc import Callable

import msgspec

from kvlog.errors import (
    CorruptLogError,
    LogClosed,
    LogExists,
    LogLocked,
    LogPathError,
    LogPoisoned,
    SchemaVersionError,
)
from kvlog.events import Checkpoint, Record
from kvlog.log.format import SEQ_BASE_KEY, Recovery
from kvlog.log.manifest import (
    MANIFEST_NAME,
    Listing,
    Manifest,
    SegmentInfo,
    compress_file,
    file_sha256,
    fsync_directory,
    open_segment,
    read_listing,
    remove_file,
    segment_name,
    write_manifest,
    zstandard,
)
from kvlog.log.writer import DEFAULT_SYNC_INTERVAL_S, LogWriter, SyncMode, path_error

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]

__all__ = ["DEFAULT_SEGMENT_BYTES", "LOCK_NAME", "MIN_SEGMENT_BYTES", "SegmentedWriter"]

DEFAULT_SEGMENT_BYTES = 256 << 20
MIN_SEGMENT_BYTES = 4096
"""Smaller segments would hold little more than their opening snapshot."""
LOCK_NAME = "LOCK"
_SEGMENT_FILE = re.compile(r"^\d{16}\.kvlog(\.zst)?$")
_logger = logging.getLogger("kvlog.log")


class SegmentedWriter:
    """Appends to a log directory (see the module docstring)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        sync: SyncMode = "step",
        *,
        meta: dict[str, str] | None = None,
        new: bool = False,
        sync_interval_s: float = DEFAULT_SYNC_INTERVAL_S,
        segment_bytes: int | None = None,
        retain_bytes: int | None = None,
        retain_seconds: float | None = None,
        compress: bool | None = None,
    ) -> None:
        if compress:
            zstandard()  # MissingExtra now, not at the first seal
        self.path = os.fspath(path).rstrip("/") or "/"
        self.sync_mode: SyncMode = sync
        self._options = (meta or {}, sync_interval_s)
        self._given = (segment_bytes, retain_bytes, retain_seconds, compress)
        self.segment_bytes = DEFAULT_SEGMENT_BYTES
        self.retain: tuple[int | None, float | None] = (None, None)
        self.compress = False
        self._start_seq = 0  # the log's first sequence number (retention moves it)
        self._current: LogWriter | None = None
        self._base = 0  # whole-log seq of the open segment's record 0 (or the next one's)
        self._poison: BaseException | None = None
        self._closed = False
        self._sealer: threading.Thread | None = None
        self._manifest_lock = threading.Lock()
        self.recovery: Recovery | None = None
        self.num_sealed = 0
        self.num_removed = 0
        self._lock_fd = _lock_directory(self.path)
        try:
            self._open(new)
        except BaseException:
            self._release()
            raise

    def _open(self, new: bool) -> None:
        listing = read_listing(self.path)
        if new and listing.segments:
            raise LogExists(
                errno.EEXIST,
                f"{self.path} already holds log segments; use Engine.resume() to continue it",
            )
        self._settle(listing.manifest)
        try:
            segments = self._tidy(listing)
        except OSError as exc:
            raise path_error(self.path, "cannot tidy the log directory", exc) from exc
        self._start_seq = segments[0].first_seq if segments else 0
        self._manifest = self._manifest_of(segments)
        if not segments:
            return
        try:  # the settings, the start, the adopted segments (an index: best effort)
            write_manifest(self.path, self._manifest)
        except OSError as exc:
            _logger.warning("%s: cannot update the manifest: %s", self.path, exc)
        last = segments[-1]
        if last.sealed or last.compressed:
            self._base = last.last_seq + 1 if last.sealed else self._next_seq_after(last)
            return
        self._current = self._writer(last.name, last.first_seq, new=False)
        self._base = last.first_seq
        meta = {k: v for k, v in self._current.header.meta.items() if k != SEQ_BASE_KEY}
        self._options = ({**meta, **self._options[0]}, self._options[1])  # the log's own meta
        self.recovery = self._current.recovery

    def _settle(self, manifest: Manifest | None) -> None:
        """The settings: those given, else the directory's own (its manifest's), else the
        defaults."""
        segment_bytes, retain_bytes, retain_seconds, compress = self._given
        if manifest is not None:
            if segment_bytes is None and manifest.segment_bytes >= MIN_SEGMENT_BYTES:
                segment_bytes = manifest.segment_bytes
            retain_bytes = manifest.retain_bytes if retain_bytes is None else retain_bytes
            retain_seconds = manifest.retain_seconds if retain_seconds is None else retain_seconds
            compress = manifest.compress if compress is None else compress
        self.segment_bytes = segment_bytes or DEFAULT_SEGMENT_BYTES
        self.retain = (retain_bytes, retain_seconds)
        self.compress = bool(compress)
        if self.compress:
            zstandard()

    def _manifest_of(self, segments: list[SegmentInfo]) -> Manifest:
        retain_bytes, retain_seconds = self.retain
        return Manifest(
            segments,
            start_seq=self._start_seq,
            segment_bytes=self.segment_bytes,
            retain_bytes=retain_bytes,
            retain_seconds=retain_seconds,
            compress=self.compress,
        )

    def _tidy(self, listing: Listing) -> list[SegmentInfo]:
        """The segments to go on with: retention's leftover files removed, a headerless
        last segment set aside, unlisted whole segments adopted as sealed; a missing newest
        segment refused (its records, the log's end, are lost)."""
        for name in listing.leftovers:  # a crash between retention's manifest and removals
            remove_file(os.path.join(self.path, name))
        if listing.leftovers:
            _logger.warning(
                "%s: removed %d segment files retention had dropped from the manifest",
                self.path,
                len(listing.leftovers),
            )
            fsync_directory(self.path)
        segments = list(listing.segments)
        if segments and segments[-1].first_seq in listing.missing:
            name = segments[-1].name
            raise CorruptLogError(
                f"the newest segment {name} is missing (the manifest lists it): the log's "
                "last records are lost, so it is not continued (kvlog replay --salvage "
                "reads what is left)",
                path=os.path.join(self.path, name),
                seq=segments[-1].first_seq,
            )
        if segments and self._torn(segments[-1]):
            segments.pop()
        unlisted = set(listing.unlisted)
        return [self._adopt(s) if s.name in unlisted else s for s in segments]

    def _torn(self, info: SegmentInfo) -> bool:
        """Set the last segment aside when it holds no header (removed when empty, else
        renamed ``NAME.torn``); whether it was."""
        from kvlog.log.reader import LogReader  # the reader imports the writer's module

        path = os.path.join(self.path, info.name)
        if info.sealed or info.compressed:
            return False
        try:
            LogReader(path)
            return False
        except SchemaVersionError:
            raise
        except CorruptLogError as exc:
            if os.path.getsize(path) == 0:
                remove_file(path)
            else:
                os.replace(path, path + ".torn")
            fsync_directory(self.path)
            _logger.warning("%s: set aside the last segment (no header): %s", self.path, exc)
            return True

    def _adopt(self, info: SegmentInfo) -> SegmentInfo:
        """A whole segment the manifest does not list, as sealed (read once: its last
        sequence number, its digest); as it is when it does not read."""
        try:
            last = self._next_seq_after(info) - 1
        except CorruptLogError as exc:
            _logger.warning("%s: segment %s not in the manifest: %s", self.path, info.name, exc)
            return info
        path = os.path.join(self.path, info.name)
        return msgspec.structs.replace(
            info, last_seq=last, num_bytes=os.path.getsize(path), sha256=file_sha256(path)
        )

    def _next_seq_after(self, info: SegmentInfo) -> int:
        """The seq after a segment the manifest does not know as sealed (its manifest
        entry was lost): read it."""
        from kvlog.log.reader import LogReader  # the reader imports the writer's module

        with open_segment(self.path, info) as plain:
            reader = LogReader(plain)
            for _ in reader.records():
                pass
        return reader.last_seq + 1

    def _writer(self, name: str, first_seq: int, *, new: bool) -> LogWriter:
        meta, interval = self._options
        return LogWriter(
            os.path.join(self.path, name),
            self.sync_mode,
            meta={**meta, SEQ_BASE_KEY: str(first_seq)},
            new=new,
            sync_interval_s=interval,
        )

    # -- appending -----------------------------------------------------------------------
    @property
    def next_seq(self) -> int:
        """The whole log's sequence number of the next record."""
        return self._base + (0 if self._current is None else self._current.next_seq)

    def unsynced_age_s(self) -> float:
        """The open segment's ``LogWriter.unsynced_age_s`` (0 with none open)."""
        return 0.0 if self._current is None else self._current.unsynced_age_s()

    @property
    def active_path(self) -> str | None:
        """The open segment's file, if one is open."""
        return None if self._current is None else self._current.path

    def append(self, record: Record) -> int:
        """Append one event or checkpoint (starting a segment if none is open); its
        whole-log sequence number."""
        self._check_usable()
        if self._current is None:
            self._start_segment()
        current = self._current
        assert current is not None, "a segment was just started"
        offset = current.end_offset
        seq = self._base + current.append(record)
        if type(record) is Checkpoint and record.snapshot:  # type: ignore[union-attr]
            self._note_snapshot(seq, offset)
        return seq

    def _start_segment(self) -> None:
        name = segment_name(self._base)
        try:
            self._current = self._writer(name, self._base, new=True)
            self._update(SegmentInfo(name, self._base), durable=True)
        except (OSError, LogPathError) as exc:
            self._current_failed(exc)

    def _note_snapshot(self, seq: int, offset: int) -> None:
        """Record where the open segment's latest snapshot starts (a hint, not fsynced)."""
        info = self._manifest.segments[-1]
        info = msgspec.structs.replace(info, snapshot_seq=seq, snapshot_offset=offset)
        try:
            self._update(info, durable=False)
        except OSError as exc:  # a hint: the reader falls back to a scan
            _logger.warning("%s: cannot update the manifest: %s", self.path, exc)

    def _update(self, info: SegmentInfo, *, durable: bool) -> None:
        """Put ``info`` into the manifest (replacing the entry with its first_seq) and
        write it."""
        with self._manifest_lock:
            segments = [s for s in self._manifest.segments if s.first_seq != info.first_seq]
            segments.append(info)
            segments.sort(key=lambda s: s.first_seq)
            self._manifest = self._manifest_of(segments)
            write_manifest(self.path, self._manifest, durable=durable)

    @property
    def rotation_due(self) -> bool:
        """The open segment has reached ``segment_bytes``: seal it at the step's end."""
        current = self._current
        return current is not None and current.end_offset >= self.segment_bytes

    def seal(self) -> None:
        """Close the open segment cleanly, mark it sealed in the manifest, apply retention
        and hand it to the sealer thread (digest, compression). The next append starts a
        new segment."""
        self._check_usable()
        current = self._current
        if current is None:
            return
        self._join_sealer()
        last = self.next_seq - 1
        try:
            current.close()
            self._current = None
            info = msgspec.structs.replace(
                self._manifest.segments[-1],
                last_seq=last,
                num_bytes=os.path.getsize(current.path),
                sealed_at_s=time.time(),
            )
            self._update(info, durable=True)
        except OSError as exc:  # LogPoisoned included
            self._current_failed(exc)
        self._base = last + 1
        self.num_sealed += 1
        self._apply_retention()
        if any(s.first_seq == info.first_seq for s in self._manifest.segments):
            self._sealer = threading.Thread(
                target=self._finish_seal, args=(info,), name="kvlog-log-sealer", daemon=True
            )
            self._sealer.start()

    def _finish_seal(self, info: SegmentInfo) -> None:
        """The sealer thread: compress (optionally) and digest a sealed segment. A failure
        leaves it as it was (still a whole, readable segment) and is logged."""
        path = os.path.join(self.path, info.name)
        try:
            if self.compress:
                stored = compress_file(path)
                info = msgspec.structs.replace(
                    info,
                    name=os.path.basename(stored),
                    compressed=True,
                    num_bytes=os.path.getsize(stored),
                )
                path = stored
            info = msgspec.structs.replace(info, sha256=file_sha256(path))
            self._update(info, durable=True)
            if self.compress:
                remove_file(path[: -len(".zst")])
        except Exception as exc:  # never out of a daemon thread; the segment stays readable
            _logger.warning("%s: finishing sealed segment %s failed: %s", self.path, path, exc)

    def _join_sealer(self) -> None:
        sealer = self._sealer
        if sealer is not None and sealer.ident is not None:
            sealer.join()
        self._sealer = None

    def _apply_retention(self) -> None:
        """Remove the oldest sealed segments beyond ``retain_bytes`` / ``retain_seconds``
        (the manifest first, durably, its ``start_seq`` past them, then the files: a crash
        between leaves files the next writer removes, never a log that does not read)."""
        retain_bytes, retain_seconds = self.retain
        if retain_bytes is None and retain_seconds is None:
            return
        sealed = [s for s in self._manifest.segments if s.sealed]
        total = sum(s.num_bytes for s in sealed)
        now = time.time()
        drop = []
        for info in sealed:
            too_old = retain_seconds is not None and now - info.sealed_at_s > retain_seconds
            too_big = retain_bytes is not None and total > retain_bytes
            if not (too_old or too_big):
                break
            drop.append(info)
            total -= info.num_bytes
        if not drop:
            return
        names = {s.first_seq for s in drop}
        try:
            with self._manifest_lock:
                kept = [s for s in self._manifest.segments if s.first_seq not in names]
                self._start_seq = kept[0].first_seq if kept else self._base
                self._manifest = self._manifest_of(kept)
                write_manifest(self.path, self._manifest, durable=True)
            for info in drop:
                remove_file(os.path.join(self.path, info.name))
                remove_file(os.path.join(self.path, segment_name(info.first_seq)))
        except OSError as exc:  # retention is best effort: the log itself is whole
            _logger.warning("%s: retention failed: %s", self.path, exc)
        self.num_removed += len(drop)

    # -- failures, flushing and closing ---------------------------------------------------
    def _current_failed(self, exc: BaseException) -> None:
        self._poison = exc
        raise LogPoisoned(f"{self.path}: starting or sealing a segment failed: {exc}") from exc

    def _check_usable(self) -> None:
        if self._poison is not None:
            raise LogPoisoned(
                f"{self.path}: an earlier segment operation failed ({self._poison!r})"
            ) from self._poison
        if self._closed:
            raise LogClosed(f"{self.path}: log writer is closed")

    @property
    def poisoned(self) -> bool:
        current = self._current
        return self._poison is not None or (current is not None and current.poisoned)

    @property
    def closed(self) -> bool:
        return self._closed

    def flush(self) -> None:
        self._check_usable()
        if self._current is not None:
            self._current.flush()

    def sync(self) -> None:
        self._check_usable()
        if self._current is not None:
            self._current.sync()

    def close(self) -> None:
        """Close the open segment cleanly (it stays open for ``Engine.resume``), wait for
        the sealer, release the directory. Idempotent."""
        self._end(LogWriter.close)

    def abandon(self) -> None:
        """Leave the open segment as a crash would (``LogWriter.abandon``); idempotent."""
        self._end(LogWriter.abandon)

    def _end(self, end_segment: Callable[[LogWriter], None]) -> None:
        """End the open segment by ``end_segment``, then wait for the sealer and release
        the directory, whatever the segment's end raised; nothing once released."""
        if self._lock_fd < 0:
            return
        try:
            if self._current is not None:
                end_segment(self._current)
        finally:
            self._closed = True
            self._join_sealer()
            self._release()

    def _release(self) -> None:
        if self._lock_fd >= 0:
            self._lock_fd = os.close(self._lock_fd) or -1  # type: ignore[func-returns-value]


def _check_ours(path: str) -> None:
    """``LogPathError`` for an existing directory that holds files but no log segments or
    manifest: kvlog never writes into a directory that is not a log's."""
    try:
        names = os.listdir(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise LogPathError(exc.errno or errno.EIO, f"{path}: cannot list it: {exc}") from exc
    ours = {LOCK_NAME, MANIFEST_NAME}
    if names and not any(n in ours or _SEGMENT_FILE.match(n) for n in names):
        raise LogPathError(
            errno.ENOTEMPTY,
            f"{path} is a directory holding other files and no log: refused, left as it is",
        )


def _lock_directory(path: str) -> int:
    """Create the directory if needed and lock its ``LOCK`` file; the fd. A path that is
    not a directory, or a directory holding other files and no log, is refused untouched."""
    if os.path.lexists(path) and not os.path.isdir(path):
        raise LogPathError(errno.ENOTDIR, f"{path} is not a directory: refused, left as it is")
    _check_ours(path)
    try:
        os.makedirs(path, exist_ok=True)
        fd = os.open(os.path.join(path, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        code = exc.errno if exc.errno is not None else errno.EIO
        raise LogPathError(code, f"{path}: cannot open the log directory: {exc}") from exc
    if fcntl is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            os.close(fd)
            raise LogLocked(f"{path}: another writer has this log directory open") from exc
    return fd

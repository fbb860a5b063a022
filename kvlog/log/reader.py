"""Reading a log: stream its records, verified, without loading the file or changing it.

A torn tail is not an error for a reader: the good records before it are yielded and the
tail is reported on ``LogReader.tail`` (and logged as a warning) once the records are
exhausted. Damage followed by valid data, and any damage in a log closed cleanly, raises
``CorruptLogError`` (see ``kvlog.log.scan`` for the rule). Starting at a sequence number
still verifies the checksum of every record before it, but decodes none of them.

A log is a file or a directory of segments (``kvlog.log.manifest``): a directory reads as
its segments one after the other, with whole-log sequence numbers. A segment the manifest
lists whose file is gone raises ``CorruptLogError`` naming it when the read reaches it (a
read that starts after it never does); the last segment, still open, holding no header
(empty, or cut inside it: a crash right after its file was created) is a torn tail.

Log-internal records are never yielded: ``SnapshotPart`` pieces are joined into the
snapshot of the ``Checkpoint`` that follows them, and ``LogEnd`` (a clean close) is
skipped, so sequence numbers of yielded records can have gaps.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from collections.abc import Generator, Iterator
from typing import BinaryIO, NamedTuple

import msgspec

from kvlog.errors import CorruptLogError, LogNotFound, SchemaVersionError, SegmentsRetired
from kvlog.events import DECODE_ERRORS, Checkpoint, Record
from kvlog.log.format import (
    FLAG_CLOSED,
    PART,
    SEQ_BASE_KEY,
    HeaderRead,
    LogDetached,
    LogEnd,
    LogHeader,
    LogRecord,
    Recovery,
    SnapshotPart,
    frame_kind,
    read_header_info,
    record_seed,
)
from kvlog.log.manifest import (
    SegmentInfo,
    file_sha256,
    list_segments,
    open_segment,
    read_listing,
)
from kvlog.log.scan import FrameScanner
from kvlog.log.writer import check_kind, path_error

__all__ = [
    "DamagedRange",
    "LogReader",
    "RecordAssembler",
    "check_log",
    "read_header",
    "read_log",
]

_logger = logging.getLogger("kvlog.log")
_decoder: msgspec.msgpack.Decoder[LogRecord] = msgspec.msgpack.Decoder(LogRecord)


class DamagedRange(NamedTuple):
    """Records a reader went past (``LogReader(salvage=True, past_damage=True)``): from
    ``first_seq`` (the first not read) to ``resume_seq`` (where reading went on), why;
    empty (``resume_seq == first_seq``) for damage that cost no record (bytes after a
    sealed segment's close)."""

    first_seq: int
    resume_seq: int
    why: str
    path: str = ""
    offset: int = -1

    def __str__(self) -> str:
        lost = f"seq {self.first_seq:,}-{self.resume_seq - 1:,} not read"
        if self.resume_seq - 1 == self.first_seq:
            lost = f"seq {self.first_seq:,} not read"
        if self.resume_seq <= self.first_seq:  # e.g. bytes after a sealed segment's close
            lost = "no record lost"
        at = f", byte offset {self.offset:,}" if self.offset >= 0 else ""
        return f"{lost}: {self.why} ({self.path}{at}); read on from seq {self.resume_seq:,}"


class LogReader:
    """A read-only view of one log: a file, or a directory of segments (``kvlog.log.manifest``).
    The header is read (and checked) at once: a directory's is its last segment's.

    ``salvage=True``: damage that would raise ``CorruptLogError`` during ``records()`` ends
    the iteration instead, after every intact record before it; ``stopped`` then holds the
    error (where and why). With ``past_damage=True`` too, damage followed by a valid
    record goes on there (in a file, or in a directory's segment), and a damaged or
    missing segment of a directory goes on at the next segment: each range not read is a
    :class:`DamagedRange` in ``damaged``, in order; snapshot parts cut by damage are
    dropped (their checkpoint comes without its snapshot). ``gaps``: the ``LogDetached``
    records met so far, as ``(seq, record)``: the recorder stopped there after an I/O
    error."""

    def __init__(
        self, path: str | os.PathLike[str], *, salvage: bool = False, past_damage: bool = False
    ) -> None:
        if past_damage and not salvage:
            raise ValueError("past_damage needs salvage (it goes on past what salvage stops at)")
        self.path = os.fspath(path)
        self.salvage = salvage
        self.past_damage = past_damage
        self.stopped: CorruptLogError | None = None
        self.damaged: list[DamagedRange] = []
        self.gaps: list[tuple[int, LogDetached]] = []
        self.segments: list[SegmentInfo] | None = None
        """A directory's segments, oldest first (None for a single file)."""
        self.missing: frozenset[int] = frozenset()
        """The first sequence numbers of segments the manifest lists whose file is gone."""
        self.unlisted: list[str] = []
        """Segment files the manifest does not list: read without a SHA-256 check."""
        self.strays: list[str] = []
        """Files named like segments, in no manifest, holding no log: not read."""
        self._torn: tuple[SegmentInfo, int, str] | None = None  # the headerless last segment
        if os.path.isdir(self.path):
            info = self._open_directory()
        else:
            info = _header_info(self.path)
            self.first_seq = _seq_base(info.header, self.path)
        self.header, self._data_offset, self.flags = info.header, info.data_offset, info.flags
        self.tail: Recovery | None = None
        self.last_seq = self.first_seq - 1
        self.end_offset = self._data_offset

    def _open_directory(self) -> HeaderRead:
        """List a directory's segments; the header of its last one that has one (an open
        last segment without a header is a torn tail)."""
        listing = read_listing(self.path)
        self.segments, self.missing = listing.segments, listing.missing
        self.unlisted, self.strays = listing.unlisted, listing.strays
        present = [s for s in self.segments if s.first_seq not in self.missing]
        if not present:
            raise LogNotFound(errno.ENOENT, f"{self.path}: a directory with no log segments")
        self.first_seq = self.segments[0].first_seq
        last = present[-1]
        try:
            with open_segment(self.path, last) as plain:  # the others may be gone
                return _header_info(plain)
        except CorruptLogError as exc:
            if last is not self.segments[-1] or last.sealed or last.compressed or len(present) < 2:
                raise
            where = os.path.join(self.path, last.name)
            self._torn = (last, os.path.getsize(where), f"{last.name}: {exc.message}")
        with open_segment(self.path, present[-2]) as plain:
            return _header_info(plain)

    @property
    def stored_segments(self) -> list[SegmentInfo]:
        """A directory's segments whose files hold a log (not missing, not a headerless
        last one), oldest first; empty for a single file."""
        torn = None if self._torn is None else self._torn[0]
        segments = self.segments or []
        return [s for s in segments if s.first_seq not in self.missing and s is not torn]

    def segments_before(self, seq: int) -> int:
        """How many of a directory's segments lie wholly before ``seq`` (a read from
        ``seq`` does not open them); 0 for a single file."""
        firsts = [s.first_seq for s in self.segments or []]
        return sum(1 for after in firsts[1:] if after <= seq)

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
        ``start_seq`` comes without its snapshot. In a directory, segments that end
        before ``start_seq`` are not read at all.
        """
        if start_seq < 0:
            raise ValueError(f"start_seq must be >= 0, not {start_seq}")
        source = (
            self._file_records(start_seq)
            if self.segments is None
            else self._segment_records(start_seq)
        )
        try:
            if not self.salvage:
                yield from source
                return
            for item in source:
                self.last_seq = item[0]  # where a salvaged read ends
                yield item
        except CorruptLogError as exc:
            if not self.salvage or isinstance(exc, SchemaVersionError):
                raise
            self.stopped = exc  # the caller says it (replay's ``salvaged``, the CLI's line)

    def _file_records(self, start_seq: int) -> Iterator[tuple[int, Record]]:
        base = self.first_seq
        with _open(self.path) as file:
            size = os.fstat(file.fileno()).st_size
            seed = record_seed(self.header.file_id)
            scanner = FrameScanner(
                file, self.path, self._data_offset, size, seed, closed=self.closed_cleanly
            )
            assembler = RecordAssembler(self.path, scanner, max(start_seq - base, 0))
            assembler.past_damage, assembler.damaged = self.past_damage, self.damaged
            assembler.seq_base = base
            try:
                for seq, record in assembler.records():
                    yield seq + base, record
            except CorruptLogError as exc:
                if not base or isinstance(exc, SchemaVersionError):
                    raise
                raise _in_segment(exc, base) from exc
            finally:
                self.gaps += [(seq + base, gap) for seq, gap in assembler.gaps]
                assembler.gaps.clear()
        self.tail, self.last_seq = scanner.tail, scanner.last_seq + base
        self.end_offset = scanner.end_offset
        if scanner.tail is not None:
            _logger.warning("%s: torn tail (not modified): %s", self.path, scanner.tail)

    def _segment_records(self, start_seq: int) -> Iterator[tuple[int, Record]]:
        """Every segment's records in turn, each checked to go on where the one before it
        ended (and a sealed one against its manifest entry). A segment whose file went
        away since the listing is looked up again (compressed since), or the read stops
        with ``SegmentsRetired`` (removed by the writer's retention). With
        ``past_damage``, a segment's damage goes on at the next segment."""
        assert self.segments is not None, "a directory reader has segments"
        expected = self.segments[0].first_seq
        i = 0
        while i < len(self.segments):
            info, segments = self.segments[i], self.segments
            following = segments[i + 1].first_seq if i + 1 < len(segments) else -1
            i += 1
            if 0 <= following <= start_seq:
                expected = following
                continue
            if self._torn is not None and info is self._torn[0]:
                self._torn_tail(expected)
                return
            try:
                expected, again = yield from self._segment(info, following, expected, start_seq)
            except CorruptLogError as exc:
                if not self._goes_past(exc, max(expected, self.last_seq + 1), following):
                    raise
                expected = following
                continue
            if again >= 0:
                i = again

    def _segment(
        self, info: SegmentInfo, following: int, expected: int, start_seq: int
    ) -> Generator[tuple[int, Record], None, tuple[int, int]]:
        """One segment's records; then ``(the next sequence number, -1)``, or ``(expected,
        index)`` to read on from the listing's ``index`` (the file moved: ``_relist``)."""
        where = os.path.join(self.path, info.name)
        if info.first_seq in self.missing:
            raise _missing(info, where, following)
        if info.first_seq != expected:
            error = CorruptLogError(
                f"segment {info.name} starts at sequence number {info.first_seq}, "
                f"but the log goes on at {expected}: a segment is missing",
                path=where,
                seq=expected,
            )
            if not (self.past_damage and info.first_seq > expected):
                raise error
            self.damaged.append(DamagedRange(expected, info.first_seq, error.message, where))
        with contextlib.ExitStack() as stack:
            try:
                plain = stack.enter_context(open_segment(self.path, info))
                reader = self._segment_reader(info, where, plain)
            except FileNotFoundError:  # LogNotFound included
                return expected, self._relist(info, expected)
            # salvage is this reader's business; damage gone past is seen as it happens
            reader.past_damage, reader.damaged = self.past_damage, self.damaged
            before = len(self.damaged)
            try:
                yield from reader._file_records(start_seq)
            finally:
                self.gaps += reader.gaps
        if self.salvage and len(self.damaged) == before:  # damage gone past: SHA-256 differs
            _check_digest(info, where)
        self._check_sealed(info, reader, where)
        self.tail, self.last_seq, self.flags = reader.tail, reader.last_seq, reader.flags
        self.end_offset = reader.end_offset
        return reader.last_seq + 1, -1

    def _goes_past(self, exc: CorruptLogError, first: int, following: int) -> bool:
        """With ``past_damage``, a damaged segment is noted in ``damaged`` and the read
        goes on at the next segment (``following``); False when it stops there."""
        if not self.past_damage or following < 0 or isinstance(exc, SchemaVersionError):
            return False
        where = exc.path or self.path
        self.damaged.append(DamagedRange(first, following, exc.message, where, exc.offset))
        return True

    def _torn_tail(self, expected: int) -> None:
        """The last segment holds no header: a torn tail after the records before it."""
        assert self._torn is not None, "only a headerless last segment"
        _, size, why = self._torn
        reason = f"the open segment holds no header (a crash as it was created): {why}"
        self.tail = Recovery(size, expected - 1, 0, reason)
        self.flags &= ~FLAG_CLOSED  # its writer never closed it
        _logger.warning("%s: torn tail (not modified): %s", self.path, self.tail)

    def _relist(self, info: SegmentInfo, expected: int) -> int:
        """The segment ``info`` is not where the listing said: list the directory again.
        The index of the same segment under its new name (compressed by the sealer), or
        ``SegmentsRetired`` naming where the log goes on."""
        assert self.segments is not None, "a directory reader has segments"
        self.segments = segments = list_segments(self.path)
        for index, other in enumerate(segments):
            if other.first_seq == info.first_seq and other.name != info.name:
                return index
        later = [s.first_seq for s in segments if s.first_seq > info.first_seq]
        raise SegmentsRetired(self.path, expected, later[0] if later else -1)

    def _segment_reader(self, info: SegmentInfo, where: str, plain: str) -> LogReader:
        """A reader of one segment file (``plain``: its uncompressed bytes), the stored
        file's digest checked first when it is sealed."""
        if not self.salvage:  # salvage reads the frames first, each checked by its CRC
            _check_digest(info, where)
        reader = LogReader(plain)
        if reader.first_seq != info.first_seq:
            raise CorruptLogError(
                f"segment header says it starts at {reader.first_seq}, its name {info.first_seq}",
                path=where,
                seq=info.first_seq,
            )
        return reader

    def _check_sealed(self, info: SegmentInfo, reader: LogReader, where: str) -> None:
        if info.sealed and reader.last_seq != info.last_seq:
            raise CorruptLogError(
                f"sealed segment ends at sequence number {reader.last_seq}, the manifest "
                f"says {info.last_seq}",
                path=where,
                seq=reader.last_seq + 1,
            )

    def __iter__(self) -> Iterator[tuple[int, Record]]:
        return self.records()


def _in_segment(exc: CorruptLogError, base: int) -> CorruptLogError:
    """A segment's error with whole-log sequence numbers (the message's own count from the
    segment's first record)."""
    message = f"{exc.message} [sequence numbers in this message count from {base}]"
    seq = exc.seq + base if exc.seq >= 0 else exc.seq
    resume = exc.resume_seq + base if exc.resume_seq >= 0 else exc.resume_seq
    return CorruptLogError(
        message,
        path=exc.path,
        offset=exc.offset,
        seq=seq,
        resume_offset=exc.resume_offset,
        resume_seq=resume,
    )


def _missing(info: SegmentInfo, where: str, following: int) -> CorruptLogError:
    """The error for a segment the manifest lists whose file is gone."""
    if following >= 0:
        seqs = f"seq {info.first_seq:,}-{following - 1:,}"
    elif info.sealed:
        seqs = f"seq {info.first_seq:,}-{info.last_seq:,}"
    else:
        seqs = f"seq {info.first_seq:,} on, the log's end"
    return CorruptLogError(
        f"segment {info.name}, listed in the manifest ({seqs}), is gone: a segment is "
        "missing (not removed by retention); its records were not read",
        path=where,
        seq=info.first_seq,
    )


def _check_digest(info: SegmentInfo, where: str) -> None:
    """``CorruptLogError`` when a sealed segment's file is not the one the manifest digested."""
    if info.sealed and info.sha256 and file_sha256(where) != info.sha256:
        raise CorruptLogError(
            "sealed segment's SHA-256 differs from the manifest's", path=where, seq=info.first_seq
        )


def _header_info(path: str) -> HeaderRead:
    with _open(path) as file:
        return read_header_info(file, path)


def _seq_base(header: LogHeader, path: str) -> int:
    """The whole log's sequence number of a file's record 0 (0 but in a segment)."""
    text = header.meta.get(SEQ_BASE_KEY)
    if text is None:
        return 0
    if not text.isdigit():
        raise CorruptLogError(f"bad {SEQ_BASE_KEY} {text!r} in the header", path=path, offset=0)
    return int(text)


def _open(path: str) -> BinaryIO:
    """The log file, opened for reading: ``LogNotFound`` when it is not there,
    ``LogPathError`` for anything but a regular file (a FIFO is never opened)."""
    if check_kind(path) is None:
        raise no_such_log(path)
    try:
        return open(path, "rb", buffering=0)
    except OSError as exc:
        raise path_error(path, "cannot open the log", exc) from exc


class RecordAssembler:
    """Decodes frames into records: joins snapshot parts, skips close records. With
    ``past_damage``, damage the scanner finds valid frames after is gone past (each range
    in ``damaged``, in the file's own sequence numbers); a snapshot whose parts it cut
    is dropped, its checkpoint comes without it."""

    def __init__(self, path: str, scanner: FrameScanner, start_seq: int) -> None:
        self.path = path
        self.gaps: list[tuple[int, LogDetached]] = []
        self.past_damage = False
        self.damaged: list[DamagedRange] = []
        """The ranges gone past, with the whole log's sequence numbers (``seq_base`` on);
        a reader shares its own list here, so a consumer sees each as it happens."""
        self.seq_base = 0  # the whole log's sequence number of this file's record 0
        self.after_damage = False  # parts of a run cut by damage are dropped until index 0
        self.scanner = scanner
        self.start_seq = start_seq
        self.parts: list[bytes] = []
        self.count = 0  # the number of parts the current run announces
        self.skipped_parts = False  # parts of the current run lay before start_seq

    def records(self) -> Iterator[tuple[int, Record]]:
        while True:
            try:
                yield from self._records()
                return
            except CorruptLogError as exc:
                if not self.past_damage or exc.resume_seq < 0:
                    raise
                why = self.scanner.reason or exc.message
                base = self.seq_base
                first, resume = exc.seq + base, exc.resume_seq + base
                self.damaged.append(DamagedRange(first, resume, why, self.path, exc.offset))
                self.scanner.resume_at(exc.resume_offset, exc.resume_seq)
                self.parts, self.after_damage = [], True

    def _records(self) -> Iterator[tuple[int, Record]]:
        offset, seq = -1, -1
        try:
            for offset, seq, payload in self.scanner.frames():
                if seq < self.start_seq:
                    self.skipped_parts = frame_kind(payload) == PART
                    continue
                record = self._record(offset, seq, _decoder.decode(payload))
                if record is not None:
                    yield seq, record
        except DECODE_ERRORS as exc:  # ValidationError is a DecodeError
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
        self.parts, self.skipped_parts, self.after_damage = [], False, False
        if kind is LogDetached:
            assert isinstance(record, LogDetached)
            if parts:
                raise self._corrupt("a detach record inside a snapshot", offset, seq)
            self.gaps.append((seq, record))
            return None
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
        if self.after_damage:
            if part.index:
                return  # the run began before damage gone past: its checkpoint without it
            self.after_damage = False
        count = part.count if not self.parts else self.count
        if part.index != len(self.parts) or part.count != count or part.index >= count:
            raise self._corrupt(
                f"snapshot part {part.index} of {part.count} out of order", offset, seq
            )
        self.count = count
        self.parts.append(part.data)

    def _corrupt(self, message: str, offset: int, seq: int) -> CorruptLogError:
        return CorruptLogError(message, path=self.path, offset=offset, seq=seq)


def check_log(path: str | os.PathLike[str]) -> None:
    """``LogNotFound`` when nothing is at ``path``, in the one wording every subcommand and
    ``LogReader`` use ("PATH: no such log"); what is there is read (and refused) later."""
    text = os.fspath(path)
    if not os.path.lexists(text):
        raise no_such_log(text)


def no_such_log(path: str) -> LogNotFound:
    """The error for a log that is not there."""
    return LogNotFound(errno.ENOENT, f"{path}: no such log")


def read_log(path: str | os.PathLike[str], start_seq: int = 0) -> Iterator[tuple[int, Record]]:
    """Stream ``(seq, record)`` from ``start_seq`` on; a torn tail ends the stream quietly
    (a warning is logged; use ``LogReader`` to inspect it)."""
    return LogReader(path).records(start_seq)  # the header is checked here, at the call


def read_header(path: str | os.PathLike[str]) -> LogHeader:
    """The header of a log (a directory's: its first segment's); raises
    ``CorruptLogError`` or ``SchemaVersionError``."""
    return LogReader(path).header

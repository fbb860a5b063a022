"""The on-disk format of a kvlog log file (format version 1).

A file is a header followed by records, all integers little-endian::

    header  magic "\\x89KVLOG\\r\\n" (8) | format_version u16 | flags u16 | body_len u32
            | crc u32 | body (body_len bytes: msgpack map of LogHeader)
    record  crc u32 | length u32 | seq u64 | payload (length bytes: kvlog.events.encode)

The header crc is CRC-32C over ``format_version..body_len`` and the body; a record crc is
CRC-32C over the header's ``file_id`` (8 bytes) then the rest of its frame (``length``,
``seq``, payload: one contiguous span), so a flipped bit anywhere in a record (its length
and sequence number included) fails the check, and so does a frame copied in from another
log (every log numbers from 0; the random ``file_id`` tells them apart). ``file_id`` 0,
the default of a header without one, means no id in the checksum. ``magic`` and
``format_version`` keep their place in every future format, so an old kvlog can always
tell a newer file from a damaged one. Sequence numbers start at 0 and are dense.

Grown since the first files (old files read as before, and old readers read new files
except for the new record kind):

- ``flags`` bit 0, ``FLAG_CLOSED``: the writer closed the log cleanly (all records synced,
  then this flag written in place and synced; ``flags``, ``body_len`` and ``crc`` are one
  10-byte write inside the first sector). A writer reopening the log clears it, synced,
  before its first append. With the flag set nothing can be torn, so any damage, the last
  record's included, is corruption. Other bits are refused (``SchemaVersionError``).
- ``LogEnd``, a log-internal record: ``close()`` appends it (synced) before setting
  ``FLAG_CLOSED``, so a closed log cut at a record boundary is told from a whole one.
- ``SnapshotPart`` records: a ``Checkpoint`` whose snapshot is larger than
  ``SNAPSHOT_PART_BYTES`` is written as ``count`` parts (``index`` 0..count-1, in order)
  followed at once by the ``Checkpoint`` with an empty snapshot; readers join them back.
  Parts without their checkpoint at the end of a log not closed cleanly are a torn tail.
- ``LogDetached``, a log-internal record: the recorder stopped here after an I/O error
  (``error``, ``errno``); records the writer had buffered or written after the last one
  before it may be missing (a gap). Readers skip it and report it (``LogReader.gaps``).
- A segment of a log directory (``kvlog.log.segments``) is a log file whose header
  ``meta`` holds ``SEQ_BASE_KEY``: the sequence number of its first record in the whole
  log. Its frames still number from 0; readers add the base to what they yield.
"""

from __future__ import annotations

import os
import struct
from typing import BinaryIO, NamedTuple, Union

import msgspec

from kvlog.errors import CorruptLogError, SchemaVersionError
from kvlog.events import DECODE_ERRORS, SCHEMA_VERSION, Record
from kvlog.util import crc32c as _crc32c

__all__ = [
    "FLAGS_OFFSET",
    "FLAG_CLOSED",
    "FORMAT_VERSION",
    "FRAME",
    "FRAME_BYTES",
    "FRAME_HEAD",
    "HEADER_PREFIX_BYTES",
    "MAGIC",
    "MAX_HEADER_BODY_BYTES",
    "MAX_RECORD_BYTES",
    "SNAPSHOT_PART_BYTES",
    "GAP",
    "HeaderRead",
    "END",
    "PART",
    "RECORD",
    "SEQ_BASE_KEY",
    "LogDetached",
    "LogEnd",
    "LogHeader",
    "LogRecord",
    "Recovery",
    "SnapshotPart",
    "encode_header",
    "flags_patch",
    "frame_crc",
    "frame_kind",
    "new_file_id",
    "record_seed",
    "parse_header",
    "read_header_info",
    "read_up_to",
]

MAGIC = b"\x89KVLOG\r\n"
FORMAT_VERSION = 1
MAX_RECORD_BYTES = 64 << 20
"""Bound on one record's payload: a garbled length can never make a reader allocate more."""
MAX_HEADER_BODY_BYTES = 1 << 20
SNAPSHOT_PART_BYTES = 16 << 20
"""Largest snapshot written inside its ``Checkpoint``; larger ones go in ``SnapshotPart``s."""
FLAG_CLOSED = 0x0001
"""Header flag: the log was closed cleanly (see the module docstring)."""
_KNOWN_FLAGS = FLAG_CLOSED
SEQ_BASE_KEY = "kvlog.seq_base"
"""Header ``meta`` key of a segment: the whole log's sequence number of its record 0."""
FLAGS_OFFSET = 10
"""Byte offset of ``flags``; ``flags | body_len | crc`` (10 bytes) are rewritten in place."""

_PREFIX = struct.Struct("<8sHHII")  # magic, format_version, flags, body_len, crc
HEADER_PREFIX_BYTES = _PREFIX.size
FRAME = struct.Struct("<IIQ")  # crc, length, seq
FRAME_BYTES = FRAME.size
FRAME_HEAD = struct.Struct("<IQ")  # length, seq: the checksummed part of FRAME


class LogHeader(msgspec.Struct, frozen=True):
    """What a log says about itself; ``meta`` is free-form (host, model, workload...)."""

    schema_version: int
    kvlog_version: str
    meta: dict[str, str] = msgspec.field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    file_id: int = 0
    """Random per-file value in every record checksum (0: none)."""


class Recovery(msgspec.Struct, frozen=True):
    """A torn tail: ``truncated_bytes`` from byte ``offset`` on (the end of the record with
    sequence number ``last_seq``, -1 when no record survived) are not a valid record."""

    truncated_bytes: int
    last_seq: int
    offset: int
    reason: str = ""


class SnapshotPart(msgspec.Struct, frozen=True, tag_field="type", tag=True):
    """A log-internal record: piece ``index`` of ``count`` of the snapshot of the
    ``Checkpoint`` record that follows the last piece (never yielded by readers)."""

    index: int
    count: int
    data: bytes


class LogEnd(msgspec.Struct, frozen=True, tag_field="type", tag=True):
    """A log-internal record: the last record of a cleanly closed log, written by
    ``close()`` before ``FLAG_CLOSED``; ``offset`` is its own frame's byte offset. A reopened
    log goes on after it (readers skip it)."""

    offset: int


class LogDetached(msgspec.Struct, frozen=True, tag_field="type", tag=True):
    """A log-internal record: the recorder detached from this log after an I/O error
    (``error`` as text, ``errno`` the OS's or 0); what was buffered or written after the
    last record before this one may be missing. Written where the disk still allows."""

    error: str
    errno: int = 0


LogRecord = Union[Record, SnapshotPart, LogEnd, LogDetached]  # noqa: UP007 (Record alias)
"""What a frame's payload decodes to."""
_PART_ENCODED = msgspec.msgpack.encode(SnapshotPart(0, 1, b""))
_PART_PREFIX = _PART_ENCODED[: _PART_ENCODED.index(msgspec.msgpack.encode("index"))]
"""The msgpack map header and ``"type": "SnapshotPart"``: msgspec writes the tag first."""


_END_ENCODED = msgspec.msgpack.encode(LogEnd(0))
_END_PREFIX = _END_ENCODED[: _END_ENCODED.index(msgspec.msgpack.encode("offset"))]
_TAG_LENGTH_AT = 6  # fixmap, fixstr "type", then the tag's fixstr header
_INTERNAL_TAGS = {
    _PART_PREFIX[_TAG_LENGTH_AT]: _PART_PREFIX,
    _END_PREFIX[_TAG_LENGTH_AT]: _END_PREFIX,
}
_GAP_ENCODED = msgspec.msgpack.encode(LogDetached(""))
_GAP_PREFIX = _GAP_ENCODED[: _GAP_ENCODED.index(msgspec.msgpack.encode("error"))]
_INTERNAL_TAGS[_GAP_PREFIX[_TAG_LENGTH_AT]] = _GAP_PREFIX
assert len(_INTERNAL_TAGS) == 3, "internal record tags must differ in length"
RECORD, PART, END, GAP = 0, 1, 2, 3
"""Frame kinds told by ``frame_kind``."""


def frame_kind(payload: bytes | memoryview) -> int:
    """``PART``, ``END``, ``GAP`` or ``RECORD`` (an event or checkpoint), from the
    payload's tag bytes, without decoding."""
    if len(payload) <= _TAG_LENGTH_AT:
        return RECORD
    prefix = _INTERNAL_TAGS.get(payload[_TAG_LENGTH_AT])
    if prefix is None or bytes(payload[: len(prefix)]) != prefix:
        return RECORD
    return PART if prefix is _PART_PREFIX else END if prefix is _END_PREFIX else GAP


class HeaderRead(NamedTuple):
    """A parsed header: the header, the offset of record 0, the flags and the raw body."""

    header: LogHeader
    data_offset: int
    flags: int
    body: bytes


_header_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(LogHeader)


def encode_header(header: LogHeader) -> bytes:
    """The header bytes of a new log file (no flags)."""
    body = _header_encoder.encode(header)
    if len(body) > MAX_HEADER_BODY_BYTES:
        raise ValueError(f"log header meta too large: {len(body)} bytes")
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, 0, len(body), 0)[:FLAGS_OFFSET]
    return prefix + flags_patch(body, 0) + body


def flags_patch(body: bytes, flags: int) -> bytes:
    """The 10 bytes at ``FLAGS_OFFSET`` (flags, body_len, crc) of a header with ``body``."""
    fields = struct.pack("<HHI", FORMAT_VERSION, flags, len(body))
    crc = _crc32c.crc32c(body, _crc32c.crc32c(fields))
    return struct.pack("<HII", flags, len(body), crc)


def new_file_id() -> int:
    """A random nonzero 64-bit file id."""
    return int.from_bytes(os.urandom(8), "little") | 1


def record_seed(file_id: int) -> int:
    """The running CRC that every record checksum of a log starts from."""
    return _crc32c.crc32c(file_id.to_bytes(8, "little")) if file_id else 0


def frame_crc(length: int, seq: int, payload: bytes | bytearray | memoryview, seed: int = 0) -> int:
    """The crc field of a record frame, for a log whose ``record_seed`` is ``seed``."""
    return _crc32c.crc32c(payload, _crc32c.crc32c(FRAME_HEAD.pack(length, seq), seed))


def parse_header(file: BinaryIO, path: str) -> tuple[LogHeader, int]:
    """Read the header at the start of ``file``: the header and the offset of record 0.

    Raises ``SchemaVersionError`` for a format or schema this kvlog cannot read and
    ``CorruptLogError`` for a truncated or damaged header.
    """
    info = read_header_info(file, path)
    return info.header, info.data_offset


def read_header_info(file: BinaryIO, path: str) -> HeaderRead:
    """``parse_header`` with the flags and the raw body too."""
    prefix = read_up_to(file, HEADER_PREFIX_BYTES)
    if len(prefix) < len(MAGIC) or prefix[: len(MAGIC)] != MAGIC:
        raise CorruptLogError("not a kvlog log (bad magic)", path=path, offset=0)
    if len(prefix) < HEADER_PREFIX_BYTES:
        raise CorruptLogError("truncated log header", path=path, offset=len(prefix))
    _, format_version, flags, body_len, crc = _PREFIX.unpack(prefix)
    if format_version != FORMAT_VERSION:
        raise SchemaVersionError(
            f"log format version {format_version}, this kvlog reads {FORMAT_VERSION}",
            path=path,
            offset=len(MAGIC),
        )
    if body_len > MAX_HEADER_BODY_BYTES:
        raise CorruptLogError(f"log header length {body_len} too large", path=path, offset=12)
    body = read_up_to(file, body_len)
    if len(body) < body_len:
        raise CorruptLogError("truncated log header", path=path, offset=len(prefix) + len(body))
    if _crc32c.crc32c(body, _crc32c.crc32c(prefix[8:16])) != crc:
        raise CorruptLogError("log header checksum mismatch", path=path, offset=0)
    if flags & ~_KNOWN_FLAGS:
        raise SchemaVersionError(f"unknown log header flags {flags:#06x}", path=path, offset=10)
    header = _decode_header_body(body, path)
    return HeaderRead(header, HEADER_PREFIX_BYTES + body_len, flags, body)


def _decode_header_body(body: bytes, path: str) -> LogHeader:
    try:
        header = _header_decoder.decode(body)
    except DECODE_ERRORS as exc:  # ValidationError is a DecodeError
        raise CorruptLogError(f"undecodable log header: {exc}", path=path, offset=0) from exc
    if not 1 <= header.schema_version <= SCHEMA_VERSION:
        raise SchemaVersionError(
            f"log schema version {header.schema_version}, this kvlog reads 1..{SCHEMA_VERSION}",
            path=path,
            offset=HEADER_PREFIX_BYTES,
        )
    return header


def read_up_to(file: BinaryIO, num_bytes: int) -> bytes:
    """Read ``num_bytes`` or up to the end of the file, whichever comes first."""
    parts = []
    while num_bytes > 0:
        part = file.read(num_bytes)
        if not part:
            break
        parts.append(part)
        num_bytes -= len(part)
    return b"".join(parts)

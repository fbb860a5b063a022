"""The on-disk format of a kvlog log file (format version 1).

A file is a header followed by records, all integers little-endian::

    header  magic "\\x89KVLOG\\r\\n" (8) | format_version u16 | flags u16 (0) | body_len u32
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
"""

from __future__ import annotations

import os
import struct
from typing import BinaryIO

import msgspec

from kvlog import crc32c as _crc32c
from kvlog.errors import CorruptLogError, SchemaVersionError
from kvlog.events import SCHEMA_VERSION

__all__ = [
    "FORMAT_VERSION",
    "FRAME",
    "FRAME_BYTES",
    "FRAME_HEAD",
    "HEADER_PREFIX_BYTES",
    "MAGIC",
    "MAX_HEADER_BODY_BYTES",
    "MAX_RECORD_BYTES",
    "LogHeader",
    "Recovery",
    "encode_header",
    "frame_crc",
    "new_file_id",
    "record_seed",
    "parse_header",
    "read_up_to",
]

MAGIC = b"\x89KVLOG\r\n"
FORMAT_VERSION = 1
MAX_RECORD_BYTES = 64 << 20
"""Bound on one record's payload: a garbled length can never make a reader allocate more."""
MAX_HEADER_BODY_BYTES = 1 << 20

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


_header_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(LogHeader)


def encode_header(header: LogHeader) -> bytes:
    """The header bytes of a new log file."""
    body = _header_encoder.encode(header)
    if len(body) > MAX_HEADER_BODY_BYTES:
        raise ValueError(f"log header meta too large: {len(body)} bytes")
    fields = _PREFIX.pack(MAGIC, FORMAT_VERSION, 0, len(body), 0)[8:16]
    crc = _crc32c.crc32c(body, _crc32c.crc32c(fields))
    return _PREFIX.pack(MAGIC, FORMAT_VERSION, 0, len(body), crc) + body


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
    prefix = read_up_to(file, HEADER_PREFIX_BYTES)
    if len(prefix) < len(MAGIC) or prefix[: len(MAGIC)] != MAGIC:
        raise CorruptLogError("not a kvlog log (bad magic)", path=path, offset=0)
    if len(prefix) < HEADER_PREFIX_BYTES:
        raise CorruptLogError("truncated log header", path=path, offset=len(prefix))
    _, format_version, _, body_len, crc = _PREFIX.unpack(prefix)
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
    return _decode_header_body(body, path), HEADER_PREFIX_BYTES + body_len


def _decode_header_body(body: bytes, path: str) -> LogHeader:
    try:
        header = _header_decoder.decode(body)
    except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
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

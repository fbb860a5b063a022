"""One msgpack encoder and decoder for every record type, built once.

``decode`` raises :class:`msgspec.DecodeError` (or ``ValidationError``) on bytes that are
not a record of this schema; the log turns that into ``CorruptLogError``. Callers that run a
msgspec decoder themselves catch :data:`DECODE_ERRORS`: msgspec before 0.23 raises a bare
``UnicodeDecodeError`` for a string that is not UTF-8, and its ``DecodeError`` is a
``ValueError`` only from 0.21 on (both seen on msgspec 0.19, which ``msgspec>=0.18`` admits).
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from kvlog.events.types import Event, Plan, Record, StepPacked, packed_counts, packed_ids

__all__ = ["DECODE_ERRORS", "decode", "decode_plan", "encode", "to_dict", "to_json"]

DECODE_ERRORS: tuple[type[Exception], ...] = (msgspec.DecodeError, UnicodeDecodeError)
"""What a msgspec decoder raises on bytes that are not what it decodes, on every version."""

_T = TypeVar("_T")
_encoder = msgspec.msgpack.Encoder()
_decoder: msgspec.msgpack.Decoder[Record] = msgspec.msgpack.Decoder(Record)
_plan_decoder: msgspec.msgpack.Decoder[Plan] = msgspec.msgpack.Decoder(Plan)
_json_encoder = msgspec.json.Encoder()


def encode(record: Record | Plan) -> bytes:
    """Encode an event, checkpoint or plan as msgpack."""
    return _encoder.encode(record)


def decode(data: bytes | memoryview) -> Record:
    """Decode one record (an event or a checkpoint); ``msgspec.DecodeError`` if not one."""
    return _decoded(_decoder, data)


def decode_plan(data: bytes | memoryview) -> Plan:
    """Decode one plan; ``msgspec.DecodeError`` if the bytes are not one."""
    return _decoded(_plan_decoder, data)


def _decoded(decoder: msgspec.msgpack.Decoder[_T], data: bytes | memoryview) -> _T:
    """``decoder.decode(data)``, refusing bad bytes with ``msgspec.DecodeError`` on every
    msgspec version (before 0.23 a string that is not UTF-8 raised ``UnicodeDecodeError``)."""
    try:
        return decoder.decode(data)
    except UnicodeDecodeError as exc:
        raise msgspec.DecodeError(f"MessagePack data is malformed: {exc}") from exc


def to_dict(record: Event | Record | Plan) -> dict[str, Any]:
    """A JSON-ready dict of a record, with its ``type`` tag first (a ``StepPacked``'s
    ``counts`` and ``block_ids`` as lists of ints)."""
    out: dict[str, Any] = {"type": type(record).__name__}
    out.update(msgspec.to_builtins(record))
    if type(record) is StepPacked:  # its packed ids as numbers, not base64
        if len(record.counts) % 4 == 0:
            out["counts"] = packed_counts(record)
        if record.id_bytes in (2, 4) and len(record.block_ids) % record.id_bytes == 0:
            out["block_ids"] = packed_ids(record).tolist()
    return out


def to_json(record: Record | Plan) -> bytes:
    """One JSON line (no newline) for ``kvlog inspect``."""
    return _json_encoder.encode(to_dict(record))

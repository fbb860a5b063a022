"""One msgpack encoder and decoder for every record type, built once.

``decode`` raises :class:`msgspec.DecodeError` (or ``ValidationError``) on bytes that are
not a record of this schema; the log turns that into ``CorruptLogError``.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvlog.events.types import Event, Plan, Record

__all__ = ["decode", "decode_plan", "encode", "to_dict", "to_json"]

_encoder = msgspec.msgpack.Encoder()
_decoder: msgspec.msgpack.Decoder[Record] = msgspec.msgpack.Decoder(Record)
_plan_decoder: msgspec.msgpack.Decoder[Plan] = msgspec.msgpack.Decoder(Plan)
_json_encoder = msgspec.json.Encoder()


def encode(record: Record | Plan) -> bytes:
    """Encode an event, checkpoint or plan as msgpack."""
    return _encoder.encode(record)


def decode(data: bytes | memoryview) -> Record:
    """Decode one record (an event or a checkpoint)."""
    return _decoder.decode(data)


def decode_plan(data: bytes | memoryview) -> Plan:
    """Decode one plan."""
    return _plan_decoder.decode(data)


def to_dict(record: Event | Record | Plan) -> dict[str, Any]:
    """A JSON-ready dict of a record, with its ``type`` tag first."""
    out: dict[str, Any] = {"type": type(record).__name__}
    out.update(msgspec.to_builtins(record))
    return out


def to_json(record: Record | Plan) -> bytes:
    """One JSON line (no newline) for ``kvlog inspect``."""
    return _json_encoder.encode(to_dict(record))

"""Fuzz the event decoder and the log reader with arbitrary and mutated bytes.

The contract: bytes from disk never crash the process with anything but kvlog's own errors.
``kvlog.events.decode`` may raise ``msgspec.DecodeError`` (its ``ValidationError`` included):
the codec documents that the log layer wraps those into ``CorruptLogError``, and the log
tests below check that the wrapping happens for every payload a valid frame can carry.
"""

from __future__ import annotations

import typing

import msgspec
from hypothesis import example, given
from hypothesis import strategies as st
from strategies import any_record

from kvlog.events import Record, decode, encode

# A decoded record must be one of the schema's own types, never a raw container.
_RECORD_TYPES = typing.get_args(Record)


def _decode_or_refuse(data: bytes) -> object | None:
    """Decode ``data``; return None when the decoder refuses it with its documented error."""
    try:
        record = decode(data)
    except msgspec.DecodeError:
        return None
    assert isinstance(record, _RECORD_TYPES), f"decode returned a {type(record).__name__}"
    # Whatever decodes must survive its own round trip unchanged.
    assert decode(encode(record)) == record
    return record


@given(st.binary(max_size=512))
@example(b"")
@example(b"\xc1")  # a reserved msgpack byte
@example(b"\x81\xa4type\xa9StepEnded")  # a tagged map with a missing field
@example(b"\xdf\xff\xff\xff\xff")  # a map that claims 2**32-1 entries
@example(b"\xdd\xff\xff\xff\xff")  # an array that claims 2**32-1 entries
@example(b"\x91" * 5000)  # deep nesting
def test_arbitrary_bytes_decode_or_raise_decode_error(data: bytes) -> None:
    _decode_or_refuse(data)


@st.composite
def _mutated_encodings(draw: st.DrawFn) -> tuple[bytes, bytes]:
    """A valid record's encoding with a few bytes flipped, cut, inserted or removed."""
    original = encode(draw(any_record))
    data = bytearray(original)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "cut", "insert", "delete", "set"]))
        if not data:
            break
        i = draw(st.integers(0, len(data) - 1))
        if op == "flip":
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "cut":
            del data[i:]
        elif op == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del data[i : i + draw(st.integers(1, 8))]
        else:
            data[i] = draw(st.sampled_from([0x00, 0x7F, 0x80, 0xC0, 0xC3, 0xCC, 0xDC, 0xFF]))
    return original, bytes(data)


@given(_mutated_encodings())
def test_mutated_encodings_decode_or_raise_decode_error(case: tuple[bytes, bytes]) -> None:
    original, mutated = case
    record = _decode_or_refuse(mutated)
    if mutated == original:
        assert record == decode(original)


@given(any_record)
def test_every_record_round_trips(record: object) -> None:
    assert decode(encode(record)) == record  # type: ignore[arg-type]

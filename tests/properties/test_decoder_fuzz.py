"""Fuzz the event decoder and the log reader with arbitrary and mutated bytes.

The contract: bytes from disk never crash the process with anything but kvlog's own errors.
``kvlog.events.decode`` may raise ``msgspec.DecodeError`` (its ``ValidationError`` included):
the codec documents that the log layer wraps those into ``CorruptLogError``, and the log
tests below check that the wrapping happens for every payload a valid frame can carry.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import typing
from pathlib import Path

import msgspec
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from kvlog import replay
from kvlog.errors import CorruptLogError, KvlogError
from kvlog.events import Record, RequestFinished, decode, decode_plan, encode
from kvlog.events.codec import DECODE_ERRORS
from kvlog.log import MAGIC, LogReader, LogWriter, read_header
from kvlog.log.format import FRAME, frame_crc, record_seed
from tests.support.strategies import any_record

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
@example(b"\x82\xa4type\xafequestFinished\xa6req_id\xa10")  # a tag that is not UTF-8
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


class _OldMsgspecDecoder:
    """Stands in for a msgspec decoder before 0.23, which raised a bare UnicodeDecodeError
    for a string that is not UTF-8 (``msgspec>=0.18`` admits those versions)."""

    def decode(self, data: object) -> object:
        raise UnicodeDecodeError("utf-8", b"\xa6", 0, 1, "invalid start byte")


def test_decoders_of_old_msgspec_still_raise_the_documented_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kvlog.events.codec
    import kvlog.log.reader

    log_path = str(tmp_path / "a.kvlog")
    with LogWriter(log_path, sync="none") as writer:
        writer.append(RequestFinished(req_id="0"))
    monkeypatch.setattr(kvlog.events.codec, "_decoder", _OldMsgspecDecoder())
    monkeypatch.setattr(kvlog.events.codec, "_plan_decoder", _OldMsgspecDecoder())
    monkeypatch.setattr(kvlog.log.reader, "_decoder", _OldMsgspecDecoder())
    with pytest.raises(msgspec.DecodeError):
        decode(b"\xa1a")
    with pytest.raises(msgspec.DecodeError):
        decode_plan(b"\xa1a")
    with pytest.raises(CorruptLogError, match="does not decode"):
        list(LogReader(log_path))


@given(any_record)
def test_every_record_round_trips(record: object) -> None:
    assert decode(encode(record)) == record  # type: ignore[arg-type]


# -- the log reader (and replay) on arbitrary files -------------------------------------------
def _read_everything(path: str) -> list[object]:
    """Read a log the way every consumer does; only kvlog's own errors may escape."""
    records: list[object] = []
    try:
        for seq, record in LogReader(path).records():
            assert seq == len(records)
            assert isinstance(record, _RECORD_TYPES)
            records.append(record)
    except KvlogError:
        pass
    return records


def _replay_everything(path: str) -> None:
    with contextlib.suppress(KvlogError):
        replay(path)


def _header_bytes(tmp: str) -> tuple[bytes, int]:
    """The bytes of a new log's header and the checksum seed of its records."""
    path = os.path.join(tmp, "empty.kvlog")
    LogWriter(path, sync="none").abandon()  # the header alone (close() adds a LogEnd)
    with open(path, "rb") as file:
        return file.read(), record_seed(read_header(path).file_id)


def _frame(seq: int, payload: bytes, seed: int) -> bytes:
    crc = frame_crc(len(payload), seq, payload, seed)
    return FRAME.pack(crc, len(payload), seq) + payload


def _write(tmp: str, data: bytes) -> str:
    path = os.path.join(tmp, "fuzz.kvlog")
    with open(path, "wb") as file:
        file.write(data)
    return path


@given(st.binary(max_size=400))
@example(MAGIC)
@example(MAGIC + b"\x01\x00\x00\x00\xff\xff\xff\xff")
def test_arbitrary_files_raise_only_kvlog_errors(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = _write(tmp, data)
        _read_everything(path)
        _replay_everything(path)
        try:
            LogWriter(path, sync="none").close()
        except KvlogError:
            with open(path, "rb") as file:
                assert file.read() == data, "a refusing writer modified the file"


@given(st.binary(max_size=400), st.booleans())
def test_a_valid_header_then_arbitrary_bytes(tail: bytes, replay_it: bool) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = _write(tmp, _header_bytes(tmp)[0] + tail)
        assert _read_everything(path) == []  # garbage never passes as a record
        if replay_it:
            _replay_everything(path)


_payloads = st.one_of(
    st.binary(min_size=1, max_size=64),
    _mutated_encodings().map(lambda case: case[1]).filter(bool),
    any_record.map(encode),
)


@given(st.lists(_payloads, min_size=1, max_size=6))
def test_checksummed_frames_with_arbitrary_payloads(payloads: list[bytes]) -> None:
    """Frames whose checksum and seq are right but whose payload may be anything: the
    reader yields what decodes and refuses the first payload that does not with
    ``CorruptLogError`` (a wrapped msgspec error) naming that frame's offset and seq."""
    with tempfile.TemporaryDirectory() as tmp:
        header, seed = _header_bytes(tmp)
        frames = [_frame(seq, payload, seed) for seq, payload in enumerate(payloads)]
        path = _write(tmp, header + b"".join(frames))
        decodable = []
        for payload in payloads:
            record = _decode_or_refuse(payload)
            if record is None:
                break
            decodable.append(record)
        got: list[object] = []
        try:
            got.extend(record for _, record in LogReader(path).records())
        except CorruptLogError as exc:
            bad = len(decodable)
            assert bad < len(payloads), f"refused a log whose payloads all decode: {exc}"
            offset = len(header) + sum(len(f) for f in frames[:bad])
            assert (exc.offset, exc.seq) == (offset, bad), str(exc)
            assert isinstance(exc.__cause__, DECODE_ERRORS)  # a bare UnicodeDecodeError before 0.23
        else:
            assert len(decodable) == len(payloads)
        assert got == decodable
        _replay_everything(path)

"""Damaged logs: torn writes at every byte, every single-bit flip, garbage and misplaced data.

The test parses frame boundaries itself (from the documented byte format), so it checks
the format as well as the recovery rule.
"""

from __future__ import annotations

import contextlib
import os
import random
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvlog.log.scan
from kvlog.errors import CorruptLogError, SchemaVersionError
from kvlog.events import (
    BlocksAllocated,
    CacheConfigured,
    Checkpoint,
    LoadRequested,
    Record,
    RequestFinished,
    RequestPreempted,
    StepEnded,
    StoreRequested,
    TransferFinished,
    encode,
)
from kvlog.log import LogHeader, LogReader, LogWriter, Recovery, read_header
from kvlog.log.format import FRAME, encode_header, frame_crc, record_seed
from kvlog.util.crc32c import crc32c


def _write_log(path: Path, records: list[Record]) -> bytes:
    """A log as a crash leaves it (abandoned, not closed: a closed log has no torn tail)."""
    writer = LogWriter(path, "none")
    for record in records:
        writer.append(record)
    writer.abandon()
    return path.read_bytes()


@contextlib.contextmanager
def _abandoning(writer: LogWriter) -> Iterator[LogWriter]:
    """The writer, abandoned at the end (no close record or flag), so the bytes on disk are
    exactly the records."""
    try:
        yield writer
    finally:
        writer.abandon()


def _overwrite(path: Path, data: bytes) -> None:
    """Replace a file's bytes in place: cheaper than write_bytes, which on ext4 (truncate
    to zero, then write) starts writeback at close and costs milliseconds."""
    if not path.exists():
        path.write_bytes(data)
        return
    with open(path, "r+b") as file:
        file.write(data)
        file.truncate(len(data))


@pytest.fixture()
def no_fsync(monkeypatch: pytest.MonkeyPatch) -> None:
    """Skip fsync where a test reopens hundreds of logs: recovery is what it checks, and
    the SIGKILL test covers durability with real fsyncs."""
    monkeypatch.setattr(os, "fsync", lambda fd: None)
    monkeypatch.setattr(os, "fdatasync", lambda fd: None)


def _frame_offsets(data: bytes) -> list[int]:
    """Start offset of every frame, plus the end of the last one."""
    (body_len,) = struct.unpack_from("<I", data, 12)
    offsets = [20 + body_len]
    while offsets[-1] < len(data):
        (length,) = struct.unpack_from("<I", data, offsets[-1] + 4)
        offsets.append(offsets[-1] + 16 + length)
    assert offsets[-1] == len(data)
    return offsets


def _frame(seq: int, payload: bytes, seed: int = 0) -> bytes:
    return FRAME.pack(frame_crc(len(payload), seq, payload, seed), len(payload), seq) + payload


def _seed(path: Path) -> int:
    return record_seed(read_header(path).file_id)


def _read_all(path: Path) -> tuple[list[Record], Recovery | None]:
    reader = LogReader(path)
    records = [record for _, record in reader]
    return records, reader.tail


def _many_records(count: int) -> list[Record]:
    rng = random.Random(count)
    records: list[Record] = [CacheConfigured(num_gpu_blocks=1024, block_size=16)]
    for step in range(count):
        records.append(BlocksAllocated(f"req-{step}", rng.sample(range(1024), rng.randint(1, 16))))
        if step % 7 == 6:
            records.append(StepEnded(step))
    return records


def test_torn_write_at_every_byte_of_the_last_three_records(tmp_path: Path, no_fsync: None) -> None:
    records = _many_records(180)
    records[-3:] = [
        BlocksAllocated("last-but-two", list(range(1000, 1016))),
        BlocksAllocated("large", list(range(100, 250))),
        StepEnded(10**6),
    ]
    data = _write_log(tmp_path / "full.kvlog", records)
    offsets = _frame_offsets(data)
    assert len(offsets) == len(records) + 1 > 200
    path = tmp_path / "cut.kvlog"
    extra = [RequestFinished("after-recovery"), StepEnded(10**6 + 1)]
    for cut in range(offsets[-4], len(data)):
        kept = sum(1 for end in offsets[1:] if end <= cut)
        boundary = offsets[kept]
        expected_tail = None
        if cut > boundary:
            reason = "incomplete record header" if cut - boundary < 16 else "incomplete record"
            expected_tail = Recovery(cut - boundary, kept - 1, boundary, reason)
        _overwrite(path, data[:cut])
        got, tail = _read_all(path)
        assert got == records[:kept] and tail == expected_tail, cut
        assert path.stat().st_size == cut  # reading never modifies the file

        with _abandoning(LogWriter(path, "none")) as writer:
            assert writer.recovery == expected_tail
            assert writer.next_seq == kept
            for record in extra:
                writer.append(record)
        seed = _seed(path)
        appended = b"".join(_frame(kept + i, encode(r), seed) for i, r in enumerate(extra))
        assert path.read_bytes() == data[:boundary] + appended  # cut exactly, appended cleanly
        if cut % 50 == 0:
            assert [record for _, record in LogReader(path)] == records[:kept] + extra


def _small_log_records() -> list[Record]:
    return [
        CacheConfigured(num_gpu_blocks=64, block_size=16, num_cpu_blocks=8),
        BlocksAllocated("a", [1, 2, 3]),
        StoreRequested(1, [1], [0]),
        RequestPreempted("a"),
        TransferFinished(1, True),
        LoadRequested(2, [0], [5]),
        Checkpoint(seq=5, digest="c" * 64, step=0, snapshot=b"\x00\xff" * 8),
        RequestFinished("a"),
        StepEnded(0),
    ]


def test_every_single_bit_flip_in_records_is_detected(tmp_path: Path) -> None:
    records = _small_log_records()
    data = _write_log(tmp_path / "clean.kvlog", records)
    offsets = _frame_offsets(data)
    last = len(records) - 1
    path = tmp_path / "flipped.kvlog"
    outcomes = {"corrupt": 0, "torn": 0}
    for position in range(offsets[0], len(data)):
        index = sum(1 for start in offsets[1:-1] if start <= position)  # record hit
        for bit in range(8):
            flipped = bytearray(data)
            flipped[position] ^= 1 << bit
            _overwrite(path, flipped)
            try:
                got, tail = _read_all(path)
            except CorruptLogError as exc:
                assert index < last, f"bit {bit} of byte {position}: last record is torn"
                assert (exc.offset, exc.seq) == (offsets[index], index)
                outcomes["corrupt"] += 1
                continue
            assert index == last, f"bit {bit} of byte {position} went undetected"
            assert got == records[:last]  # dropped as a torn tail, never misread
            assert tail is not None and tail.offset == offsets[last]
            outcomes["torn"] += 1
    assert outcomes["torn"] == 8 * (offsets[-1] - offsets[-2])
    assert outcomes["corrupt"] == 8 * (offsets[-2] - offsets[0])


def test_flips_in_the_last_record_are_cut_by_the_writer(tmp_path: Path, no_fsync: None) -> None:
    records = _small_log_records()
    data = _write_log(tmp_path / "clean.kvlog", records)
    offsets = _frame_offsets(data)
    path = tmp_path / "flipped.kvlog"
    for position in range(offsets[-2], offsets[-1], 3):
        flipped = bytearray(data)
        flipped[position] ^= 0x10
        _overwrite(path, flipped)
        with _abandoning(LogWriter(path)) as writer:
            assert writer.recovery is not None
            assert writer.recovery.offset == offsets[-2]
            assert writer.next_seq == len(records) - 1
        assert path.read_bytes() == data[: offsets[-2]]


def test_every_single_bit_flip_in_the_header_is_detected(tmp_path: Path) -> None:
    data = _write_log(tmp_path / "clean.kvlog", [StepEnded(0)])
    header_end = _frame_offsets(data)[0]
    path = tmp_path / "flipped.kvlog"
    for position in range(header_end):
        for bit in range(8):
            flipped = bytearray(data)
            flipped[position] ^= 1 << bit
            _overwrite(path, flipped)
            with pytest.raises(CorruptLogError):
                LogReader(path)
            if bit == position % 8:  # the writer too, on a sample; it never rewrites
                with pytest.raises(CorruptLogError):
                    LogWriter(path)
                assert path.read_bytes() == flipped


def test_short_or_foreign_files_are_corrupt_not_rewritten(tmp_path: Path) -> None:
    data = _write_log(tmp_path / "clean.kvlog", [StepEnded(0)])
    header_end = _frame_offsets(data)[0]
    path = tmp_path / "short.kvlog"
    for cut in range(1, header_end):
        _overwrite(path, data[:cut])
        with pytest.raises(CorruptLogError, match=r"magic|truncated"):
            LogReader(path)
        with pytest.raises(CorruptLogError):
            LogWriter(path)
        assert path.read_bytes() == data[:cut]
    _overwrite(path, b"# a text file, not a log\n")
    with pytest.raises(CorruptLogError, match="magic") as info:
        LogWriter(path)
    assert not isinstance(info.value, SchemaVersionError)
    _overwrite(path, b"")
    with pytest.raises(CorruptLogError, match="magic"):
        LogReader(path)  # a reader does not create logs


def _header_with(format_version: int, header: LogHeader) -> bytes:
    """A well-formed header of another format or schema version."""
    data = bytearray(encode_header(header))
    struct.pack_into("<H", data, 8, format_version)
    struct.pack_into("<I", data, 16, crc32c(bytes(data[20:]), crc32c(bytes(data[8:16]))))
    return bytes(data)


@pytest.mark.parametrize(
    ("format_version", "schema_version", "match"),
    [(2, 1, "format version 2"), (1, 2, "schema version 2"), (1, 0, "schema version 0")],
)
def test_unreadable_versions(
    tmp_path: Path, format_version: int, schema_version: int, match: str
) -> None:
    path = tmp_path / "future.kvlog"
    header = LogHeader(schema_version=schema_version, kvlog_version="9.9.9")
    _overwrite(path, _header_with(format_version, header) + _frame(0, b"\x90"))
    with pytest.raises(SchemaVersionError, match=match):
        LogReader(path)
    with pytest.raises(SchemaVersionError, match=match):
        LogWriter(path)


def test_valid_frame_in_unknown_future_record_is_corrupt_on_read(tmp_path: Path) -> None:
    path = tmp_path / "alien.kvlog"
    data = _write_log(path, [StepEnded(0)])
    _overwrite(path, data + _frame(1, b"\x81\xa4type\xa6Future", _seed(path)))
    reader = LogReader(path)
    with pytest.raises(CorruptLogError, match="does not decode") as info:
        list(reader)
    assert (info.value.offset, info.value.seq) == (len(data), 1)


def test_damage_followed_by_valid_records_is_corrupt(tmp_path: Path) -> None:
    records = _many_records(60)
    data = _write_log(tmp_path / "clean.kvlog", records)
    offsets = _frame_offsets(data)
    path = tmp_path / "holed.kvlog"
    hole = 20  # zeros over records 20 and 21, as a lost page would leave
    damaged = (
        data[: offsets[hole]] + bytes(offsets[hole + 2] - offsets[hole]) + data[offsets[hole + 2] :]
    )
    _overwrite(path, damaged)
    with pytest.raises(CorruptLogError, match=f"sequence number {hole + 2}") as info:
        _read_all(path)
    assert (info.value.offset, info.value.seq) == (offsets[hole], hole)
    with pytest.raises(CorruptLogError):
        LogWriter(path)
    assert path.read_bytes() == damaged
    # A reader still yields the records before the damage as it streams.
    reader_records = []
    with pytest.raises(CorruptLogError):
        for _, record in LogReader(path):
            reader_records.append(record)
    assert reader_records == records[:hole]


def test_misplaced_valid_records_are_corrupt(tmp_path: Path) -> None:
    records = _many_records(30)
    data = _write_log(tmp_path / "clean.kvlog", records)
    offsets = _frame_offsets(data)
    path = tmp_path / "duplicated.kvlog"
    _overwrite(path, data + data[offsets[-2] :])  # the last record again: valid crc, old seq
    with pytest.raises(CorruptLogError, match="out of order") as info:
        _read_all(path)
    assert (info.value.offset, info.value.seq) == (len(data), len(records))
    _overwrite(path, data[: offsets[5]] + data[offsets[6] :])  # record 5 missing
    with pytest.raises(CorruptLogError, match="out of order") as info:
        LogWriter(path)
    assert (info.value.offset, info.value.seq) == (offsets[5], 5)


def test_garbage_tails_are_torn(tmp_path: Path) -> None:
    records = _many_records(40)
    data = _write_log(tmp_path / "clean.kvlog", records)
    path = tmp_path / "garbage.kvlog"
    rng = random.Random(5)
    for tail in (rng.randbytes(100_000), bytes(2_500_000), b"\xff" * 3000):
        _overwrite(path, data + tail)
        got, found = _read_all(path)
        assert got == records
        assert found is not None and (found.offset, found.truncated_bytes) == (len(data), len(tail))
        with _abandoning(LogWriter(path)) as writer:
            assert writer.recovery == found
        assert path.read_bytes() == data


@pytest.mark.parametrize("where", [0, 1, -7, 1 << 20, (1 << 20) + 100_000])
def test_valid_frame_anywhere_after_damage_is_found(tmp_path: Path, where: int) -> None:
    """The forward search works across its chunks (1 MiB) and at their edges."""
    records = _many_records(10)
    data = _write_log(tmp_path / "clean.kvlog", records)
    chunk = kvlog.log.scan._CHUNK_BYTES
    gap = where if where >= 0 else chunk + where  # from where the search starts
    bad = bytes(gap + 1)  # the search starts one byte after the bad frame
    frame = _frame(len(records) + 3, b"\x81\xa4type\xa9StepEnded", _seed(tmp_path / "clean.kvlog"))
    path = tmp_path / "hidden.kvlog"
    _overwrite(path, data + bad + frame + bytes(40))
    with pytest.raises(CorruptLogError) as info:
        _read_all(path)
    assert (info.value.offset, info.value.seq) == (len(data), len(records))
    assert f"follows at byte offset {len(data) + len(bad)}" in str(info.value)


def test_implausible_length_is_bounded(tmp_path: Path) -> None:
    data = _write_log(tmp_path / "clean.kvlog", [StepEnded(0)])
    path = tmp_path / "huge.kvlog"
    huge = struct.pack("<IIQ", 0, (64 << 20) + 1, 1) + b"x" * 64
    _overwrite(path, data + huge)
    got, tail = _read_all(path)
    assert got == [StepEnded(0)]
    assert tail is not None and "length" in tail.reason


def test_a_record_spliced_from_another_log_is_refused(tmp_path: Path) -> None:
    """Both logs number from 0: only the per-file id in each checksum tells a frame of
    another log, at the same seq and of the same length, from ours."""
    ours = [StepEnded(0), RequestFinished("a"), StepEnded(1)]
    theirs = [StepEnded(7), RequestFinished("b"), StepEnded(8)]
    data = _write_log(tmp_path / "ours.kvlog", ours)
    other = _write_log(tmp_path / "theirs.kvlog", theirs)
    starts, other_starts = _frame_offsets(data), _frame_offsets(other)
    assert starts == other_starts  # same layout: only the checksums can tell
    path = tmp_path / "spliced.kvlog"
    _overwrite(path, data[: starts[1]] + other[starts[1] : starts[2]] + data[starts[2] :])
    with pytest.raises(CorruptLogError) as info:
        _read_all(path)
    assert (info.value.offset, info.value.seq) == (starts[1], 1)
    _overwrite(path, data[: starts[2]] + other[starts[2] :])  # their last record: a torn tail
    tail = Recovery(starts[3] - starts[2], 1, starts[2], "record checksum mismatch")
    assert _read_all(path) == (ours[:2], tail)


def test_logs_without_a_file_id_stay_readable(tmp_path: Path) -> None:
    """A header without ``file_id`` (0): record checksums without a per-file value."""
    path = tmp_path / "unsalted.kvlog"
    header = encode_header(LogHeader(schema_version=1, kvlog_version="0.1.0"))
    _overwrite(path, header + _frame(0, encode(StepEnded(0))))
    assert read_header(path).file_id == 0
    with _abandoning(LogWriter(path)) as writer:  # appends keep the log's (absent) id
        assert writer.next_seq == 1
        writer.append(StepEnded(1))
    assert path.read_bytes() == header + _frame(0, encode(StepEnded(0))) + _frame(
        1, encode(StepEnded(1))
    )
    assert [record for _, record in LogReader(path)] == [StepEnded(0), StepEnded(1)]

"""Fault injection on log files: torn tails, bit flips, truncated headers, garbage, splices.

Each damaged file is either recovered (a torn tail: the reader yields the good records and
reports the tail without touching the file; a reopened writer cuts it and appends after it)
or refused (``CorruptLogError`` naming the byte offset and sequence number; a writer that
refuses leaves the file as it was). Never misread: every record a reader yields is the
record written with that sequence number.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from kvlog.errors import CorruptLogError
from kvlog.events import Record, StepEnded
from kvlog.log import LogReader, LogWriter
from tests.support.strategies import any_record

records_lists = st.lists(any_record, min_size=1, max_size=8)


@dataclass
class WrittenLog:
    """A log file and where each record's frame starts and ends."""

    path: str
    records: list[Record]
    starts: list[int]  # byte offset of each record's frame; starts[0] is the header's end
    end: int

    def frame(self, index: int) -> bytes:
        stop = self.starts[index + 1] if index + 1 < len(self.records) else self.end
        return self.data[self.starts[index] : stop]

    @property
    def data(self) -> bytes:
        with open(self.path, "rb") as file:
            return file.read()


@contextmanager
def temp_dir() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="kvlog-faults-") as tmp:
        yield tmp


def write_log(path: str, records: list[Record]) -> WrittenLog:
    """Write ``records``, flushing after each one to learn the frame boundaries; the
    writer is abandoned, not closed (see tests/log/test_paths_and_headers.py for closed logs)."""
    starts = []
    writer = LogWriter(path, sync="none")
    writer.flush()
    for record in records:
        starts.append(os.path.getsize(path))
        writer.append(record)
        writer.flush()
    writer.abandon()  # as a crash leaves it: a log closed cleanly can have no torn tail
    return WrittenLog(path, list(records), starts, os.path.getsize(path))


def rewrite(path: str, data: bytes) -> None:
    with open(path, "wb") as file:
        file.write(data)


def read_all(path: str, originals: list[Record]) -> tuple[list[Record], LogReader]:
    """Every record a reader yields, each checked against what was written at that seq."""
    reader = LogReader(path)
    out: list[Record] = []
    for seq, record in reader.records():
        assert seq == len(out), f"seq {seq} after {len(out)} records"
        assert seq < len(originals) and record == originals[seq], f"misread record {seq}"
        out.append(record)
    return out, reader


def expect_refused(path: str, originals: list[Record], offset: int, seq: int) -> None:
    """Reader and writer refuse with a CorruptLogError at (offset, seq); nothing changes."""
    before = Path(path).read_bytes()
    with pytest.raises(CorruptLogError) as refused:
        read_all(path, originals)
    assert (refused.value.offset, refused.value.seq) == (offset, seq), str(refused.value)
    with pytest.raises(CorruptLogError):
        LogWriter(path, sync="none").close()
    assert Path(path).read_bytes() == before, "a refusing writer modified the file"


def expect_refused_or_torn(path: str, originals: list[Record], offset: int, seq: int) -> None:
    """A frame at ``offset`` that is not record ``seq`` and is the last one in the file: a
    checksum that fails there is a torn tail, a valid frame with a wrong seq a refusal."""
    try:
        expect_refused(path, originals, offset, seq)
    except pytest.fail.Exception:  # DID NOT RAISE: it must then be a torn tail
        expect_torn(path, originals, seq, offset)


def expect_torn(path: str, originals: list[Record], keep: int, offset: int) -> None:
    """The reader yields ``keep`` records and reports the tail; a writer cuts and appends."""
    size = os.path.getsize(path)
    got, reader = read_all(path, originals)
    assert len(got) == keep
    assert reader.tail is not None, "damage after the last record went unreported"
    assert (reader.tail.offset, reader.tail.truncated_bytes) == (offset, size - offset)
    assert reader.tail.last_seq == keep - 1
    assert os.path.getsize(path) == size, "a reader modified the file"
    with LogWriter(path, sync="none") as writer:
        assert writer.recovery is not None
        assert (writer.recovery.offset, writer.recovery.truncated_bytes) == (offset, size - offset)
        assert writer.next_seq == keep
        writer.append(StepEnded(step=7))
    assert os.path.getsize(path) > offset
    got, reader = read_all(path, [*originals[:keep], StepEnded(step=7)])
    assert len(got) == keep + 1 and reader.tail is None


# -- torn tails and garbage -----------------------------------------------------------------
@given(records_lists, st.data())
def test_a_cut_inside_the_last_record_is_a_torn_tail(
    records: list[Record], data: st.DataObject
) -> None:
    with temp_dir() as tmp:
        log = write_log(os.path.join(tmp, "a.kvlog"), records)
        last = log.starts[-1]
        cut = data.draw(st.integers(last + 1, log.end - 1), label="cut")
        rewrite(log.path, log.data[:cut])
        expect_torn(log.path, records, len(records) - 1, last)


@given(records_lists, st.data())
def test_a_cut_at_a_record_boundary_keeps_the_records_before_it(
    records: list[Record], data: st.DataObject
) -> None:
    with temp_dir() as tmp:
        log = write_log(os.path.join(tmp, "a.kvlog"), records)
        keep = data.draw(st.integers(0, len(records)), label="keep")
        rewrite(log.path, log.data[: ([*log.starts, log.end])[keep]])
        got, reader = read_all(log.path, records)
        assert len(got) == keep and reader.tail is None


@given(records_lists, st.binary(min_size=1, max_size=300))
def test_garbage_after_the_last_record_is_a_torn_tail(
    records: list[Record], garbage: bytes
) -> None:
    with temp_dir() as tmp:
        log = write_log(os.path.join(tmp, "a.kvlog"), records)
        rewrite(log.path, log.data + garbage)
        expect_torn(log.path, records, len(records), log.end)


# -- bit flips ------------------------------------------------------------------------------
@given(records_lists, st.data())
def test_a_bit_flip_in_any_record_is_refused_or_a_torn_last_record(
    records: list[Record], data: st.DataObject
) -> None:
    with temp_dir() as tmp:
        log = write_log(os.path.join(tmp, "a.kvlog"), records)
        index = data.draw(st.integers(0, len(records) - 1), label="record")
        frame_end = log.starts[index] + len(log.frame(index))
        byte = data.draw(st.integers(log.starts[index], frame_end - 1), label="byte")
        damaged = bytearray(log.data)
        damaged[byte] ^= 1 << data.draw(st.integers(0, 7), label="bit")
        rewrite(log.path, bytes(damaged))
        if index == len(records) - 1:
            expect_torn(log.path, records, index, log.starts[index])
        else:
            expect_refused(log.path, records, log.starts[index], index)


@given(records_lists, st.data())
def test_a_damaged_or_truncated_header_is_refused(
    records: list[Record], data: st.DataObject
) -> None:
    with temp_dir() as tmp:
        log = write_log(os.path.join(tmp, "a.kvlog"), records)
        header_end = log.starts[0]
        damaged = bytearray(log.data)
        if data.draw(st.booleans(), label="cut"):
            damaged = damaged[: data.draw(st.integers(1, header_end - 1), label="at")]
        else:
            damaged[data.draw(st.integers(0, header_end - 1))] ^= 1 << data.draw(st.integers(0, 7))
        rewrite(log.path, bytes(damaged))
        with pytest.raises(CorruptLogError):  # SchemaVersionError is one
            read_all(log.path, records)
        with pytest.raises(CorruptLogError):
            LogWriter(log.path, sync="none").close()
        assert log.data == bytes(damaged), "a refusing writer modified the file"


# -- records out of place -------------------------------------------------------------------
@given(records_lists.filter(lambda r: len(r) >= 2), st.data())
def test_records_out_of_order_are_refused(records: list[Record], data: st.DataObject) -> None:
    """A record duplicated, dropped or two records swapped: valid frames, wrong seq."""
    with temp_dir() as tmp:
        log = write_log(os.path.join(tmp, "a.kvlog"), records)
        frames = [log.frame(i) for i in range(len(records))]
        header = log.data[: log.starts[0]]
        k = data.draw(st.integers(0, len(records) - 2), label="k")
        how = data.draw(st.sampled_from(["duplicate", "drop", "swap"]), label="how")
        if how == "duplicate":
            frames.insert(k + 1, frames[k])
        elif how == "drop":
            del frames[k]
        else:
            frames[k], frames[k + 1] = frames[k + 1], frames[k]
        rewrite(log.path, header + b"".join(frames))
        bad = k + 1 if how == "duplicate" else k  # the first frame whose seq is wrong
        expect_refused(log.path, records, log.starts[bad], bad)


@given(records_lists, records_lists, st.data())
def test_a_frame_from_another_log_with_a_wrong_seq_is_refused(
    records: list[Record], others: list[Record], data: st.DataObject
) -> None:
    with temp_dir() as tmp:
        log = write_log(os.path.join(tmp, "a.kvlog"), records)
        other = write_log(os.path.join(tmp, "b.kvlog"), others)
        j = data.draw(st.integers(0, len(others) - 1), label="their record")
        k = data.draw(st.integers(0, len(records)).filter(lambda k: k != j), label="our position")
        frames = [log.frame(i) for i in range(len(records))]
        frames.insert(k, other.frame(j))
        rewrite(log.path, log.data[: log.starts[0]] + b"".join(frames))
        offset = ([*log.starts, log.end])[k]
        if k == len(records):  # nothing valid follows it
            expect_refused_or_torn(log.path, records, offset, k)
        else:
            expect_refused(log.path, records, offset, k)


@given(records_lists, records_lists, st.data())
def test_a_frame_from_another_log_with_the_same_seq_is_refused(
    records: list[Record], others: list[Record], data: st.DataObject
) -> None:
    """Both logs number their records from 0, so record k of another log, put in place of
    our record k, has the expected seq and a valid checksum: only a per-file value in the
    checksum (or the frame) can tell it from ours."""
    k = data.draw(st.integers(0, min(len(records), len(others)) - 1), label="k")
    assume(others[k] != records[k])
    with temp_dir() as tmp:
        log = write_log(os.path.join(tmp, "a.kvlog"), records)
        other = write_log(os.path.join(tmp, "b.kvlog"), others)
        frames = [log.frame(i) for i in range(len(records))]
        frames[k] = other.frame(k)
        rewrite(log.path, log.data[: log.starts[0]] + b"".join(frames))
        if k == len(records) - 1:  # nothing valid follows it
            expect_refused_or_torn(log.path, records, log.starts[k], k)
        else:
            expect_refused(log.path, records, log.starts[k], k)

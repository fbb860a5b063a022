"""The log round trip and the writer's API: headers, sync modes, buffering, errors."""

from __future__ import annotations

import os
import tempfile
import typing
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvlog
import kvlog.log.writer
from kvlog.errors import LogClosed, LogLocked, RecordRejected
from kvlog.events import (
    SCHEMA_VERSION,
    BlocksAllocated,
    BlocksReleased,
    CacheConfigured,
    Checkpoint,
    LoadRequested,
    Record,
    RequestFinished,
    RequestPreempted,
    StepEnded,
    StepScheduled,
    StoreRequested,
    SwapPlan,
    TierBatch,
    TierConfigured,
    TierLoadCompleted,
    TierLoadPrepared,
    TierLookedUp,
    TierRequestFinished,
    TierRequestStarted,
    TierReset,
    TierStoreCompleted,
    TierStorePrepared,
    TierTouched,
    TransferBatch,
    TransferFinished,
    TransferSubmitted,
    packed_step,
)
from kvlog.log import (
    FORMAT_VERSION,
    MAGIC,
    SYNC_MODES,
    LogHeader,
    LogReader,
    LogWriter,
    read_header,
    read_log,
)
from tests.support.strategies import any_record

operations = st.lists(
    st.one_of(
        st.tuples(st.just("append"), any_record),
        st.tuples(st.just("append"), any_record),
        st.tuples(st.just("append"), any_record),
        st.tuples(st.just("flush"), st.none()),
        st.tuples(st.just("sync"), st.none()),
        st.tuples(st.just("reopen"), st.sampled_from(SYNC_MODES)),
    ),
    max_size=30,
)


@given(
    operations,
    st.sampled_from(SYNC_MODES),
    st.sampled_from([1, 100, 1 << 20]),
    st.integers(0, 40),
)
def test_round_trip(ops: list[tuple[str, Any]], sync: str, buffer_bytes: int, start: int) -> None:
    """Appends with random flushes, syncs and reopens read back exactly, in order."""
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "round-trip.kvlog")
        appended: list[Record] = []
        writer = LogWriter(path, sync, buffer_bytes=buffer_bytes)  # type: ignore[arg-type]
        for op, arg in ops:
            if op == "append":
                assert writer.append(arg) == len(appended)
                appended.append(arg)
            elif op == "flush":
                writer.flush()
                assert [record for _, record in read_log(path)] == appended
            elif op == "sync":
                writer.sync()
            else:
                writer.close()
                writer = LogWriter(path, arg, buffer_bytes=buffer_bytes)
                assert writer.recovery is None
                assert writer.next_seq == len(appended)
        writer.close()
        reader = LogReader(path)
        got = list(reader.records())
        assert got == list(enumerate(appended))
        assert reader.tail is None and reader.last_seq == len(appended) - 1
        assert list(read_log(path, start_seq=start)) == got[start:]


def test_header_of_a_new_log(tmp_path: Path) -> None:
    path = tmp_path / "new.kvlog"
    with LogWriter(path, meta={"model": "llama", "host": "gaudi-3"}) as writer:
        assert writer.next_seq == 0 and writer.recovery is None
    file_id = writer.header.file_id
    meta = {"model": "llama", "host": "gaudi-3"}
    expected = LogHeader(SCHEMA_VERSION, kvlog.__version__, meta, file_id=file_id)
    assert writer.header == expected == read_header(path) == LogReader(path).header
    assert 0 < file_id < 2**64
    assert expected.format_version == FORMAT_VERSION
    assert path.read_bytes().startswith(MAGIC)
    assert list(read_log(path)) == []
    with LogWriter(path, meta={"other": "x"}) as writer:  # reopen keeps the header
        assert writer.header == expected
    assert os.listdir(tmp_path) == ["new.kvlog"]  # no temporary file left behind
    with LogWriter(tmp_path / "other.kvlog") as other:
        assert other.header.file_id != file_id  # random per file


def test_a_given_file_id_makes_identical_files(tmp_path: Path) -> None:
    records = [BlocksAllocated("a", [1, 2]), StepEnded(0)]
    for name in ("one.kvlog", "two.kvlog"):
        with LogWriter(tmp_path / name, file_id=12345) as writer:
            for record in records:
                writer.append(record)
    assert (tmp_path / "one.kvlog").read_bytes() == (tmp_path / "two.kvlog").read_bytes()
    assert read_header(tmp_path / "one.kvlog").file_id == 12345
    for bad in (0, -1, 2**64):
        with pytest.raises(ValueError, match="file_id"):
            LogWriter(tmp_path / f"bad{bad}.kvlog", file_id=bad)


def test_existing_empty_file_is_a_new_log(tmp_path: Path) -> None:
    path = tmp_path / "touched.kvlog"
    path.touch()
    with LogWriter(path) as writer:
        writer.append(StepEnded(0))
    assert list(read_log(path)) == [(0, StepEnded(0))]


def test_sequence_continues_after_reopen(tmp_path: Path) -> None:
    path = tmp_path / "seq.kvlog"
    for round_ in range(3):
        with LogWriter(path, "none") as writer:
            assert writer.next_seq == 2 * round_
            assert writer.append(BlocksAllocated(f"r{round_}", [round_])) == 2 * round_
            assert writer.append(StepEnded(round_)) == 2 * round_ + 1
    assert [seq for seq, _ in read_log(path)] == list(range(6))
    assert list(read_log(path, start_seq=5)) == [(5, StepEnded(2))]
    assert list(read_log(path, start_seq=6)) == []
    with pytest.raises(ValueError, match="start_seq"):
        list(read_log(path, start_seq=-1))


def test_records_that_are_not_records_are_rejected(tmp_path: Path, monkeypatch: Any) -> None:
    path = tmp_path / "rejected.kvlog"
    with LogWriter(path) as writer:
        size = path.stat().st_size
        with pytest.raises(RecordRejected, match="SwapPlan"):
            writer.append(SwapPlan(0, [(5, 1)], 8, "move"))  # type: ignore[arg-type]
        with pytest.raises(ValueError):  # RecordRejected is a ValueError
            writer.append("StepEnded")  # type: ignore[arg-type]
        monkeypatch.setattr(kvlog.log.writer, "MAX_RECORD_BYTES", 64)
        writer.append(BlocksAllocated("small", [1]))
        with pytest.raises(RecordRejected, match="bytes"):
            writer.append(BlocksAllocated("big", list(range(100))))
        assert writer.next_seq == 1
        writer.append(StepEnded(3))
    assert path.stat().st_size > size
    assert list(read_log(path)) == [(0, BlocksAllocated("small", [1])), (1, StepEnded(3))]


def test_closed_and_locked(tmp_path: Path) -> None:
    path = tmp_path / "locked.kvlog"
    writer = LogWriter(path)
    with pytest.raises(LogLocked):
        LogWriter(path)
    writer.append(StepEnded(1))
    writer.close()
    writer.close()  # idempotent
    assert writer.closed
    with pytest.raises(LogClosed):
        writer.append(StepEnded(2))
    with pytest.raises(LogClosed):
        writer.flush()
    with LogWriter(path) as second:  # the lock went with the first writer
        assert second.next_seq == 1
    with pytest.raises(ValueError, match="sync"):
        LogWriter(path, "sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="meta"):  # ConfigError, a KvlogError
        LogWriter(tmp_path / "meta.kvlog", meta={"n": 1})  # type: ignore[dict-item]


class SyscallSpy:
    """Counts os.write and os.fdatasync calls on one file descriptor."""

    def __init__(self, monkeypatch: Any) -> None:
        self.fd = -1
        self.writes: list[int] = []
        self.syncs: list[int] = []  # len(self.writes) at each fsync
        real_write, real_sync = os.write, os.fdatasync

        def write(fd: int, data: Any) -> int:
            if fd == self.fd:
                self.writes.append(len(data))
            return real_write(fd, data)

        def fdatasync(fd: int) -> None:
            if fd == self.fd:
                self.syncs.append(len(self.writes))
            real_sync(fd)

        monkeypatch.setattr(os, "write", write)
        monkeypatch.setattr(os, "fdatasync", fdatasync)


def _one_step(step: int) -> list[Record]:
    return [
        *(BlocksAllocated(f"r{step}-{i}", list(range(i, i + 4))) for i in range(5)),
        RequestFinished(f"r{step - 1}-0"),
        Checkpoint(seq=step, digest="0" * 64),
        StepEnded(step),
    ]


@pytest.mark.parametrize(
    ("sync", "writes", "syncs"),
    [
        # one write and one fsync per step; close writes its LogEnd record, fsyncs, then
        # sets the header's closed flag and fsyncs again
        ("step", 4, [1, 2, 3, 4, 4]),
        ("always", 25, [*range(1, 26), 25]),
        ("none", 1, [1, 1]),  # everything at close
    ],
)
def test_sync_modes_write_once_per_group(
    tmp_path: Path, monkeypatch: Any, sync: str, writes: int, syncs: list[int]
) -> None:
    spy = SyscallSpy(monkeypatch)
    writer = LogWriter(tmp_path / "spy.kvlog", sync)  # type: ignore[arg-type]
    spy.fd = writer._fd
    records = [record for step in range(3) for record in _one_step(step)]
    for record in records:
        writer.append(record)
    writer.close()
    assert len(spy.writes) == writes
    assert spy.syncs == syncs
    assert [record for _, record in read_log(writer.path)] == records


def test_buffer_is_bounded(tmp_path: Path, monkeypatch: Any) -> None:
    spy = SyscallSpy(monkeypatch)
    writer = LogWriter(tmp_path / "bounded.kvlog", "none", buffer_bytes=4096)
    spy.fd = writer._fd
    records = [BlocksAllocated(f"r{i}", list(range(16))) for i in range(400)]
    for record in records:
        writer.append(record)
        assert len(writer._buffer) < 4096
    assert spy.syncs == [] and len(spy.writes) > 5
    assert all(4096 <= size < 4096 + 100 for size in spy.writes)
    writer.close()
    assert [record for _, record in read_log(writer.path)] == records


KEY, OTHER = b"\x00" * 8 + b"\x00\x00\x00\x01", b"\xff" * 12
TIER_RECORDS: list[Record] = [  # the CPU tier's events (issue 23), keys as raw bytes
    TierConfigured(num_chunks=4, eviction="arc", store_threshold=2, max_tracker_size=9),
    TierRequestStarted("r", 0, [KEY], [512]),
    TierLookedUp("r", 0, KEY, "hit_pending"),
    TierTouched("r", 0, [KEY, OTHER]),
    TierLoadPrepared("r", 0, [KEY], [3]),
    TierLoadCompleted("r", 0, [KEY]),
    TierStorePrepared("r", 0, [OTHER], True, [OTHER], [2], [KEY], [OTHER], [1024]),
    TierStoreCompleted("r", 0, [OTHER], success=False),
    TierRequestFinished("r", 0),
    TierReset(),
    TierBatch([TierLookedUp("r", 1, OTHER, "miss"), TierTouched("r", 1, [OTHER])]),
]


def test_every_record_type_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "types.kvlog"
    config = CacheConfigured(
        num_gpu_blocks=8, block_size=16, num_cpu_blocks=4, pad_sizes=(1, 2), prefix_caching=True
    )
    records: list[Record] = [
        config,
        BlocksAllocated("a", [1, 2]),
        BlocksReleased("a", [2]),
        RequestPreempted("a"),
        RequestFinished("a"),
        StoreRequested(7, [1], [0]),
        LoadRequested(8, [0], [2]),
        TransferFinished(7, True),
        TransferFinished(8, False),
        TransferSubmitted(9),
        Checkpoint(seq=7, digest="f" * 64, step=0, snapshot=bytes(range(256))),
        StepEnded(2**63 - 1),
        StepScheduled(3, {"b": [3, 4], "c": []}, ["a"], preempted=["d"], resumed=["b"]),
        packed_step(StepScheduled(4, {"b": [3, 4], "c": []}, ["a"], resumed=["b"])),
        *TIER_RECORDS,
        TransferBatch([StoreRequested(10, [1], [0], deferred=True), TransferSubmitted(10)]),
    ]
    assert {type(record) for record in records} == set(typing.get_args(Record))
    with LogWriter(path) as writer:
        for record in records:
            writer.append(record)
    got = [record for _, record in read_log(path)]
    assert got == records and got[0].pad_sizes == (1, 2)  # type: ignore[union-attr]

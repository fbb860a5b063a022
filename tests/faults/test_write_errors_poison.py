"""A failing write or fsync poisons the writer; short writes are finished, not lost."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvlog.errors import LogPoisoned, LogWriterError
from kvlog.events import BlocksAllocated, Record, StepEnded
from kvlog.log import LogReader, LogWriter, read_log


class FaultyDisk:
    """Replaces os.write / os.fdatasync / os.fsync for one file descriptor only."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.fd = -1
        self.write_fault: Callable[[int, Any], int] | None = None
        self.sync_fault: OSError | None = None
        real_write, real_fdatasync, real_fsync = os.write, os.fdatasync, os.fsync

        def write(fd: int, data: Any) -> int:
            if fd == self.fd and self.write_fault is not None:
                return self.write_fault(fd, data)
            return real_write(fd, data)

        def sync_with(real: Callable[[int], None]) -> Callable[[int], None]:
            def sync(fd: int) -> None:
                if fd == self.fd and self.sync_fault is not None:
                    raise self.sync_fault
                real(fd)

            return sync

        self.real_write = real_write
        monkeypatch.setattr(os, "write", write)
        monkeypatch.setattr(os, "fdatasync", sync_with(real_fdatasync))
        monkeypatch.setattr(os, "fsync", sync_with(real_fsync))

    def open(self, path: Path, sync: str = "step") -> LogWriter:
        writer = LogWriter(path, sync)  # type: ignore[arg-type]
        self.fd = writer._fd
        return writer


@pytest.fixture()
def disk(monkeypatch: pytest.MonkeyPatch) -> FaultyDisk:
    return FaultyDisk(monkeypatch)


def _assert_poisoned(writer: LogWriter, cause: type[BaseException]) -> None:
    assert writer.poisoned
    for attempt in (
        lambda: writer.append(StepEnded(99)),
        writer.flush,
        writer.sync,
    ):
        with pytest.raises(LogPoisoned, match="earlier write or fsync failed") as info:
            attempt()
        assert isinstance(info.value.__cause__, cause)
    writer.close()  # closes the file without trying to write again
    assert writer.closed


def test_fsync_error_poisons(disk: FaultyDisk, tmp_path: Path) -> None:
    path = tmp_path / "fsync.kvlog"
    writer = disk.open(path)
    writer.append(BlocksAllocated("a", [1]))
    disk.sync_fault = OSError(errno.EIO, "injected fsync failure")
    with pytest.raises(LogPoisoned) as info:
        writer.append(StepEnded(0))  # group commit: write, then the failing fsync
    assert isinstance(info.value, OSError) and isinstance(info.value, LogWriterError)
    assert info.value.__cause__ is disk.sync_fault
    _assert_poisoned(writer, OSError)
    disk.sync_fault = None
    with LogWriter(path) as reopened:  # the bytes did reach the page cache
        assert reopened.next_seq == 2 and reopened.recovery is None


def test_write_error_poisons(disk: FaultyDisk, tmp_path: Path) -> None:
    path = tmp_path / "enospc.kvlog"
    writer = disk.open(path, "always")
    writer.append(StepEnded(0))

    def no_space(fd: int, data: Any) -> int:
        raise OSError(errno.ENOSPC, "injected: no space left")

    disk.write_fault = no_space
    with pytest.raises(LogPoisoned, match="no space"):
        writer.append(StepEnded(1))
    _assert_poisoned(writer, OSError)
    assert [seq for seq, _ in read_log(path)] == [0]


def test_write_cut_short_then_failing_leaves_a_torn_tail(disk: FaultyDisk, tmp_path: Path) -> None:
    path = tmp_path / "half.kvlog"
    writer = disk.open(path, "step")
    writer.append(StepEnded(0))
    calls: list[int] = []

    def half_then_fail(fd: int, data: Any) -> int:
        calls.append(len(data))
        if len(calls) == 1:
            return disk.real_write(fd, bytes(data)[: len(data) // 2])
        raise OSError(errno.EIO, "injected: device gone")

    disk.write_fault = half_then_fail
    writer.append(BlocksAllocated("lost", list(range(40))))
    with pytest.raises(LogPoisoned):
        writer.append(StepEnded(1))
    assert len(calls) == 2  # the writer went on after the short write
    _assert_poisoned(writer, OSError)
    disk.write_fault = None
    with LogWriter(path) as reopened:
        assert reopened.recovery is not None and reopened.recovery.last_seq == 0
        assert reopened.next_seq == 1
        reopened.append(StepEnded(1))
    assert list(read_log(path)) == [(0, StepEnded(0)), (1, StepEnded(1))]


def test_short_writes_are_completed(disk: FaultyDisk, tmp_path: Path) -> None:
    path = tmp_path / "short.kvlog"
    writer = disk.open(path, "step")
    sizes: list[int] = []

    def seven_bytes_at_a_time(fd: int, data: Any) -> int:
        sizes.append(len(data))
        return disk.real_write(fd, bytes(data)[:7])

    disk.write_fault = seven_bytes_at_a_time
    records: list[Record] = [BlocksAllocated(f"r{i}", list(range(i + 1))) for i in range(5)]
    records.append(StepEnded(0))
    for record in records:
        writer.append(record)
    assert len(sizes) > 10 and sizes == sorted(sizes, reverse=True)
    writer.close()
    assert [record for _, record in LogReader(path)] == records


def test_zero_byte_write_poisons(disk: FaultyDisk, tmp_path: Path) -> None:
    writer = disk.open(tmp_path / "zero.kvlog", "always")
    disk.write_fault = lambda fd, data: 0
    with pytest.raises(LogPoisoned, match="returned 0"):
        writer.append(StepEnded(0))
    _assert_poisoned(writer, OSError)


def test_fsync_error_at_close(disk: FaultyDisk, tmp_path: Path) -> None:
    writer = disk.open(tmp_path / "close.kvlog", "none")
    writer.append(StepEnded(0))
    disk.sync_fault = OSError(errno.EIO, "injected fsync failure")
    with pytest.raises(LogPoisoned):
        writer.close()
    assert writer.closed and writer.poisoned
    writer.close()  # idempotent, even poisoned

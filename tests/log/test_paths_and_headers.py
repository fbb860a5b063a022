"""The log file's edges: a path that is not a regular file of ours is refused and left as
it is, a clean close is marked, a foreign header is corruption, large snapshots go in parts
and come back whole, and a refusal leaves no trace."""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from pathlib import Path

import pytest

import kvlog.log.writer as writer_module
from kvlog import Engine, replay
from kvlog.errors import (
    CorruptLogError,
    KvlogError,
    LogExists,
    LogNotFound,
    LogPathError,
    RecordRejected,
)
from kvlog.events import (
    BlocksAllocated,
    CacheConfigured,
    Checkpoint,
    RequestFinished,
    StepEnded,
)
from kvlog.log import LogReader, LogWriter, read_log
from kvlog.log.format import FLAG_CLOSED, FLAGS_OFFSET

CONFIG = CacheConfigured(num_gpu_blocks=64, block_size=16, num_cpu_blocks=8)


def _records(path: Path) -> list[object]:
    return [record for _, record in read_log(path)]


def _flags(path: Path) -> int:
    return int.from_bytes(path.read_bytes()[FLAGS_OFFSET : FLAGS_OFFSET + 2], "little")


def _frame_starts(data: bytes) -> list[int]:
    """Start offset of every frame, then the end of the file (from the byte format)."""
    starts = [20 + int.from_bytes(data[12:16], "little")]
    while starts[-1] < len(data):
        starts.append(
            starts[-1] + 16 + int.from_bytes(data[starts[-1] + 4 : starts[-1] + 8], "little")
        )
    return starts


def _write(path: Path, count: int, *, close: bool) -> bytes:
    writer = LogWriter(path, "none")
    for step in range(count):
        writer.append(BlocksAllocated(f"r{step}", [step]))
        writer.append(StepEnded(step))
    if close:
        writer.close()
    else:
        writer.abandon()
    return path.read_bytes()


# -- item 2: a path that is not a regular file of ours is never replaced ---------------------
def test_a_fifo_and_a_directory_are_refused_and_left_as_they_are(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.kvlog"
    os.mkfifo(fifo)
    directory = tmp_path / "dir.kvlog"
    directory.mkdir()
    (directory / "notes.txt").write_text("not a log")  # an empty directory would be a log's
    for path in (fifo, directory):
        with pytest.raises(LogPathError) as info:
            LogWriter(path)
        assert isinstance(info.value, OSError) and isinstance(info.value, KvlogError)
        with pytest.raises(LogPathError):
            Engine(CONFIG, path)
        with pytest.raises(LogPathError):
            LogReader(path)  # never opened (a FIFO would block)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert stat.S_ISDIR(os.lstat(directory).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir.kvlog", "fifo.kvlog"]


def test_a_character_device_is_refused_and_stays_a_device(tmp_path: Path) -> None:
    """Old code ``os.replace``d a 0-byte device (as root, /dev/null itself)."""
    device = tmp_path / "null.kvlog"
    try:
        os.mknod(device, stat.S_IFCHR | 0o666, os.makedev(1, 3))  # /dev/null's numbers
    except (PermissionError, OSError):
        device = Path("/dev/null")  # refused before anything is written to it
    with pytest.raises(LogPathError, match="character device"):
        LogWriter(device)
    with pytest.raises(LogPathError):
        Engine(CONFIG, device, sync="none")
    assert stat.S_ISCHR(os.lstat(device).st_mode)


def test_symlinks_are_followed_and_kept(tmp_path: Path) -> None:
    """A link to an empty file or to a log is used as its target; the link stays a link."""
    target = tmp_path / "target.kvlog"
    target.touch()
    link = tmp_path / "link.kvlog"
    link.symlink_to(target)
    with Engine(CONFIG, link, sync="none") as engine:
        engine.apply(StepEnded(0))
    assert link.is_symlink() and _records(target)[:2] == [CONFIG, StepEnded(0)]
    with Engine.resume(link, sync="none") as resumed:
        resumed.apply(StepEnded(1))
    assert link.is_symlink() and replay(target).ok


def test_a_dangling_symlink_is_refused_and_nothing_is_created(tmp_path: Path) -> None:
    link = tmp_path / "dangling.kvlog"
    link.symlink_to(tmp_path / "missing" / "x.kvlog")
    for attempt in (lambda: LogWriter(link), lambda: Engine(CONFIG, link), lambda: LogReader(link)):
        with pytest.raises(LogPathError) as info:
            attempt()
        assert info.value.errno == errno.ENOENT
    assert link.is_symlink() and not (tmp_path / "missing").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["dangling.kvlog"]


def test_a_touched_empty_file_gets_its_header_in_place(tmp_path: Path) -> None:
    path = tmp_path / "touched.kvlog"
    path.touch()
    inode = path.stat().st_ino
    with LogWriter(path) as writer:
        writer.append(StepEnded(0))
    assert path.stat().st_ino == inode, "the file was replaced, not written"
    assert _records(path) == [StepEnded(0)]


# -- item 6: creation errors are typed -------------------------------------------------------
@pytest.mark.parametrize("code", [errno.EROFS, errno.ENOSPC, errno.EACCES])
def test_creation_failures_are_log_path_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    def refuse(*args: object, **kwargs: object) -> tuple[int, str]:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    with pytest.raises(LogPathError) as info:
        Engine(CONFIG, tmp_path / "new.kvlog")
    assert info.value.errno == code and isinstance(info.value, OSError)
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_writing_the_header_of_a_touched_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "touched.kvlog"
    path.touch()

    def full(fd: int, data: object, offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(LogPathError) as info:
        LogWriter(path)
    assert info.value.errno == errno.ENOSPC
    assert path.stat().st_size == 0 and len(os.listdir("/proc/self/fd")) == fds
    monkeypatch.undo()
    LogWriter(path).close()  # not locked, still usable


def test_an_unencodable_record_is_rejected_and_the_buffer_stays_clean(tmp_path: Path) -> None:
    """Old code left 16 zero bytes in the buffer when encoding failed: a junk frame."""
    path = tmp_path / "a.kvlog"
    with LogWriter(path, "none") as writer:
        writer.append(StepEnded(0))
        with pytest.raises(RecordRejected):
            writer.append(Checkpoint(seq=0, digest="\udc80"))
        with pytest.raises(RecordRejected):
            writer.append(StepEnded(2**64))
        writer.append(StepEnded(1))
    assert _records(path) == [StepEnded(0), StepEnded(1)]


# -- item 9: another log's header on this log's records --------------------------------------
@pytest.mark.parametrize("closed", [True, False])
def test_another_logs_header_is_corruption_and_nothing_is_cut(tmp_path: Path, closed: bool) -> None:
    ours, theirs = tmp_path / "ours.kvlog", tmp_path / "theirs.kvlog"
    data = _write(ours, 50, close=closed)
    other = _write(theirs, 1, close=False)
    header_end = _frame_starts(data)[0]
    assert header_end == _frame_starts(other)[0]
    spliced = other[:header_end] + data[header_end:]
    ours.write_bytes(spliced)
    with pytest.raises(CorruptLogError) as info:
        list(LogReader(ours).records())
    assert info.value.offset == header_end and info.value.seq == 0
    with pytest.raises(CorruptLogError):
        LogWriter(ours)
    with pytest.raises(CorruptLogError):
        Engine.resume(ours)
    assert ours.read_bytes() == spliced, "records were cut"


# -- item 10: damage after a clean close is corruption ---------------------------------------
def test_a_clean_close_marks_the_header_and_ends_with_a_close_record(tmp_path: Path) -> None:
    path = tmp_path / "a.kvlog"
    _write(path, 3, close=True)
    assert _flags(path) & FLAG_CLOSED
    reader = LogReader(path)
    assert reader.closed_cleanly and len(list(reader.records())) == 6 and reader.last_seq == 5
    with LogWriter(path, "none") as writer:  # reopening clears the flag and cuts the LogEnd
        assert _flags(path) == 0 and writer.next_seq == 6
        writer.append(StepEnded(3))
        writer.abandon()  # a crash now: the log may end torn again
    with open(path, "ab") as file:
        file.write(b"\x07torn")
    with LogWriter(path, "none") as writer:
        assert writer.recovery is not None and writer.next_seq == 7
    assert [seq for seq, _ in read_log(path)] == list(range(7))


def test_every_damage_of_the_last_record_of_a_closed_log_is_corruption(tmp_path: Path) -> None:
    """Old code read 3,382 of 35,507 flips (all in the final checkpoint) as a torn tail."""
    path = tmp_path / "a.kvlog"
    with Engine(CONFIG, path, sync="none") as engine:
        engine.apply(BlocksAllocated("a", [5, 6]))
        engine.apply(StepEnded(0))
    data = path.read_bytes()
    final = _frame_starts(data)[-3]  # the final checkpoint, then the LogEnd record
    for position in range(final, len(data)):
        damaged = bytearray(data)
        damaged[position] ^= 1 << (position % 8)
        path.write_bytes(bytes(damaged))
        with pytest.raises(CorruptLogError):
            list(LogReader(path).records())
        with pytest.raises(CorruptLogError):
            Engine.resume(path)
        assert path.read_bytes() == bytes(damaged)
    for cut in range(final, len(data)):  # a cut, even at a record boundary
        path.write_bytes(data[:cut])
        with pytest.raises(CorruptLogError):
            list(LogReader(path).records())


# -- item 1: snapshots larger than a record are split ----------------------------------------
@pytest.fixture()
def small_parts(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(writer_module, "SNAPSHOT_PART_BYTES", 100)
    return 100


def test_large_snapshots_go_in_parts_and_come_back_whole(tmp_path: Path, small_parts: int) -> None:
    path = tmp_path / "parts.kvlog"
    engine = Engine(CONFIG, path, sync="none", checkpoint_every=1, snapshot_every=1)
    engine.apply(BlocksAllocated("a", list(range(40, 60))))
    engine.apply(StepEnded(0))
    blob, digest, running = engine.snapshot(), engine.digest(), engine.running_digest()
    engine.close()
    assert len(blob) > small_parts
    checkpoints = [r for _, r in read_log(path) if isinstance(r, Checkpoint)]
    assert checkpoints[-1].snapshot == blob and checkpoints[-1].digest == running
    assert replay(path, from_snapshot=True).final_digest == digest
    with Engine.resume(path, sync="none") as resumed:
        assert resumed.digest() == digest
        resumed.apply(RequestFinished("a"))
    assert replay(path).ok


def test_snapshot_parts_without_their_checkpoint_are_a_torn_tail(
    tmp_path: Path, small_parts: int
) -> None:
    path = tmp_path / "torn.kvlog"
    engine = Engine(CONFIG, path, sync="none", checkpoint_every=0)
    engine.apply(BlocksAllocated("a", list(range(40, 60))))
    engine.apply(StepEnded(0))
    assert engine._log is not None
    engine._log.flush()
    size = path.stat().st_size
    engine.checkpoint(snapshot=True)
    engine._log.abandon()
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 3])  # the checkpoint frame torn after its parts
    reader = LogReader(path)
    assert len(list(reader.records())) == 3
    assert reader.tail is not None and reader.tail.offset == size
    with Engine.resume(path, sync="none") as resumed:
        assert resumed.recovery is not None and resumed.recovery.offset == size
        assert resumed.state.request_blocks("a") == list(range(40, 60))


def test_a_four_million_block_pool_checkpoints_closes_and_resumes(tmp_path: Path) -> None:
    """The issue's case: ``RecordRejected`` after the step was logged and applied."""
    path = tmp_path / "big.kvlog"
    config = CacheConfigured(num_gpu_blocks=4_000_000, block_size=16)
    engine = Engine(config, path, checkpoint_every=1, snapshot_every=1, sync="none")
    engine.apply(BlocksAllocated("a", [3_999_999, 3_000_000]))
    engine.apply(StepEnded(0))
    digest = engine.digest()
    engine.close()
    with Engine.resume(path, sync="none") as resumed:
        assert resumed.digest() == digest
    assert replay(path, from_snapshot=True, series=False).final_digest == digest


# -- refusals leave nothing behind -----------------------------------------------------------
def test_engine_on_an_existing_log_is_log_exists_and_touches_nothing(tmp_path: Path) -> None:
    path = tmp_path / "a.kvlog"
    Engine(CONFIG, path, sync="none").close()
    before = path.read_bytes()
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(LogExists) as info:
        Engine(CONFIG, path)
    assert isinstance(info.value, FileExistsError)
    assert path.read_bytes() == before and len(os.listdir("/proc/self/fd")) == fds
    with pytest.raises(LogNotFound):
        Engine.resume(tmp_path / "missing.kvlog")
    assert not (tmp_path / "missing.kvlog").exists()

"""Issue 11, items 1 and 11: what ``apply`` raises leaves nothing half done, resume reports
the cut tail, snapshots are checksummed, ``--against`` a log without ``CacheConfigured``
is a clear refusal, and no user input is guarded by an assert (``python -O``)."""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap
from pathlib import Path

import msgspec
import pytest

from kvlog import Engine, cli, reducers, replay
from kvlog.errors import CorruptLogError, LogPoisoned
from kvlog.events import (
    BlocksAllocated,
    CacheConfigured,
    StepEnded,
    StoreRequested,
)
from kvlog.log import LogWriter

digest_module = importlib.import_module("kvlog.reducers.digest")  # the attribute is a function
CONFIG = CacheConfigured(num_gpu_blocks=64, block_size=16, num_cpu_blocks=8, threshold=4)


def _busy_engine(path: Path | None = None) -> Engine:
    engine = Engine(CONFIG, path, sync="none")
    engine.apply(BlocksAllocated("a", [40, 41, 42]))
    engine.apply(BlocksAllocated("b", [50, 60]))
    engine.apply(StoreRequested(1, [41], [3]))
    engine.apply(StepEnded(0))  # defrag moves a and b down, around the pinned block
    return engine


def test_resume_exposes_the_cut_tail(tmp_path: Path) -> None:
    """It was only a log warning."""
    path = tmp_path / "a.kvlog"
    engine = _busy_engine(path)
    digest = engine.digest()
    assert engine._log is not None
    engine._log.abandon()  # a crash
    with open(path, "ab") as file:
        file.write(b"\x05torn write")
    with Engine.resume(path, sync="none") as resumed:
        assert resumed.recovery is not None
        assert resumed.recovery.truncated_bytes == len(b"\x05torn write")
        assert resumed.digest() == digest
    with Engine.resume(path, sync="none") as again:
        assert again.recovery is None


def test_a_step_is_applied_whole_even_when_its_checkpoint_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A StepEnded is logged and applied whole; only a failing write of the checkpoint
    after it can raise then (``LogPoisoned``: the engine stops; resume has the step). It
    used to raise ``RecordRejected`` for large pools after the step was applied."""
    import kvlog.log.writer as writer_module

    path = tmp_path / "a.kvlog"
    engine = Engine(CONFIG, path, sync="always", checkpoint_every=1)
    engine.apply(BlocksAllocated("a", [40]))
    reference = Engine(CONFIG)
    reference.apply(BlocksAllocated("a", [40]))
    reference.apply(StepEnded(0))
    writes: list[int] = []
    real = writer_module._write_all

    def fail_second(fd: int, data: bytes | bytearray) -> None:
        writes.append(len(data))
        if len(writes) == 2:  # the StepEnded is written, its checkpoint is not
            raise OSError(28, "No space left on device")
        real(fd, data)

    monkeypatch.setattr(writer_module, "_write_all", fail_second)
    with pytest.raises(LogPoisoned):
        engine.apply(StepEnded(0))
    assert engine.digest() == reference.digest()
    with pytest.raises(LogPoisoned):
        engine.apply(StepEnded(1))
    engine.close()
    monkeypatch.undo()
    with Engine.resume(path, sync="none") as resumed:
        assert resumed.digest() == reference.digest()


# -- snapshots: checksummed, old ones still read ---------------------------------------------
def test_every_single_bit_flip_of_a_snapshot_is_refused() -> None:
    """137 of 6,632 flips restored a different, self-consistent state before."""
    engine = _busy_engine()
    blob = engine.snapshot()
    for position in range(len(blob)):
        for bit in range(8):
            flipped = bytearray(blob)
            flipped[position] ^= 1 << bit
            with pytest.raises(CorruptLogError):
                Engine.restore(bytes(flipped))
    assert Engine.restore(blob).digest() == engine.digest()


def _format1(state: reducers.State) -> bytes:
    """A snapshot as older kvlog wrote it (no checksum)."""
    return msgspec.msgpack.encode([digest_module._MAGIC, digest_module._canonical(state), b""])


def test_format_1_snapshots_still_restore_and_are_checked() -> None:
    engine = _busy_engine()
    old = _format1(engine.state)
    assert Engine.restore(old).digest() == engine.digest()
    magic, canonical, last_swap = msgspec.msgpack.decode(old)
    canonical[5][0][1] = [40, 41, 43]  # request "a" claims a block its refs do not count
    with pytest.raises(CorruptLogError):
        Engine.restore(msgspec.msgpack.encode([magic, canonical, last_swap]))


_UNDER_O = textwrap.dedent(
    """
    import msgspec, sys, tempfile, os
    import importlib
    d = importlib.import_module("kvlog.reducers.digest")
    from kvlog import Engine, reducers, replay
    from kvlog.errors import ConfigError, CorruptLogError
    from kvlog.events import BlocksAllocated, CacheConfigured, Checkpoint
    from kvlog.log import LogWriter
    from kvlog.synth.pool import BlockPool
    assert not __debug__
    engine = Engine(CacheConfigured(num_gpu_blocks=64, block_size=16))
    engine.apply(BlocksAllocated("a", [40, 41]))
    magic, canonical, last_swap = msgspec.msgpack.decode(
        msgspec.msgpack.encode([d._MAGIC, d._canonical(engine.state), b""]))
    canonical[5][0][1] = [40, 43]
    try:
        reducers.restore(msgspec.msgpack.encode([magic, canonical, last_swap]))
        sys.exit("an inconsistent snapshot restored under -O")
    except CorruptLogError:
        pass
    try:
        BlockPool(1, False)
        sys.exit("BlockPool(1) accepted under -O")
    except ConfigError:
        pass
    path = os.path.join(tempfile.mkdtemp(), "a.kvlog")
    with LogWriter(path, "none") as writer:
        writer.append(Checkpoint(-1, "0" * 64, -1, reducers.snapshot(reducers.initial_state())))
    try:
        replay(path, from_snapshot=True)
        sys.exit("a snapshot without a configuration replayed under -O")
    except CorruptLogError:
        pass
    print("ok")
    """
)


def test_no_user_input_is_guarded_by_an_assert() -> None:
    """Under ``python -O`` the checks in digest.py, replay.py and synth/pool.py vanished."""
    done = subprocess.run(
        [sys.executable, "-O", "-c", _UNDER_O], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


# -- replay --against ------------------------------------------------------------------------
def test_against_a_log_without_cache_configured_is_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It ended in an AssertionError traceback."""
    good, bad = tmp_path / "good.kvlog", tmp_path / "bad.kvlog"
    _busy_engine(good).close()
    with LogWriter(bad, "none") as writer:
        writer.append(StepEnded(0))
    assert cli.main(["replay", str(good), "--against", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "does not start with CacheConfigured" in err and "Traceback" not in err
    assert replay(good, against=good).ok

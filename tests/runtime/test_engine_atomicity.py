"""What ``apply`` raises leaves nothing half done, resume reports the cut tail it dropped,
and no check of user input is an ``assert`` (each still holds under ``python -O``)."""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvlog import Engine
from kvlog.errors import LogPoisoned
from kvlog.events import (
    BlocksAllocated,
    CacheConfigured,
    StepEnded,
)
from tests.support.engines import busy_engine

digest_module = importlib.import_module("kvlog.reducers.digest")  # the attribute is a function
CONFIG = CacheConfigured(num_gpu_blocks=64, block_size=16, num_cpu_blocks=8, threshold=4)


def test_resume_exposes_the_cut_tail(tmp_path: Path) -> None:
    """Resume says what it cut: ``recovery`` names the torn tail's bytes, and a second
    resume finds nothing to cut."""
    path = tmp_path / "a.kvlog"
    engine = busy_engine(path)
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
    after it can raise then (``LogPoisoned``: the engine stops; resume has the step)."""
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

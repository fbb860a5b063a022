"""A bad snapshot is never trusted: sequential replay verifies every snapshot it passes
against the state replayed up to it, as ``--parallel`` checks the snapshots its segments
start from; resume falls back to an earlier snapshot when the latest is bad;
``Engine.restore`` refuses a snapshot that is not of the log's end, any single bit flip, and
an old-format snapshot whose content is inconsistent."""

from __future__ import annotations

import contextlib
import importlib
from pathlib import Path

import msgspec
import pytest

from kvlog import Engine, reducers, replay
from kvlog.analysis.parallel import replay_segments
from kvlog.errors import ConfigError, CorruptLogError
from kvlog.events import (
    BlocksAllocated,
    CacheConfigured,
    Checkpoint,
    Record,
    RequestFinished,
    StepEnded,
)
from kvlog.log import LogReader, LogWriter
from kvlog.reducers import checkpoint
from kvlog.runtime.fold import state_at_end
from tests.support.engines import busy_engine

CONFIG = CacheConfigured(num_gpu_blocks=64, block_size=16, page_size_bytes=4096, threshold=1)


def _record(path: Path, steps: int = 40, seed: int = 0) -> None:
    """A log with a checkpoint every 4 steps and a snapshot every other checkpoint: each
    step allocates two blocks to a new request and finishes the one before last."""
    with Engine(CONFIG, path, sync="none", checkpoint_every=4, snapshot_every=2) as engine:
        for step in range(steps):
            base = 1 + (step * 7 + seed) % 30
            engine.apply(
                BlocksAllocated(f"r{step}", [base + 32 * (step % 2), base + 1 + 32 * (step % 2)])
            )
            if step >= 1:
                engine.apply(RequestFinished(f"r{step - 1}"))
            engine.apply(StepEnded(step))


def _rewrite(source: Path, target: Path, change: dict[int, bytes]) -> None:
    """``source`` record for record into ``target``, with the snapshots of the checkpoints
    at the sequence numbers in ``change`` replaced (frames and their CRCs are valid)."""
    records: list[Record] = [r for _, r in LogReader(source).records()]
    seqs = [s for s, _ in LogReader(source).records()]
    with LogWriter(target, sync="none", new=True) as writer:
        for seq, record in zip(seqs, records, strict=True):
            if seq in change:
                assert type(record) is Checkpoint and record.snapshot
                record = msgspec.structs.replace(record, snapshot=change[seq])
            assert writer.append(record) == seq


def _snapshots(path: Path) -> list[tuple[int, bytes]]:
    return [
        (seq, r.snapshot)
        for seq, r in LogReader(path).records()
        if type(r) is Checkpoint and r.snapshot
    ]


@pytest.fixture
def good(tmp_path: Path) -> Path:
    path = tmp_path / "good.kvlog"
    _record(path)
    assert len(_snapshots(path)) >= 4
    assert replay(path, verify=True).ok
    return path


def _flipped(blob: bytes) -> bytes:
    middle = len(blob) // 2
    return blob[:middle] + bytes([blob[middle] ^ 0x10]) + blob[middle + 1 :]


def test_a_flipped_snapshot_is_a_divergence(good: Path, tmp_path: Path) -> None:
    seq, blob = _snapshots(good)[1]
    bad = tmp_path / "bad.kvlog"
    _rewrite(good, bad, {seq: _flipped(blob)})
    result = replay(bad, verify=True)
    assert result.divergence is not None and result.divergence.kind == "snapshot"
    assert result.divergence.seq == seq and "does not restore" in result.divergence.message
    with contextlib.suppress(CorruptLogError):  # --parallel refuses it as it restores it
        assert not replay_segments(bad, use_ray=False, max_segments=64).ok


def test_another_checkpoints_snapshot_is_a_divergence(good: Path, tmp_path: Path) -> None:
    snaps = _snapshots(good)
    bad = tmp_path / "swapped.kvlog"
    _rewrite(good, bad, {snaps[1][0]: snaps[2][1]})
    result = replay(bad, verify=True)
    assert result.divergence is not None and result.divergence.kind == "snapshot"
    assert "another state" in result.divergence.message
    assert not replay_segments(bad, use_ray=False, max_segments=64).ok  # parallel agrees


def test_resume_falls_back_past_a_bad_latest_snapshot(good: Path, tmp_path: Path) -> None:
    snaps = _snapshots(good)
    whole, _ = state_at_end(good)
    for change in ({snaps[-1][0]: _flipped(snaps[-1][1])}, {snaps[-1][0]: snaps[0][1]}):
        bad = tmp_path / "bad-latest.kvlog"
        bad.unlink(missing_ok=True)
        _rewrite(good, bad, change)
        state, _ = state_at_end(bad)
        assert checkpoint.checkpoint_digest(state) == checkpoint.checkpoint_digest(whole)
        with Engine.resume(bad) as resumed:
            assert resumed.running_digest() == checkpoint.checkpoint_digest(whole)


def test_restore_refuses_a_snapshot_of_another_log(good: Path, tmp_path: Path) -> None:
    other = tmp_path / "other.kvlog"
    _record(other, steps=30, seed=5)
    with Engine.resume(other) as engine:
        blob_of_other = engine.snapshot()
    before = good.read_bytes()
    with pytest.raises(ConfigError, match="snapshot of the state at the end of"):
        Engine.restore(blob_of_other, log_path=good)
    assert good.read_bytes() == before  # nothing appended, no lock kept
    with Engine.resume(good) as engine:
        blob = engine.snapshot()
    with Engine.restore(blob, log_path=good) as restored:  # its own end: accepted
        restored.apply(StepEnded(100))
    assert replay(good, verify=True).ok


def test_restore_refuses_an_earlier_snapshot_of_the_same_log(good: Path) -> None:
    early = _snapshots(good)[0][1]
    with pytest.raises(ConfigError):
        Engine.restore(early, log_path=good)


# -- checksummed snapshots, old ones still read -----------------------------------------
digest_module = importlib.import_module("kvlog.reducers.digest")  # the attribute is a function


def test_every_single_bit_flip_of_a_snapshot_is_refused() -> None:
    """A snapshot is checksummed: no single bit flip restores (137 of 6,632 flips once
    restored a different, self-consistent state)."""
    engine = busy_engine()
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
    """Snapshots of the old unchecksummed format restore, and their content is checked."""
    engine = busy_engine()
    old = _format1(engine.state)
    assert Engine.restore(old).digest() == engine.digest()
    magic, canonical, last_swap = msgspec.msgpack.decode(old)
    canonical[5][0][1] = [40, 41, 43]  # request "a" claims a block its refs do not count
    with pytest.raises(CorruptLogError):
        Engine.restore(msgspec.msgpack.encode([magic, canonical, last_swap]))

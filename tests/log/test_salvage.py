"""Salvage: ``replay --salvage`` and ``inspect --salvage`` read the intact prefix of a damaged
or truncated log (or segment), say exactly where it stopped and why, and exit 1."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kvlog import Engine, replay
from kvlog.cli import main
from kvlog.errors import CorruptLogError
from kvlog.events import Checkpoint
from kvlog.log import LogReader, list_segments
from kvlog.synth import SynthConfig, SynthRun


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("salvage") / "whole.kvlog"
    config = SynthConfig(steps=400, seed=2)
    with Engine(config.cache_config(), path, checkpoint_every=32) as engine:
        SynthRun(config, engine, None).run()
    return path


def frame_starts(path: Path) -> list[tuple[int, int]]:
    """``(seq, byte offset)`` of every record, from a writer-free scan."""
    reader = LogReader(path)
    starts = []
    end = reader.end_offset
    for seq, _ in reader.records():
        starts.append((seq, end))
        end = reader.end_offset
    return starts


def cut_copy(whole: Path, tmp_path: Path, num_bytes: int) -> Path:
    copy = tmp_path / "cut.kvlog"
    shutil.copy(whole, copy)
    with open(copy, "r+b") as file:
        file.truncate(num_bytes)
    return copy


def test_a_closed_log_cut_short_is_refused_and_salvaged(whole: Path, tmp_path: Path) -> None:
    size = whole.stat().st_size
    copy = cut_copy(whole, tmp_path, size * 2 // 3)  # a partial copy of a closed log
    with pytest.raises(CorruptLogError):
        replay(copy)
    result = replay(copy, salvage=True)
    assert result.ok and result.salvaged
    assert "closed cleanly" in result.salvaged or "incomplete" in result.salvaged
    full = [s for s, r in LogReader(whole).records() if not isinstance(r, Checkpoint)]
    assert 0 < result.num_events < len(full)
    assert result.last_event_seq == full[result.num_events - 1]  # exactly the prefix


def test_damage_followed_by_good_records_is_salvaged_up_to_it(whole: Path, tmp_path: Path) -> None:
    copy = tmp_path / "flipped.kvlog"
    data = bytearray(whole.read_bytes())
    where = len(data) // 2
    data[where] ^= 0xFF
    copy.write_bytes(bytes(data))
    with pytest.raises(CorruptLogError):
        replay(copy)
    result = replay(copy, salvage=True)
    assert result.ok and "checksum mismatch" in result.salvaged
    reader = LogReader(copy, salvage=True)
    seqs = [seq for seq, _ in reader.records()]
    stopped = reader.stopped
    assert stopped is not None and str(stopped) == result.salvaged
    assert stopped.offset <= where < stopped.offset + 4096  # the damaged record, not later
    assert stopped.seq == seqs[-1] + 1 or stopped.seq > seqs[-1]  # nothing after it yielded


def test_the_command_line_says_where_and_exits_1(
    whole: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    copy = cut_copy(whole, tmp_path, whole.stat().st_size - 7)
    assert main(["replay", str(copy)]) == 2  # refused, as before
    capsys.readouterr()
    assert main(["replay", "--salvage", str(copy)]) == 1
    captured = capsys.readouterr()
    assert "salvaged the intact prefix" in captured.err and "byte offset" in captured.err
    assert "verified: the replay agrees with the log" in captured.out
    assert main(["inspect", "--salvage", str(copy)]) == 1
    captured = capsys.readouterr()
    assert captured.out.count("\n") > 100 and "salvaged the intact prefix" in captured.err
    assert main(["replay", "--salvage", str(whole)]) == 0  # a whole log: nothing salvaged


def test_a_damaged_segment_is_salvaged_up_to_it(tmp_path: Path) -> None:
    log = tmp_path / "dir"
    config = SynthConfig(steps=600, seed=2)
    with Engine(config.cache_config(), log, segment_bytes=32 << 10) as engine:
        SynthRun(config, engine, None).run()
    infos = list_segments(str(log))
    assert len(infos) >= 3
    middle = log / infos[1].name
    data = bytearray(middle.read_bytes())
    data[len(data) // 2] ^= 0x55
    middle.write_bytes(bytes(data))
    with pytest.raises(CorruptLogError):
        replay(log)
    result = replay(log, salvage=True)
    assert result.ok and infos[1].name in result.salvaged
    assert infos[0].last_seq < result.last_seq < infos[1].last_seq

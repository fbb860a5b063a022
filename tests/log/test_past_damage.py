"""Salvage past damage: ``LogReader(salvage=True, past_damage=True)`` and ``inspect``/``replay
--salvage --past-damage`` go on at the next valid record after damage (in a file, in a
directory's segment, and at the next segment), list each range not read, and never hand
out a snapshot that damage cut; plain ``--salvage`` still stops at the first damage."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

import kvlog.log.writer as writer_module
from kvlog import Engine, replay
from kvlog.cli import main
from kvlog.errors import CorruptLogError
from kvlog.events import Checkpoint
from kvlog.log import LogReader, list_segments
from kvlog.log.format import PART, frame_kind, read_header_info, record_seed
from kvlog.log.scan import FrameScanner
from kvlog.synth import SynthConfig, SynthRun


def record(path: Path, *, steps: int = 400, **engine: object) -> Path:
    config = SynthConfig(steps=steps, seed=2)
    with Engine(config.cache_config(), path, checkpoint_every=32, **engine) as run:  # type: ignore[arg-type]
        SynthRun(config, run, None).run()
    return path


def frames(path: Path) -> list[tuple[int, int, int]]:
    """``(seq, byte offset, frame kind)`` of every frame of a log file (its own seqs)."""
    with open(path, "rb", buffering=0) as file:
        info = read_header_info(file, str(path))
        size = os.fstat(file.fileno()).st_size
        seed = record_seed(info.header.file_id)
        scanner = FrameScanner(file, str(path), info.data_offset, size, seed)
        return [(seq, offset, frame_kind(payload)) for offset, seq, payload in scanner.frames()]


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def snapshot_seqs(path: Path) -> list[int]:
    return [seq for seq, r in LogReader(path).records() if isinstance(r, Checkpoint) and r.snapshot]


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return record(tmp_path_factory.mktemp("past") / "whole.kvlog", snapshot_every=2)


@pytest.fixture
def flipped(whole: Path, tmp_path: Path) -> tuple[Path, int, int]:
    """A copy with one event's frame flipped between two snapshots: (copy, its seq, the
    first snapshot after it)."""
    snaps = snapshot_seqs(whole)
    assert len(snaps) >= 4
    target = snaps[1] + 5  # an event after the second snapshot
    copy = tmp_path / "flipped.kvlog"
    shutil.copy(whole, copy)
    offset = next(off for seq, off, _ in frames(copy) if seq == target)
    flip(copy, offset + 20)  # inside the payload: the checksum fails
    return copy, target, snaps[2]


def test_the_reader_goes_on_past_a_flipped_byte(
    whole: Path, flipped: tuple[Path, int, int]
) -> None:
    copy, target, _ = flipped
    everything = [seq for seq, _ in LogReader(whole).records()]
    stopping = LogReader(copy, salvage=True)
    prefix = [seq for seq, _ in stopping.records()]
    assert prefix == everything[: everything.index(target)]  # unchanged: stops there
    assert stopping.stopped is not None and stopping.stopped.seq == target
    assert stopping.stopped.resume_seq == target + 1  # the next valid frame, as data
    assert stopping.stopped.resume_offset > stopping.stopped.offset
    assert stopping.damaged == []
    going = LogReader(copy, salvage=True, past_damage=True)
    seqs = [seq for seq, _ in going.records()]
    assert seqs == [seq for seq in everything if seq != target]
    assert going.stopped is None and going.tail is None
    [damage] = going.damaged
    assert (damage.first_seq, damage.resume_seq) == (target, target + 1)
    assert "checksum mismatch" in damage.why and str(copy) == damage.path
    assert f"seq {target:,} not read" in str(damage)


def test_past_damage_needs_salvage(flipped: tuple[Path, int, int]) -> None:
    copy, _, _ = flipped
    with pytest.raises(ValueError, match="salvage"):
        LogReader(copy, past_damage=True)
    with pytest.raises(ValueError, match="salvage"):
        replay(copy, past_damage=True)


def test_replay_goes_on_from_the_next_snapshot(whole: Path, flipped: tuple[Path, int, int]) -> None:
    copy, target, next_snapshot = flipped
    with pytest.raises(CorruptLogError):
        replay(copy)
    prefix = replay(copy, salvage=True)
    result = replay(copy, salvage=True, past_damage=True)
    assert result.ok and not result.salvaged
    assert result.unverified == [(target, next_snapshot - 1)]
    assert len(result.damaged) == 1 and f"seq {target:,}" in result.damaged[0]
    assert result.num_verified > prefix.num_verified  # checkpoints after the snapshot
    assert result.last_seq > next_snapshot and result.last_event_seq > prefix.last_event_seq
    assert result.final_digest == replay(whole).final_digest  # the same end state


def test_the_command_line_goes_past_damage(
    whole: Path, flipped: tuple[Path, int, int], capsys: pytest.CaptureFixture[str]
) -> None:
    copy, target, next_snapshot = flipped
    assert main(["inspect", "--salvage", str(copy)]) == 1
    stopped = capsys.readouterr()
    last_of_prefix = json.loads(stopped.out.splitlines()[-1])["seq"]
    assert stopped.err.splitlines()[-1].endswith("--past-damage goes on there")  # the hint
    assert last_of_prefix < target
    assert main(["inspect", "--salvage", "--past-damage", str(copy)]) == 1
    captured = capsys.readouterr()
    seqs = [json.loads(line)["seq"] for line in captured.out.splitlines()]
    assert target not in seqs and max(seqs) > next_snapshot  # records after the damage
    assert seqs == [s for s, _ in LogReader(whole).records() if s != target]
    lines = captured.err.splitlines()
    assert len(lines) == 1 and f"seq {target:,} not read" in lines[0]
    assert main(["replay", "--salvage", "--past-damage", str(copy)]) == 1
    captured = capsys.readouterr()
    assert f"seq {target:,}-{next_snapshot - 1:,}" in captured.out  # the verdict says it
    assert "verified where it was read" in captured.out
    assert captured.err.count("went past damage") == 1


def test_past_damage_alone_is_refused_in_one_line(
    flipped: tuple[Path, int, int], capsys: pytest.CaptureFixture[str]
) -> None:
    copy, _, _ = flipped
    for command in ("inspect", "replay"):
        assert main([command, "--past-damage", str(copy)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--past-damage" in err and "--salvage" in err
    assert main(["replay", "--salvage", "--past-damage", "--against", str(copy), str(copy)]) == 2


def test_two_damaged_ranges_and_none_after_the_last_snapshot(whole: Path, tmp_path: Path) -> None:
    snaps = snapshot_seqs(whole)
    copy = tmp_path / "twice.kvlog"
    shutil.copy(whole, copy)
    offsets = {seq: off for seq, off, _ in frames(copy)}
    first, second = snaps[0] + 3, snaps[-2] + 2  # no snapshot but the closing one after it
    flip(copy, offsets[first] + 20)
    flip(copy, offsets[second] + 20)
    result = replay(copy, salvage=True, past_damage=True)
    assert result.ok and len(result.damaged) == 2
    assert result.unverified[0] == (first, snaps[1] - 1)
    assert result.unverified[1][0] == second and result.unverified[1][1] >= snaps[-1] - 1


def test_a_flip_inside_snapshot_parts_drops_that_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(writer_module, "SNAPSHOT_PART_BYTES", 512)  # snapshots in parts
    log = record(tmp_path / "parts.kvlog", snapshot_every=2)
    parts = [(seq, off) for seq, off, kind in frames(log) if kind == PART]
    assert len(parts) > 20
    runs = [seq for seq, _ in parts if seq - 1 not in {s for s, _ in parts}]  # run starts
    start = runs[1]  # the second snapshot's parts
    seq, offset = next((s, o) for s, o in parts if s == start + 1)  # part 1 of the run
    flip(log, offset + 20)
    reader = LogReader(log, salvage=True, past_damage=True)
    records = dict(reader.records())
    [damage] = reader.damaged
    assert (damage.first_seq, damage.resume_seq) == (seq, seq + 1)
    cut = next(s for s in sorted(records) if s > seq and isinstance(records[s], Checkpoint))
    checkpoint = records[cut]
    assert isinstance(checkpoint, Checkpoint) and checkpoint.snapshot == b""  # not a wrong one
    whole_snapshots = [s for s, r in records.items() if isinstance(r, Checkpoint) and r.snapshot]
    next_snapshot = min(s for s in whole_snapshots if s > cut)
    result = replay(log, salvage=True, past_damage=True)
    assert result.ok and result.divergence is None
    assert result.unverified == [(seq, next_snapshot - 1)]
    with pytest.raises(CorruptLogError):  # plain salvage still stops at it
        list(LogReader(log).records())
    stopping = LogReader(log, salvage=True)
    assert max(s for s, _ in stopping.records()) < seq and stopping.stopped is not None


@pytest.fixture(scope="module")
def directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    log = tmp_path_factory.mktemp("pastdir") / "dir"
    record(log, steps=600, segment_bytes=32 << 10)
    assert len(list_segments(str(log))) >= 4
    return log


def test_a_directory_goes_on_within_a_segment(directory: Path, tmp_path: Path) -> None:
    log = tmp_path / "dir"
    shutil.copytree(directory, log)
    infos = list_segments(str(log))
    middle = log / infos[1].name
    local = frames(middle)
    mid_seq, offset, _ = local[len(local) // 2]
    flip(middle, offset + 20)
    target = infos[1].first_seq + mid_seq
    with pytest.raises(CorruptLogError):
        replay(log)
    prefix = replay(log, salvage=True)
    assert infos[1].name in prefix.salvaged and prefix.last_seq < target
    assert prefix.salvage_resume_seq == target + 1  # in the whole log's numbers
    reader = LogReader(log, salvage=True, past_damage=True)
    seqs = [s for s, _ in reader.records()]
    everything = [s for s, _ in LogReader(directory).records()]
    assert seqs == [s for s in everything if s != target]
    assert [(d.first_seq, d.resume_seq) for d in reader.damaged] == [(target, target + 1)]
    result = replay(log, salvage=True, past_damage=True)
    assert result.ok and result.unverified == [(target, infos[2].first_seq - 1)]
    assert result.num_verified > prefix.num_verified


def test_a_directory_goes_on_at_the_next_segment(
    directory: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "dir"
    shutil.copytree(directory, log)
    infos = list_segments(str(log))
    (log / infos[1].name).write_bytes(b"not a log at all")  # its header is gone
    prefix = LogReader(log, salvage=True)
    assert max(s for s, _ in prefix.records()) == infos[0].last_seq
    reader = LogReader(log, salvage=True, past_damage=True)
    seqs = [s for s, _ in reader.records()]
    assert seqs[-1] == max(s for s, _ in LogReader(directory).records())
    assert not any(infos[1].first_seq <= s < infos[2].first_seq for s in seqs)
    [damage] = reader.damaged
    assert (damage.first_seq, damage.resume_seq) == (infos[1].first_seq, infos[2].first_seq)
    assert infos[1].name in damage.path
    assert main(["replay", "--salvage", "--past-damage", str(log)]) == 1
    captured = capsys.readouterr()
    assert infos[1].name in captured.err and "verified where it was read" in captured.out
    result = replay(log, salvage=True, past_damage=True)
    assert result.ok and result.unverified == [(infos[1].first_seq, infos[2].first_seq - 1)]


def test_damage_that_cuts_the_configuration_goes_on_from_a_snapshot(
    whole: Path, tmp_path: Path
) -> None:
    copy = tmp_path / "first.kvlog"
    shutil.copy(whole, copy)
    flip(copy, frames(copy)[0][1] + 20)  # the log's CacheConfigured
    first_snapshot = snapshot_seqs(whole)[0]
    result = replay(copy, salvage=True, past_damage=True, threshold=8)
    assert result.ok and result.unverified == [(0, first_snapshot - 1)]
    assert result.recorded_config is not None and result.recorded is not None
    assert result.final_digest == replay(whole).final_digest
    assert result.whatif is not None and result.whatif.whatif.num_steps > 0


def test_a_missing_segment_is_gone_past(directory: Path, tmp_path: Path) -> None:
    log = tmp_path / "dir"
    shutil.copytree(directory, log)
    infos = list_segments(str(log))
    (log / infos[2].name).unlink()
    with pytest.raises(CorruptLogError, match="missing"):
        list(LogReader(log).records())
    reader = LogReader(log, salvage=True, past_damage=True)
    seqs = [s for s, _ in reader.records()]
    assert seqs[-1] == max(s for s, _ in LogReader(directory).records())
    [damage] = reader.damaged
    assert (damage.first_seq, damage.resume_seq) == (infos[2].first_seq, infos[3].first_seq)
    assert "missing" in damage.why
    result = replay(log, salvage=True, past_damage=True)
    assert result.ok and result.unverified == [(infos[2].first_seq, infos[3].first_seq - 1)]


def test_bytes_after_a_sealed_segments_close_lose_no_record(
    directory: Path, tmp_path: Path
) -> None:
    log = tmp_path / "dir"
    shutil.copytree(directory, log)
    infos = list_segments(str(log))
    with open(log / infos[1].name, "ab") as file:
        file.write(b"\0" * 3)
    prefix = LogReader(log, salvage=True)
    assert max(s for s, _ in prefix.records()) == infos[1].last_seq  # stops after it
    reader = LogReader(log, salvage=True, past_damage=True)
    seqs = [s for s, _ in reader.records()]
    assert seqs == [s for s, _ in LogReader(directory).records()]  # every record
    [damage] = reader.damaged
    assert damage.first_seq == damage.resume_seq == infos[2].first_seq
    assert str(damage).startswith("no record lost: ")
    result = replay(log, salvage=True, past_damage=True)
    assert result.ok and result.unverified == []  # the verification goes on unbroken
    assert result.num_verified == replay(directory).num_verified

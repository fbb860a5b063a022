"""What readers of a log directory say (issue 34 items 3, 6, 18, 23): the parallel
replay's counts are the sequential one's and its ranges do not overlap, a log never closed
is told as such, ranks on directories cut by retention still verify their checkpoints, and
``--from-snapshot`` says what it did not read."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import msgspec
import pytest

from kvlog import Engine, replay
from kvlog.analysis.parallel import replay_segments
from kvlog.analysis.ranks import compare_ranks
from kvlog.cli import main
from kvlog.events import Checkpoint, Record
from kvlog.log import list_segments
from kvlog.log.segments import SegmentedWriter
from kvlog.present.text import replay_text, segments_text
from tests.support.logdirs import (
    CONFIG,
    copy_dir,
    edit_manifest,
    record_dir,
    segment_files,
    steps,
)


@pytest.fixture(scope="module")
def closed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    log = tmp_path_factory.mktemp("closed") / "dir"
    record_dir(log, 400)
    return log


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    log = tmp_path_factory.mktemp("killed") / "dir"
    record_dir(log, 400, close=False)
    return log


def _retire(log: Path, count: int) -> None:
    """Remove the oldest ``count`` segments as retention does (the manifest first)."""
    names = segment_files(log)[:count]
    start = list_segments(str(log))[count].first_seq

    def edit(manifest: dict[str, object]) -> None:
        manifest["segments"] = [
            s
            for s in manifest["segments"]  # type: ignore[attr-defined]
            if s["name"] not in names
        ]
        if "start_seq" in manifest:
            manifest["start_seq"] = start

    edit_manifest(log, edit)
    for name in names:
        os.unlink(log / name)


# -- item 3 ----------------------------------------------------------------------------
@pytest.mark.parametrize("retired", [0, 2])
def test_the_parallel_replay_of_a_directory_counts_what_the_sequential_one_does(
    closed: Path, tmp_path: Path, retired: int
) -> None:
    log = copy_dir(closed, tmp_path / "dir")
    _retire(log, retired)
    sequential = replay(log)
    parallel = replay_segments(log, use_ray=False)
    assert sequential.ok and parallel.ok
    assert parallel.num_verified == sequential.num_verified
    assert parallel.num_events == sequential.num_events
    assert parallel.final_digest == sequential.final_digest
    for before, after in itertools.pairwise(parallel.segments):
        assert before.stop_seq < after.start_seq, (before, after)


def test_the_parallel_replay_of_a_file_still_counts_what_the_sequential_one_does(
    tmp_path: Path,
) -> None:
    log = tmp_path / "one.kvlog"
    with Engine(CONFIG, log, sync="none", checkpoint_every=16, snapshot_every=2) as engine:
        steps(engine, 400)
    sequential, parallel = replay(log), replay_segments(log, use_ray=False, max_segments=4)
    assert len(parallel.segments) == 4
    assert parallel.num_verified == sequential.num_verified
    for before, after in itertools.pairwise(parallel.segments):
        assert before.stop_seq < after.start_seq


# -- item 6 ----------------------------------------------------------------------------
def test_a_log_never_closed_is_told_as_such(
    killed: Path, closed: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = replay(killed)
    assert result.ok and not result.closed_cleanly and not result.tail
    text = replay_text(result)
    assert "never closed" in text or "not closed" in text, text
    assert replay(closed).closed_cleanly
    summary = replay_text(replay(closed)).split("\n\n")[0]
    assert "not closed" not in summary and "never closed" not in summary
    file_log = tmp_path / "killed.kvlog"
    engine = Engine(CONFIG, file_log, sync="none", checkpoint_every=16)
    steps(engine, 40)
    engine._log.abandon()  # type: ignore[union-attr]  # a SIGKILL, or a facade never closed
    assert not replay(file_log).closed_cleanly
    assert main(["replay", str(file_log)]) == 0  # nothing is lost: still verified
    assert "not closed" in capsys.readouterr().out


def test_the_parallel_replay_says_a_log_was_never_closed_as_the_sequential_one_does(
    killed: Path, closed: Path
) -> None:
    parallel = replay_segments(killed, use_ray=False)
    assert parallel.ok and not parallel.closed_cleanly
    assert "ended: not closed" in segments_text(parallel, 0.1)
    whole = replay_segments(closed, use_ray=False)
    assert whole.ok and whole.closed_cleanly
    assert "not closed" not in segments_text(whole, 0.1)


# -- item 18 ---------------------------------------------------------------------------
def _record_wrong_digests(log: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A directory whose later plain checkpoints carry a wrong digest (its live state
    went wrong), as every rank of a server would record it."""
    append = SegmentedWriter.append

    def tampered(self: SegmentedWriter, record: Record) -> int:
        if type(record) is Checkpoint and not record.snapshot and record.seq > 300:
            record = msgspec.structs.replace(record, digest="v2:" + "0" * 64)
        return append(self, record)

    monkeypatch.setattr(SegmentedWriter, "append", tampered)
    record_dir(log, 500)
    monkeypatch.undo()


def test_ranks_on_directories_cut_by_retention_still_verify_checkpoints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    rank0 = tmp_path / "rank0"
    _record_wrong_digests(rank0, monkeypatch)
    rank1 = copy_dir(rank0, tmp_path / "rank1")
    assert not replay(rank0).ok
    uncut = compare_ranks([rank0, rank1])
    assert not uncut.ok
    for log in (rank0, rank1):
        _retire(log, 2)
    cut = compare_ranks([rank0, rank1])
    assert not cut.ok, "the cut logs' wrong checkpoints were not checked"
    assert cut.num_checkpoints > 0
    assert main(["ranks", str(rank0), str(rank1)]) == 1
    out = capsys.readouterr().out
    assert "differs from rank 0" not in out and "rank 0" in out, out
    assert "its own events" in out, out


def test_a_rank_whose_own_digest_is_wrong_is_not_said_to_differ_from_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rank0 = tmp_path / "rank0"
    _record_wrong_digests(rank0, monkeypatch)
    result = compare_ranks([rank0, copy_dir(rank0, tmp_path / "rank1")])
    assert result.difference is not None
    text = str(result.difference)
    assert "rank 0 differs from rank 0" not in text and "its own events" in text, text


def test_ranks_on_cut_directories_that_agree_still_agree(closed: Path, tmp_path: Path) -> None:
    rank0, rank1 = copy_dir(closed, tmp_path / "rank0"), copy_dir(closed, tmp_path / "rank1")
    for log in (rank0, rank1):
        _retire(log, 2)
    result = compare_ranks([rank0, rank1])
    assert result.ok and result.complete and result.num_checkpoints > 0


# -- item 23 ---------------------------------------------------------------------------
def test_from_snapshot_says_what_it_did_not_read(
    closed: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = copy_dir(closed, tmp_path / "dir")
    second = log / segment_files(log)[1]
    data = bytearray(second.read_bytes())
    data[len(data) // 2] ^= 0x40
    second.write_bytes(bytes(data))
    result = replay(log, from_snapshot=True)
    assert result.ok
    assert result.segments_not_read == len(segment_files(log)) - 1
    assert main(["replay", str(log), "--from-snapshot"]) == 0
    out = capsys.readouterr().out
    assert "verified: the replay agrees with the log (" not in out, out
    assert "not read" in out and "from the latest snapshot" in out, out

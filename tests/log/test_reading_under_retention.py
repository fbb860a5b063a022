"""Replaying a log directory while the writer's retention removes its segments: the read
goes on from the snapshot that opens the oldest segment still there, says which sequence
numbers it did not verify, and never counts them as verified. Deterministic: the segments
are removed by a hook on the reader's opening of a segment, as retention would."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvlog.log.reader as reader_module
from kvlog.analysis.replay import replay
from kvlog.cli import main
from kvlog.errors import SegmentsRetired
from kvlog.events import Checkpoint
from kvlog.log import LogReader, list_segments
from kvlog.log.manifest import Manifest, SegmentInfo, read_manifest, write_manifest

SMALL = ["--steps", "300", "--segment-bytes", "20000", "--sync", "none"]


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("retired") / "log")
    assert main(["synth", "--out", path, *SMALL]) == 0
    assert len(list_segments(path)) >= 6
    return path


def _copy(src: str, dst: Path) -> str:
    dst.mkdir()
    for name in os.listdir(src):
        (dst / name).write_bytes((Path(src) / name).read_bytes())
    return str(dst)


def retire_when_opening(
    monkeypatch: pytest.MonkeyPatch, path: str, opening: int, retired: list[int]
) -> None:
    """When the reader first opens the segment at index ``opening``, retention removes the
    segments at the indices ``retired`` (the manifest first, then the files), as
    ``SegmentedWriter._apply_retention`` does."""
    segments = list_segments(path)
    real = reader_module.open_segment
    done = []

    def hooked(directory: str, info: SegmentInfo) -> Iterator[str]:
        if not done and info.first_seq == segments[opening].first_seq:
            done.append(True)
            manifest = read_manifest(directory)
            assert manifest is not None
            gone = {segments[i].first_seq for i in retired}
            kept = [s for s in manifest.segments if s.first_seq not in gone]
            write_manifest(directory, Manifest(kept), durable=False)
            for i in retired:
                os.unlink(os.path.join(directory, segments[i].name))
        return real(directory, info)  # type: ignore[no-any-return]

    monkeypatch.setattr(reader_module, "open_segment", hooked)


def _checkpoints(path: str, first: int, last: int) -> int:
    return sum(
        1 for seq, r in LogReader(path).records() if type(r) is Checkpoint and first <= seq <= last
    )


def test_a_replay_goes_on_past_segments_retention_removed_under_it(
    log_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    full = replay(log_dir)
    assert full.ok and not full.retired
    path = _copy(log_dir, tmp_path / "live")
    segments = list_segments(path)
    first, resume = segments[1].first_seq, segments[3].first_seq
    retired_checkpoints = _checkpoints(path, first, resume - 1)
    retire_when_opening(monkeypatch, path, opening=1, retired=[1, 2])
    result = replay(path, threshold=4)
    assert result.retired == [(first, resume - 1)]
    assert result.divergence is None and result.ok
    assert result.final_digest == full.final_digest  # the state at the end is the log's
    # the retired checkpoints were not read; the one the read went on from was read but
    # not verified (the events before it are gone)
    assert result.num_checkpoints == full.num_checkpoints - retired_checkpoints
    assert result.num_verified == full.num_verified - retired_checkpoints - 1
    assert result.whatif is not None and result.whatif.whatif.rejected is None


def test_kvlog_replay_says_which_seqs_it_did_not_verify(
    log_dir: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = _copy(log_dir, tmp_path / "live")
    segments = list_segments(path)
    first, resume = segments[2].first_seq, segments[3].first_seq
    retire_when_opening(monkeypatch, path, opening=2, retired=[2])
    assert main(["replay", path]) == 0
    captured = capsys.readouterr()
    line = (
        f"kvlog replay: seq {first:,}-{resume - 1:,} removed by the log's retention during "
        "the read: not verified\n"
    )
    assert captured.err == line
    assert "verified: the replay agrees with the log where it was read" in captured.out


@pytest.mark.parametrize("flag", ["--execute", "--against"])
def test_a_replay_that_needs_every_event_refuses_in_one_line(
    flag: str,
    log_dir: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = _copy(log_dir, tmp_path / "live")
    other = _copy(log_dir, tmp_path / "other")
    segments = list_segments(path)
    retire_when_opening(monkeypatch, path, opening=1, retired=[1])
    argv = ["replay", path, flag] + ([other] if flag == "--against" else [])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"sequence number {segments[1].first_seq} on was removed by the log's retention" in err


def test_nothing_left_to_go_on_from_is_refused(
    log_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _copy(log_dir, tmp_path / "live")
    segments = list_segments(path)
    retire_when_opening(monkeypatch, path, opening=1, retired=list(range(1, len(segments))))
    with pytest.raises(SegmentsRetired, match="nothing later is left to read") as caught:
        replay(path)
    assert (caught.value.first_seq, caught.value.resume_seq) == (segments[1].first_seq, -1)


def test_a_segment_compressed_under_the_read_is_read_under_its_new_name(
    log_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("zstandard")
    from kvlog.log.manifest import compress_file

    path = _copy(log_dir, tmp_path / "live")
    segments = list_segments(path)
    real = reader_module.open_segment
    done = []

    def hooked(directory: str, info: SegmentInfo) -> Iterator[str]:
        if not done and info.first_seq == segments[1].first_seq:  # the sealer's work
            done.append(True)
            plain = os.path.join(directory, info.name)
            compress_file(plain)
            os.unlink(plain)
        return real(directory, info)  # type: ignore[no-any-return]

    monkeypatch.setattr(reader_module, "open_segment", hooked)
    full = replay(log_dir)
    result = replay(path)
    assert done and not result.retired and result.ok
    assert (result.num_verified, result.final_digest) == (full.num_verified, full.final_digest)

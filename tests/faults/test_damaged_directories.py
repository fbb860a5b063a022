"""A damaged log directory (issue 34 items 19, 20, 21): a missing segment is told from
retention by the manifest and named, a segment without a header at the end is a torn tail
(elsewhere a stray file, set aside), and a compressed segment that does not decompress is a
``CorruptLogError`` naming the file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvlog import Engine, replay
from kvlog.cli import main
from kvlog.errors import CorruptLogError
from kvlog.log import LogReader, list_segments
from tests.support.logdirs import (
    copy_dir,
    edit_manifest,
    record_dir,
    segment_files,
    steps,
)


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Many segments, the writer killed: the last segment is open."""
    log = tmp_path_factory.mktemp("killed") / "dir"
    record_dir(log, 400, close=False)
    assert len(segment_files(log)) >= 8
    return log


@pytest.fixture(scope="module")
def compressed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("zstandard")
    log = tmp_path_factory.mktemp("compressed") / "dir"
    record_dir(log, 400, compress=True)
    return log


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


# -- item 19 ---------------------------------------------------------------------------
def test_a_missing_open_segment_is_named_not_passed_over(
    killed: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = copy_dir(killed, tmp_path / "dir")
    last = segment_files(log)[-1]
    os.unlink(log / last)
    with pytest.raises(CorruptLogError, match=f"{last}.*missing"):
        replay(log)
    code, out, err = _cli(["replay", str(log)], capsys)
    assert code != 0 and "verified" not in out
    assert last in err and len(err.strip().splitlines()) == 1, err
    salvaged = replay(log, salvage=True)
    assert last in salvaged.salvaged and salvaged.num_verified > 0
    with pytest.raises(CorruptLogError, match="missing"):  # its events are lost: no resume
        Engine.resume(log, sync="none")


def test_a_missing_first_segment_the_manifest_still_lists_is_not_retention(
    killed: Path, tmp_path: Path
) -> None:
    log = copy_dir(killed, tmp_path / "dir")
    first = segment_files(log)[0]
    os.unlink(log / first)
    with pytest.raises(CorruptLogError, match=f"{first}.*missing"):
        replay(log)


def test_segments_retention_removed_still_read_from_the_first_snapshot(
    killed: Path, tmp_path: Path
) -> None:
    """The manifest no longer lists what retention removed: not damage (held)."""
    log = copy_dir(killed, tmp_path / "dir")
    names = segment_files(log)[:2]
    for name in names:
        os.unlink(log / name)

    def retire(manifest: dict[str, list[dict[str, object]]]) -> None:
        manifest["segments"] = [s for s in manifest["segments"] if s["name"] not in names]
        if "start_seq" in manifest:
            manifest["start_seq"] = manifest["segments"][0]["first_seq"]

    edit_manifest(log, retire)
    result = replay(log)
    assert result.ok and result.num_verified > 0


@pytest.mark.parametrize("which", ["middle", "all"])
def test_a_segment_the_manifest_lost_is_read_and_said_to_be_unchecked(
    killed: Path, tmp_path: Path, which: str
) -> None:
    log = copy_dir(killed, tmp_path / "dir")
    names = segment_files(log)
    dropped = [names[3]] if which == "middle" else names[:-1]

    def drop(manifest: dict[str, list[dict[str, object]]]) -> None:
        manifest["segments"] = [s for s in manifest["segments"] if s["name"] not in dropped]

    edit_manifest(log, drop)
    result = replay(log)
    assert result.ok
    assert sorted(result.unlisted) == sorted(dropped)


# -- item 20 ---------------------------------------------------------------------------
@pytest.mark.parametrize("content", [b"", b"KVLO", b"\x00" * 300])
def test_an_empty_or_headerless_open_segment_is_a_torn_tail(
    killed: Path, tmp_path: Path, content: bytes, capsys: pytest.CaptureFixture[str]
) -> None:
    log = copy_dir(killed, tmp_path / "dir")
    reference = replay(killed)
    info = list_segments(str(log))[-1]
    # a crash right after the next segment's file was created: it holds no header yet
    nxt = f"{reference.last_seq + 1:016d}.kvlog"
    (log / nxt).write_bytes(content)
    result = replay(log)
    assert result.ok and result.num_verified == reference.num_verified
    assert nxt in result.tail
    code, out, _ = _cli(["replay", str(log)], capsys)
    assert code == 0 and "torn tail" in out
    with Engine.resume(log, sync="none", checkpoint_every=16) as engine:
        steps(engine, 50)
    assert replay(log).ok
    assert info.first_seq in [s.first_seq for s in list_segments(str(log))]


def test_the_open_segment_cut_to_nothing_is_a_torn_tail(killed: Path, tmp_path: Path) -> None:
    log = copy_dir(killed, tmp_path / "dir")
    last = segment_files(log)[-1]
    (log / last).write_bytes(b"")
    result = replay(log)
    assert result.ok and last in result.tail
    with Engine.resume(log, sync="none", checkpoint_every=16) as engine:
        steps(engine, 50)
    assert replay(log).ok


def test_a_stray_empty_segment_file_stops_nothing(killed: Path, tmp_path: Path) -> None:
    log = copy_dir(killed, tmp_path / "dir")
    first = list_segments(str(log))[0]
    stray = f"{first.first_seq + 1:016d}.kvlog"  # between two segments, in no manifest
    (log / stray).write_bytes(b"")
    result = replay(log)
    assert result.ok and result.strays == [stray] and not result.unlisted
    with Engine.resume(log, sync="none", checkpoint_every=16) as engine:
        steps(engine, 50)
    assert replay(log).ok


# -- item 21 ---------------------------------------------------------------------------
def _one_line_corrupt(log: Path, name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(CorruptLogError, match=name.replace(".", r"\.")):
        for _ in LogReader(log).records():
            pass
    code, _, err = _cli(["replay", str(log)], capsys)
    assert code == 2 and name in err and "Zstd" not in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_a_plain_segment_under_a_zst_name_is_a_corrupt_log_error(
    killed: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = copy_dir(killed, tmp_path / "dir")
    name = segment_files(log)[2]
    os.rename(log / name, log / f"{name}.zst")
    _one_line_corrupt(log, f"{name}.zst", capsys)


def test_a_garbage_zst_is_a_corrupt_log_error(
    compressed: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = copy_dir(compressed, tmp_path / "dir")
    name = next(n for n in segment_files(log) if n.endswith(".zst"))
    (log / name).write_bytes(b"\x28\xb5\x2f\xfd" + os.urandom(200))
    _one_line_corrupt(log, name, capsys)


def test_a_garbage_zst_beside_the_plain_segment_the_manifest_names(
    killed: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The manifest names the plain file (sealed, digested): that one is read; the .zst
    beside it is no segment of this log."""
    pytest.importorskip("zstandard")
    log = copy_dir(killed, tmp_path / "dir")
    name = segment_files(log)[2]
    (log / f"{name}.zst").write_bytes(os.urandom(300))
    assert replay(log).ok


def test_a_manifest_that_says_compressed_for_a_plain_segment(killed: Path, tmp_path: Path) -> None:
    """The file's name says how it is stored; the manifest's flag is a hint."""
    log = copy_dir(killed, tmp_path / "dir")

    def flag(manifest: dict[str, list[dict[str, object]]]) -> None:
        manifest["segments"][2]["compressed"] = True

    edit_manifest(log, flag)
    assert replay(log).ok


@pytest.mark.parametrize("manifest", [None, b"", b'{"version": 1, "segm'])
def test_a_lost_manifest_is_rebuilt_by_the_next_writer_as_sealed_segments(
    killed: Path, tmp_path: Path, manifest: bytes | None
) -> None:
    """Held: without a (readable) manifest the segments are read by their names; the
    next writer lists them again as sealed, so retention can remove them."""
    log = copy_dir(killed, tmp_path / "dir")
    if manifest is None:
        os.unlink(log / "MANIFEST.json")
    else:
        (log / "MANIFEST.json").write_bytes(manifest)
    result = replay(log)
    assert result.ok and result.num_verified > 0
    count = len(segment_files(log))
    with Engine.resume(log, sync="none", checkpoint_every=16) as engine:
        steps(engine, 20)
    infos = list_segments(str(log))
    assert all(s.sealed and s.sha256 for s in infos[: count - 1])
    assert replay(log).ok and not replay(log).unlisted

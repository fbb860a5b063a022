"""Resuming a log directory (issue 34 items 2, 22): the directory keeps its own segment
size and retention (in its manifest), and damaged old segments do not stop a resume (it
says what it did not read)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvlog import Engine, replay
from kvlog.log import list_segments
from kvlog.log.manifest import read_manifest
from kvlog.runtime.opening import LogOptions
from tests.support.logdirs import (
    copy_dir,
    edit_manifest,
    record_dir,
    segment_files,
    steps,
    stored_bytes,
)

SEGMENT = 4096
RETAIN = 12_000
# a segment is sealed at the step's end after it reached SEGMENT: one step's records over
STEP_SLACK = 2048


def _check_bounded(path: Path, segment: int, retain: int) -> None:
    """Every segment near ``segment`` bytes, the sealed ones within ``retain``."""
    sizes = [(path / n).stat().st_size for n in segment_files(path)]
    assert max(sizes) <= segment + STEP_SLACK, sizes
    sealed = [s.num_bytes for s in list_segments(str(path)) if s.sealed]
    assert sum(sealed) <= retain, sealed
    assert stored_bytes(path) <= retain + segment + STEP_SLACK


# -- item 2 ----------------------------------------------------------------------------
def test_a_resumed_directory_keeps_sealing_and_retaining_by_its_own_settings(
    tmp_path: Path,
) -> None:
    """Issue 34 item 2: resume without options, append past retention several times
    over: the last segment does not grow without bound, the old ones go."""
    log = tmp_path / "dir"
    record_dir(log, 300, segment_bytes=SEGMENT, retain_bytes=RETAIN)
    with Engine.resume(log, sync="none", checkpoint_every=16) as engine:
        steps(engine, 3000)
        removed = engine._log.num_removed  # type: ignore[union-attr]
    assert removed > 10
    _check_bounded(log, SEGMENT, RETAIN)
    assert replay(log).ok


def test_the_manifest_carries_the_directory_settings(tmp_path: Path) -> None:
    log = tmp_path / "dir"
    record_dir(log, 50, segment_bytes=SEGMENT, retain_bytes=RETAIN, retain_seconds=3600.0)
    manifest = read_manifest(str(log))
    assert manifest is not None
    assert (manifest.segment_bytes, manifest.retain_bytes, manifest.retain_seconds) == (
        SEGMENT,
        RETAIN,
        3600.0,
    )
    assert manifest.compress is False


def test_options_given_to_resume_replace_the_directory_settings_and_are_kept(
    tmp_path: Path,
) -> None:
    log = tmp_path / "dir"
    record_dir(log, 100, segment_bytes=SEGMENT, retain_bytes=RETAIN)
    options = LogOptions(segment_bytes=2 * SEGMENT, retain_bytes=3 * RETAIN)
    with Engine.resume(log, sync="none", checkpoint_every=16, log_options=options) as engine:
        steps(engine, 50)
    manifest = read_manifest(str(log))
    assert manifest is not None
    assert (manifest.segment_bytes, manifest.retain_bytes) == (2 * SEGMENT, 3 * RETAIN)
    with Engine.resume(log, sync="none", checkpoint_every=16) as engine:  # kept from here
        steps(engine, 3000)
    _check_bounded(log, 2 * SEGMENT, 3 * RETAIN)


def test_a_compressed_directory_resumed_without_options_still_compresses(
    tmp_path: Path,
) -> None:
    pytest.importorskip("zstandard")
    log = tmp_path / "dir"
    record_dir(log, 100, segment_bytes=SEGMENT, compress=True)
    with Engine.resume(log, sync="none", checkpoint_every=16) as engine:
        before = len(segment_files(log))
        steps(engine, 400)
    new = segment_files(log)[before:-1]
    assert new and all(n.endswith(".zst") for n in new), new


def test_an_old_manifest_without_settings_still_resumes(tmp_path: Path) -> None:
    """Schema rule: a directory written before the settings were kept opens as before
    (the default segment size, no retention)."""
    log = tmp_path / "dir"
    record_dir(log, 200, segment_bytes=SEGMENT)

    def strip(manifest: dict[str, object]) -> None:
        for key in ("segment_bytes", "retain_bytes", "retain_seconds", "compress", "start_seq"):
            manifest.pop(key, None)

    edit_manifest(log, strip)
    with Engine.resume(log, sync="none", checkpoint_every=16) as engine:
        steps(engine, 100)
    assert replay(log).ok


# -- item 22 ---------------------------------------------------------------------------
def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def _cut(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _seq_off(log: Path) -> None:
    def edit(manifest: dict[str, list[dict[str, int]]]) -> None:
        manifest["segments"][1]["last_seq"] += 5

    edit_manifest(log, edit)


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory of many segments whose writer was killed (no clean close)."""
    log = tmp_path_factory.mktemp("killed") / "dir"
    record_dir(log, 400, close=False)
    return log


@pytest.mark.parametrize("damage", ["sha", "cut", "seq"])
def test_resume_goes_on_past_damaged_old_segments_and_says_what_it_did_not_read(
    killed: Path, tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 34 item 22: resume needs only the latest snapshot and what follows it."""
    log = copy_dir(killed, tmp_path / "dir")
    second = log / segment_files(log)[1]
    {"sha": lambda: _flip(second), "cut": lambda: _cut(second), "seq": lambda: _seq_off(log)}[
        damage
    ]()
    with caplog.at_level(logging.INFO, logger="kvlog"):
        engine = Engine.resume(log, sync="none", checkpoint_every=16)
    with engine:
        steps(engine, 100)
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "not read" in said, said
    assert replay(log, from_snapshot=True).ok

"""Segmented logs: a log directory rotates, seals, digests, compresses and retains its
segments; every reader (replay, --parallel, inspect, resume, latest_snapshot) takes it, and a
file and a directory of the same run hold the same events."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlog import Engine, replay
from kvlog.analysis.parallel import replay_segments
from kvlog.cli import main
from kvlog.errors import ConfigError, CorruptLogError, LogLocked
from kvlog.events import Checkpoint, Event
from kvlog.log import LogReader, latest_snapshot, list_segments, segments, snapshots
from kvlog.log import reader as reader_module
from kvlog.log.manifest import (
    MANIFEST_NAME,
    SegmentInfo,
    compress_file,
    file_sha256,
    read_manifest,
    write_manifest,
)
from kvlog.log.snapshots import first_snapshot
from kvlog.synth import SynthConfig, SynthRun

SEGMENT_BYTES = 48 << 10
CONFIG = SynthConfig(steps=1500, seed=5, num_cpu_blocks=64)


def record(path: Path | str, steps: int = 1500, **options: object) -> Engine:
    config = (
        CONFIG if steps == CONFIG.steps else SynthConfig(steps=steps, seed=5, num_cpu_blocks=64)
    )
    engine = Engine(config.cache_config(), path, checkpoint_every=64, **options)  # type: ignore[arg-type]
    with engine:
        SynthRun(config, engine, None).run()
    return engine


def events_of(path: Path | str) -> list[Event]:
    return [r for _, r in LogReader(path).records() if not isinstance(r, Checkpoint)]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    """The same run into one file and into a directory of small segments."""
    base = tmp_path_factory.mktemp("segments")
    record(base / "one.kvlog")
    engine = record(base / "dir", segment_bytes=SEGMENT_BYTES)
    return base / "one.kvlog", base / "dir", engine.digest()


def copy_of(directory: Path, tmp_path: Path) -> Path:
    target = tmp_path / "copy"
    shutil.copytree(directory, target, ignore=shutil.ignore_patterns("LOCK"))
    return target


def test_a_directory_holds_the_events_of_a_file_and_replays_to_the_same_digest(
    recorded: tuple[Path, Path, str],
) -> None:
    one, directory, _ = recorded
    assert events_of(one) == events_of(directory)
    result = replay(directory)
    assert result.ok and result.final_digest == replay(one).final_digest
    assert result.num_verified == result.num_checkpoints > 0
    assert len(list_segments(str(directory))) >= 4


def test_every_sealed_segment_is_in_the_manifest_and_opens_with_a_snapshot(
    recorded: tuple[Path, Path, str],
) -> None:
    _, directory, _ = recorded
    infos = list_segments(str(directory))
    assert [i.first_seq for i in infos] == sorted(i.first_seq for i in infos)
    for before, info in itertools.pairwise(infos):
        assert before.sealed and before.last_seq + 1 == info.first_seq
        path = directory / before.name
        assert before.sha256 == file_sha256(str(path))
        assert before.num_bytes == os.path.getsize(path) >= SEGMENT_BYTES
        reader = LogReader(directory / info.name)
        seq, first = next(iter(reader.records()))
        assert reader.first_seq == seq == info.first_seq
        assert type(first) is Checkpoint and first.snapshot  # replays on its own
        assert replay(directory / info.name).ok  # from that snapshot
    assert not infos[-1].sealed


def test_latest_snapshot_comes_from_the_manifest_and_a_bad_hint_falls_back(
    recorded: tuple[Path, Path, str], tmp_path: Path
) -> None:
    directory = recorded[1]
    seq, checkpoint = latest_snapshot(directory)
    scanned = [(s, r) for s, r in LogReader(directory).records() if isinstance(r, Checkpoint)]
    expected = [(s, r) for s, r in scanned if r.snapshot][-1]
    assert (seq, checkpoint) == expected
    broken = copy_of(directory, tmp_path)
    manifest = read_manifest(str(broken))
    assert manifest is not None
    last = manifest.segments[-1]
    offset = last.snapshot_offset + 3  # not a frame: the hint fails its checks
    manifest.segments[-1] = msgspec.structs.replace(last, snapshot_offset=offset)
    write_manifest(str(broken), manifest)
    assert latest_snapshot(broken) == expected


def test_latest_snapshot_lists_again_when_a_segment_goes_away_as_it_reads(
    recorded: tuple[Path, Path, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A live directory changes under a reader between its listing and its reading (the
    sealer compresses a segment under a new name, retention removes one): the search
    lists the directory again and finds the snapshot there (``kvlog top`` following a log
    under retention failed on this with "no such log")."""
    log = copy_of(recorded[1], tmp_path)
    *_, sealed, newest = list_segments(str(log))
    skip = frozenset(  # the newest segment's snapshots: the search reads the one before
        s for s, r in LogReader(log).records(newest.first_seq)
        if isinstance(r, Checkpoint) and r.snapshot
    )  # fmt: skip
    opened = snapshots.open_segment
    sealed_now: list[str] = []

    @contextlib.contextmanager
    def sealing(directory: str, info: SegmentInfo) -> Iterator[str]:
        if info.name == sealed.name and not sealed_now:  # as the sealer thread does
            path = os.path.join(directory, info.name)
            stored = compress_file(path)
            manifest = read_manifest(directory)
            assert manifest is not None
            manifest.segments = [
                msgspec.structs.replace(
                    s, name=os.path.basename(stored), compressed=True,
                    num_bytes=os.path.getsize(stored), sha256=file_sha256(stored),
                ) if s.name == info.name else s
                for s in manifest.segments
            ]  # fmt: skip
            write_manifest(directory, manifest)
            os.remove(path)
            sealed_now.append(os.path.basename(stored))
        with opened(directory, info) as plain:
            yield plain

    monkeypatch.setattr(snapshots, "_read_hint", lambda directory, info: None)  # scan them
    monkeypatch.setattr(snapshots, "open_segment", sealing)
    seq, checkpoint = latest_snapshot(log, skip)
    assert sealed_now == [sealed.name + ".zst"]
    found = [(s, r) for s, r in LogReader(log).records() if isinstance(r, Checkpoint)]
    assert (seq, checkpoint) == [(s, r) for s, r in found if r.snapshot and s not in skip][-1]
    assert sealed.first_seq <= seq < newest.first_seq  # from the segment that moved


def test_first_snapshot_lists_again_when_retention_removes_the_first_segment_as_it_reads(
    recorded: tuple[Path, Path, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retention removes a directory's oldest segment after a reader listed it and before
    it read its first record: ``first_snapshot`` reads the new oldest one's."""
    log = copy_of(recorded[1], tmp_path)
    oldest, following = list_segments(str(log))[:2]
    opened = reader_module.open_segment
    retired: list[str] = []

    @contextlib.contextmanager
    def retiring(directory: str, info: SegmentInfo) -> Iterator[str]:
        if info.name == oldest.name and not retired:  # as the writer's retention does
            manifest = read_manifest(directory)
            assert manifest is not None
            manifest.segments = [s for s in manifest.segments if s.name != info.name]
            write_manifest(directory, manifest)
            os.remove(os.path.join(directory, info.name))
            retired.append(info.name)
        with opened(directory, info) as plain:
            yield plain

    monkeypatch.setattr(reader_module, "open_segment", retiring)
    seq, checkpoint = first_snapshot(log)
    assert retired == [oldest.name]
    assert seq == following.first_seq and checkpoint is not None and checkpoint.snapshot


def test_resume_reads_only_the_last_segments_and_continues(
    recorded: tuple[Path, Path, str], tmp_path: Path
) -> None:
    _, directory, digest = recorded
    log = copy_of(directory, tmp_path)
    oldest = log / list_segments(str(log))[0].name
    oldest.write_bytes(b"garbage" * 100)  # resume never reads it; a whole replay does
    engine = Engine.resume(log)
    assert engine.digest() == digest
    engine.close()
    with pytest.raises(CorruptLogError, match="SHA-256"):
        replay(log)


def test_a_missing_middle_segment_is_corruption(
    recorded: tuple[Path, Path, str], tmp_path: Path
) -> None:
    log = copy_of(recorded[1], tmp_path)
    os.unlink(log / list_segments(str(log))[1].name)
    with pytest.raises(CorruptLogError, match="a segment is missing"):
        replay(log)


def test_parallel_replay_runs_one_task_per_segment(recorded: tuple[Path, Path, str]) -> None:
    _, directory, _ = recorded
    sequential = replay(directory)
    parallel = replay_segments(directory, use_ray=False)
    assert parallel.ok, parallel.divergence
    assert len(parallel.segments) == len(list_segments(str(directory)))
    assert parallel.num_events == sequential.num_events
    assert parallel.final_digest == sequential.recorded.final_digest  # type: ignore[union-attr]


def test_inspect_reads_a_directory_with_dense_sequence_numbers(
    recorded: tuple[Path, Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inspect", "--no-checkpoints", str(recorded[1])]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    seqs = [line["seq"] for line in lines]
    expected = [s for s, r in LogReader(recorded[1]).records() if not isinstance(r, Checkpoint)]
    assert seqs == expected and seqs[0] == 0
    assert len(seqs) == len(events_of(recorded[0]))


def test_inspect_says_where_a_retained_directory_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``inspect --to N`` below the first retained record printed nothing, silently."""
    log = tmp_path / "dir"
    record(log, segment_bytes=SEGMENT_BYTES, retain_bytes=3 * SEGMENT_BYTES)
    first = list_segments(str(log))[0].first_seq
    assert first > 0
    assert main(["inspect", str(log), "--to", "0"]) == 0
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"the log starts at seq {first:,}" in captured.err
    assert main(["inspect", str(log), "--from", str(first), "--to", str(first)]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and json.loads(captured.out)["seq"] == first


def test_retention_by_bytes_keeps_a_replayable_rest(tmp_path: Path) -> None:
    log = tmp_path / "dir"
    engine = record(log, segment_bytes=SEGMENT_BYTES, retain_bytes=3 * SEGMENT_BYTES)
    infos = list_segments(str(log))
    assert infos[0].first_seq > 0
    assert sum(i.num_bytes for i in infos if i.sealed) <= 3 * SEGMENT_BYTES + SEGMENT_BYTES
    result = replay(log)
    assert result.ok and result.start_seq == infos[0].first_seq + 1
    assert result.final_digest == replay(tmp_path / "dir").final_digest
    assert result.recorded is not None and result.recorded.final_digest == engine.digest()
    assert replay_segments(log, use_ray=False).ok
    assert sorted(os.listdir(log)) == sorted([i.name for i in infos] + [MANIFEST_NAME, "LOCK"])


def test_retention_by_age_drops_every_segment_sealed_too_long_ago(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = iter(range(0, 10**9, 100))

    class Clock:
        @staticmethod
        def time() -> float:
            return float(next(clock))

    monkeypatch.setattr(segments, "time", Clock)
    log = tmp_path / "dir"
    record(log, steps=600, segment_bytes=SEGMENT_BYTES, retain_seconds=150)
    infos = list_segments(str(log))
    assert len([i for i in infos if i.sealed]) <= 1 and infos[0].first_seq > 0
    assert replay(log).ok


def test_compressed_segments_replay_resume_and_run_in_parallel(tmp_path: Path) -> None:
    pytest.importorskip("zstandard", reason="kvlog[zstd] is not installed")
    log = tmp_path / "dir"
    engine = record(log, steps=800, segment_bytes=SEGMENT_BYTES, compress=True)
    infos = list_segments(str(log))
    sealed = [i for i in infos if i.sealed]
    assert sealed and all(i.compressed and i.name.endswith(".zst") for i in sealed)
    assert all(i.num_bytes < SEGMENT_BYTES for i in sealed)
    assert all(i.sha256 == file_sha256(str(log / i.name)) for i in sealed)
    assert replay(log).final_digest == engine.digest()
    assert replay_segments(log, use_ray=False).ok
    Engine.resume(log).close()
    assert replay(log).ok
    # no manifest and no open segment: the files alone say where the log goes on
    os.unlink(log / MANIFEST_NAME)
    os.unlink(log / list_segments(str(log))[-1].name)
    last = list_segments(str(log))[-1]
    assert last.compressed and not last.sealed
    resumed = Engine.resume(log)
    resumed.close()
    infos = list_segments(str(log))
    assert infos[-1].first_seq > last.first_seq and not infos[-1].compressed
    assert replay(log).ok


def test_one_writer_per_directory_and_options_need_a_directory(tmp_path: Path) -> None:
    log = tmp_path / "dir"
    config = CONFIG.cache_config()
    engine = Engine(config, log, segment_bytes=SEGMENT_BYTES)
    with pytest.raises(LogLocked):
        Engine(config, log)
    engine.close()
    (tmp_path / "a.kvlog").touch()
    with pytest.raises(ConfigError, match="log directory"):
        Engine(config, tmp_path / "a.kvlog", segment_bytes=SEGMENT_BYTES)
    with pytest.raises(ConfigError, match="segment_bytes"):
        Engine(config, tmp_path / "other/", segment_bytes=10)
    assert not (tmp_path / "other").exists()


def test_a_crash_leaves_a_torn_tail_that_resume_cuts(tmp_path: Path) -> None:
    log = tmp_path / "dir/"
    config = SynthConfig(steps=300, seed=5)
    engine = Engine(config.cache_config(), log, segment_bytes=SEGMENT_BYTES)
    SynthRun(config, engine, None).run()
    engine._log.abandon()  # type: ignore[union-attr]  # a crash: no close, no checkpoint
    active = log / list_segments(str(log))[-1].name
    with open(active, "ab") as file:
        file.write(b"\x00torn")
    resumed = Engine.resume(log)
    assert resumed.recovery is not None
    resumed.close()
    assert replay(log).ok


def test_the_facade_records_a_directory_from_the_environment(tmp_path: Path) -> None:
    from kvlog.integrations import OnlineDefragmenter
    from tests.support.seed_reference import make_hpu_caches

    env = {
        "KVLOG_PATH": str(tmp_path / "worker-{pid}") + "/",
        "KVLOG_SEGMENT_BYTES": str(8 << 10),
        "KVLOG_RETAIN_BYTES": str(32 << 10),
        "KVLOG_SYNC": "step",
    }
    defrag = OnlineDefragmenter(environ=env, backend="fake")
    defrag.initialize(make_hpu_caches(64, 4), 4)
    free, live = list(range(1, 64)), {}  # type: ignore[var-annotated]
    for step in range(600):
        finished = [next(iter(live))] if len(live) > 6 else []
        for req_id in finished:
            free += live.pop(req_id)
        live[f"r{step}"] = [free.pop(0), free.pop(0)]
        defrag.update_state({f"r{step}": live[f"r{step}"]}, finished)
        defrag.defragment()
    status = defrag.log_status()
    defrag.close()
    log = tmp_path / f"worker-{os.getpid()}"
    assert status.attached and status.path == str(log)
    infos = list_segments(str(log))
    assert len(infos) >= 2 and infos[0].first_seq > 0  # rotated and retained
    assert replay(log).ok


@pytest.mark.parametrize(
    ("variable", "value"),
    [("KVLOG_SEGMENT_BYTES", "100"), ("KVLOG_RETAIN_BYTES", "-1"), ("KVLOG_RETAIN_SECONDS", "x")],
)
def test_bad_segment_variables_are_refused_by_name(variable: str, value: str) -> None:
    from kvlog.integrations.config import config_from_env

    with pytest.raises(ConfigError, match=variable):
        config_from_env({"KVLOG_PATH": "/tmp/logs/", variable: value})


def test_segment_variables_need_a_log_directory() -> None:
    from kvlog.integrations.config import config_from_env

    with pytest.raises(ConfigError, match="KVLOG_PATH"):
        config_from_env({"KVLOG_PATH": "/tmp/a.kvlog", "KVLOG_SEGMENT_BYTES": "65536"})
    config = config_from_env({"KVLOG_PATH": "/tmp/logs/", "KVLOG_COMPRESS": "zstd"})
    assert config.compress and config.segment_bytes is None


def test_an_empty_directory_becomes_a_log_and_a_foreign_one_is_refused(tmp_path: Path) -> None:
    from kvlog.errors import LogPathError

    empty = tmp_path / "empty"
    empty.mkdir()
    Engine(CONFIG.cache_config(), empty).close()
    assert replay(empty).ok and len(list_segments(str(empty))) == 1
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(LogPathError, match="other files"):
        Engine(CONFIG.cache_config(), foreign)
    assert os.listdir(foreign) == ["notes.txt"]


@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    segment_kib=st.integers(4, 40),
    retain_kib=st.one_of(st.none(), st.integers(0, 80)),
    steps=st.integers(20, 250),
    seed=st.integers(0, 3),
)
def test_any_segment_size_and_retention_keep_a_log_that_replays(
    tmp_path: Path, segment_kib: int, retain_kib: int | None, steps: int, seed: int
) -> None:
    """The segments follow each other with no gap in sequence numbers, hold the events of
    the same run recorded to one file (a suffix of them, after retention), and replay to
    the engine's digest."""
    config = SynthConfig(steps=steps, seed=seed, num_cpu_blocks=16)
    where = tempfile.mkdtemp(dir=tmp_path)
    log = Path(where) / "dir"
    retain = None if retain_kib is None else retain_kib << 10
    engine = Engine(
        config.cache_config(),
        log,
        checkpoint_every=8,
        segment_bytes=segment_kib << 10,
        retain_bytes=retain,
    )
    with engine:
        SynthRun(config, engine, None).run()
    result = replay(log)
    assert result.ok, result.divergence
    assert result.recorded is not None and result.recorded.final_digest == engine.digest()
    infos = list_segments(str(log))
    assert [i.first_seq for i in infos[1:]] == [i.last_seq + 1 for i in infos[:-1]]
    file_log = Path(where) / "one.kvlog"
    with Engine(config.cache_config(), file_log, checkpoint_every=8) as plain:
        SynthRun(config, plain, None).run()
    events = events_of(file_log)
    kept = events_of(log)
    assert kept == events[len(events) - len(kept) :]


def test_what_ifs_of_a_retained_log_run_from_its_first_snapshot(tmp_path: Path) -> None:
    """Retention removed the oldest segments: a what-if (replay's and the sweep's) runs from
    the first snapshot left, under its own policy, and both give the same figures; the
    canary (``execute``) needs the log from its start and is refused by name."""
    from kvlog.analysis.cost import CostModel
    from kvlog.analysis.grid import PolicySpec, whatif
    from kvlog.synth import run_synth

    directory = str(tmp_path / "logs") + "/"
    options = {"segment_bytes": 64 << 10, "retain_bytes": 256 << 10}
    run_synth(SynthConfig(steps=3000), directory, sync="none", log_options=options)
    assert LogReader(directory).first_seq > 0, "retention removed the oldest segments"
    result = replay(directory, threshold=8)
    assert result.whatif is not None, "the what-if ran"
    stats = result.whatif.whatif
    assert stats.num_steps > 0 and stats.num_swapped_blocks != result.recorded.num_swapped_blocks
    row = whatif(directory, PolicySpec("seed t=8", (("threshold", 8),)), CostModel())
    assert not row.rejected
    assert (row.blocks_moved, row.steps) == (stats.num_swapped_blocks, stats.num_steps)
    assert row.final_digest == stats.final_digest
    with pytest.raises(ConfigError, match="retention removed"):
        replay(directory, execute=True)

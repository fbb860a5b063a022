"""``kvlog ranks``: the logs of one server's ranks agree, modulo rank-local fields; the first
record where one differs is named by its sequence number and step."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from kvlog import Engine
from kvlog.analysis.ranks import compare_ranks
from kvlog.cli import main
from kvlog.events import (
    HOLD_PREFIX,
    BlocksAllocated,
    CacheConfigured,
    Checkpoint,
    Event,
    RequestFinished,
    RequestPreempted,
    StepEnded,
)
from kvlog.log import LogReader, LogWriter
from kvlog.synth import SynthConfig, SynthRun

CONFIG = SynthConfig(steps=300, seed=4, num_cpu_blocks=32)


def record_synth(path: Path) -> None:
    with Engine(CONFIG.cache_config(), path, checkpoint_every=16) as engine:
        SynthRun(CONFIG, engine, None).run()


def events_of(path: Path) -> list[Event]:
    return [r for _, r in LogReader(path).records() if not isinstance(r, Checkpoint)]


def rerecord(events: list[Event], path: Path | str, **options: object) -> None:
    """Feed ``events`` (the first is the configuration) to a new Engine logging to ``path``."""
    config = events[0]
    assert type(config) is CacheConfigured
    with Engine(config, path, checkpoint_every=16, **options) as engine:  # type: ignore[arg-type]
        for event in events[1:]:
            engine.apply(event)


def test_ranks_of_one_run_agree_and_files_and_directories_mix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    record_synth(tmp_path / "rank0.kvlog")
    rerecord(events_of(tmp_path / "rank0.kvlog"), tmp_path / "rank1", segment_bytes=16 << 10)
    result = compare_ranks([tmp_path / "rank0.kvlog", tmp_path / "rank0.kvlog"])
    assert result.ok and result.num_steps == CONFIG.steps and not result.normalized
    assert main(["ranks", str(tmp_path / "rank0.kvlog"), str(tmp_path / "rank0.kvlog")]) == 0
    assert "2 ranks agree" in capsys.readouterr().out
    # a directory of segments holds extra checkpoints (one opens each segment), at its own
    # byte counts: the events and the checkpoints' digests still agree
    result = compare_ranks([tmp_path / "rank0.kvlog", tmp_path / "rank1"])
    assert result.ok, result.difference
    assert result.num_steps == CONFIG.steps


def test_rank_local_fields_are_normalized(tmp_path: Path) -> None:
    """Each rank's page size (its shard of the heads) and its placeholder nonce differ."""
    config = CacheConfigured(num_gpu_blocks=64, block_size=16, page_size_bytes=4096)
    hold = f"{HOLD_PREFIX}{'ab' * 8}-7"
    events: list[Event] = [config, BlocksAllocated(req_id=hold, block_ids=[3, 4])]
    events += [StepEnded(step=0), RequestFinished(req_id=hold), StepEnded(step=1)]
    rerecord(events, tmp_path / "rank0.kvlog")
    renamed = f"{HOLD_PREFIX}{'cd' * 8}-7"
    other = [msgspec.structs.replace(config, page_size_bytes=2048)]
    other += [msgspec.structs.replace(e, req_id=renamed) for e in events[1:2]]
    other += [events[2], RequestFinished(req_id=renamed), events[4]]
    rerecord(other, tmp_path / "rank1.kvlog")
    result = compare_ranks([tmp_path / "rank0.kvlog", tmp_path / "rank1.kvlog"])
    assert result.ok, result.difference
    assert result.normalized == ["CacheConfigured.page_size_bytes"]


def test_one_different_event_is_named_by_its_step_and_sequence_number(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    record_synth(tmp_path / "rank0.kvlog")
    events = events_of(tmp_path / "rank0.kvlog")
    index = next(
        i for i, e in enumerate(events) if type(e) is RequestFinished and i > len(events) // 2
    )
    finished = events[index]
    assert type(finished) is RequestFinished
    fed = [*events[:index], RequestPreempted(req_id=finished.req_id), *events[index + 1 :]]
    rerecord(fed, tmp_path / "rank1.kvlog")
    seq = next(
        s
        for s, r in LogReader(tmp_path / "rank0.kvlog").records()
        if r is finished or r == finished
    )
    step = sum(type(e) is StepEnded for e in events[:index])
    paths = [str(tmp_path / "rank0.kvlog"), str(tmp_path / "rank1.kvlog")]
    result = compare_ranks(paths)
    assert result.difference is not None
    assert (result.difference.rank, result.difference.seq) == (1, seq)
    assert result.difference.step == step
    assert result.difference.actual == {"type": "RequestPreempted", "req_id": finished.req_id}
    assert main(["ranks", *paths]) == 1
    out = capsys.readouterr().out
    assert f"seq {seq} (step {step})" in out and "a RequestPreempted where rank 0 has" in out


def test_a_rank_whose_state_is_not_its_events_and_a_short_log_differ(tmp_path: Path) -> None:
    record_synth(tmp_path / "rank0.kvlog")
    records = list(LogReader(tmp_path / "rank0.kvlog").records())
    with LogWriter(tmp_path / "rank1.kvlog") as writer:  # a live state gone wrong
        for _, r in records:
            bad = type(r) is Checkpoint and r.seq > 100
            writer.append(msgspec.structs.replace(r, digest="v2:" + "0" * 64) if bad else r)  # type: ignore[arg-type]
    result = compare_ranks([tmp_path / "rank0.kvlog", tmp_path / "rank1.kvlog"])
    assert result.difference is not None and "live state diverged" in result.difference.what
    assert result.difference.rank == 1


def _prefix(records: list[tuple[int, Checkpoint | Event]], path: Path, count: int) -> None:
    with LogWriter(path) as writer:
        for _, r in records[:count]:
            writer.append(r)


def test_a_log_that_is_a_prefix_of_another_is_behind_not_different(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two live logs: one rank's writer is ahead of the other's."""
    full = tmp_path / "rank0.kvlog"
    record_synth(full)
    records = list(LogReader(full).records())
    short = tmp_path / "short.kvlog"
    _prefix(records, short, len(records) // 2)
    short_events = [r for _, r in records[: len(records) // 2] if type(r) is not Checkpoint]
    last_seq = max(seq for seq, r in records[: len(records) // 2] if type(r) is not Checkpoint)
    for order, behind_rank in (([full, short], 1), ([short, full], 0)):
        result = compare_ranks(order)
        assert result.ok and not result.complete, result
        assert [(b.rank, b.num_events, b.last_seq) for b in result.behind] == [
            (behind_rank, len(short_events), last_seq)
        ]
        assert result.num_events == len(events_of(full))  # the longer log read to its end
        assert main(["ranks", *map(str, order)]) == 3
        out = capsys.readouterr().out
        assert "RANKS DIFFER" not in out and f"rank {behind_rank} is behind" in out
        assert f"ends after {len(short_events):,} events (seq {last_seq:,}" in out
    assert main(["ranks", str(full), str(full)]) == 0


def test_a_rank_behind_leaves_the_others_compared(tmp_path: Path) -> None:
    """Three ranks: rank 0 is behind, rank 2 differs from rank 1 after rank 0's end: a
    difference (with rank 1 as the reference), not a log that is behind."""
    full = tmp_path / "rank1.kvlog"
    record_synth(full)
    records = list(LogReader(full).records())
    short = tmp_path / "rank0.kvlog"
    _prefix(records, short, len(records) // 3)
    events = events_of(full)
    at = next(i for i in range(len(events) // 2, len(events)) if type(events[i]) is RequestFinished)
    changed = [*events[:at], RequestPreempted(req_id=events[at].req_id), *events[at + 1 :]]  # type: ignore[attr-defined]
    rerecord(changed, tmp_path / "rank2.kvlog")
    result = compare_ranks([short, full, tmp_path / "rank2.kvlog"])
    assert [b.rank for b in result.behind] == [0]
    difference = result.difference
    assert difference is not None and (difference.rank, difference.reference) == (2, 1)
    assert difference.what == "a RequestPreempted where rank 1 has a RequestFinished"
    assert str(difference).startswith("rank 2 differs from rank 1 at seq ")


def test_a_short_log_that_differs_before_its_end_still_differs(tmp_path: Path) -> None:
    full = tmp_path / "rank0.kvlog"
    record_synth(full)
    events = events_of(full)
    at = next(i for i in range(10, len(events)) if type(events[i]) is RequestFinished)
    changed = [*events[:at], RequestPreempted(req_id=events[at].req_id)]  # type: ignore[attr-defined]
    rerecord(changed, tmp_path / "rank1.kvlog")
    result = compare_ranks([full, tmp_path / "rank1.kvlog"])
    assert result.difference is not None and not result.behind
    assert "RequestPreempted where rank 0 has a RequestFinished" in result.difference.what


def test_logs_that_retention_cut_at_different_places_are_refused_not_called_different(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    small = ["--steps", "300", "--segment-bytes", "20000", "--sync", "none"]
    kept, cut = str(tmp_path / "kept"), str(tmp_path / "cut")
    assert main(["synth", "--out", kept, *small]) == 0
    assert main(["synth", "--out", cut, *small, "--retain-bytes", "60000"]) == 0
    assert LogReader(cut).first_seq > 0 == LogReader(kept).first_seq
    capsys.readouterr()
    assert main(["ranks", kept, cut]) == 2
    captured = capsys.readouterr()
    assert "RANKS DIFFER" not in captured.out
    assert "retention" in captured.err and repr(cut) in captured.err
    assert len(captured.err.splitlines()) == 1
    assert main(["ranks", cut, cut]) == 0  # cut at the same place: read in lockstep

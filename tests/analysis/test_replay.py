"""Replay: verification, exact divergence reports, what-ifs, snapshots, execute with canaries."""

from __future__ import annotations

import os
import shutil

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlog import Engine, replay
from kvlog.analysis.canary import CanaryTracker, canary_bytes
from kvlog.errors import CorruptLogError
from kvlog.events import BlocksAllocated, CacheConfigured, Checkpoint, Record, StepEnded
from kvlog.log import LogReader, LogWriter
from kvlog.synth import SynthConfig, run_synth
from tests.support.model import PlainModel
from tests.support.strategies import draw_valid_event, machine_configs

SMALL = SynthConfig(
    steps=250,
    num_gpu_blocks=256,
    prompt_len_mean=160,
    output_len_mean=48,
    arrival_rate=0.3,
    prefix_len_max_blocks=6,
    num_cpu_blocks=96,
    block_size_factor=2,
    prefix_caching=True,
)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A synth log (checkpoints every 16 steps) and its live digest."""
    path = str(tmp_path_factory.mktemp("replay") / "small.kvlog")
    result = run_synth(SMALL, path, sync="none", checkpoint_every=16, snapshot_every=4)
    return path, result.final_digest


def rewrite(src: str, dst: str, seq: int, change: object) -> Record:
    """Copy a log record by record with the log writer, replacing the record at ``seq``."""
    with LogWriter(dst, sync="none") as writer:
        for s, record in LogReader(src).records():
            if s == seq:
                record = change(record)  # type: ignore[operator]
                edited = record
            writer.append(record)
    return edited


def first_allocation_after(path: str, start: int) -> tuple[int, BlocksAllocated]:
    for seq, record in LogReader(path).records(start):
        if isinstance(record, BlocksAllocated) and len(record.block_ids) >= 2:
            return seq, record
    raise AssertionError("no allocation to edit")


def test_live_digest_equals_replayed_digest(recorded: tuple[str, str]) -> None:
    path, digest = recorded
    result = replay(path)
    assert result.ok and result.final_digest == digest
    assert result.num_checkpoints == result.num_verified > 10
    assert result.counts["StepEnded"] == SMALL.steps
    assert result.recorded is not None and result.recorded.num_swapped_blocks > 0
    assert result.recorded.num_stores > 0 and result.recorded.num_loads > 0


def test_from_snapshot_starts_late_and_ends_the_same(recorded: tuple[str, str]) -> None:
    path, digest = recorded
    result = replay(path, from_snapshot=True)
    assert result.ok and result.start_seq > 0 and result.final_digest == digest
    assert result.num_events < replay(path).num_events


def test_what_if_with_the_same_policy_has_no_differences(recorded: tuple[str, str]) -> None:
    path, _ = recorded
    same = replay(path, threshold=SMALL.threshold, max_swaps=SMALL.max_swaps, defrag=True)
    assert same.whatif is not None and same.whatif.differences == {}
    assert same.ok


def test_what_if_with_another_policy_compares_against_the_recording(
    recorded: tuple[str, str],
) -> None:
    path, digest = recorded
    result = replay(path, defrag=False)
    assert result.ok and result.final_digest == digest  # the recording is still verified
    assert result.whatif is not None
    diffs = result.whatif.differences
    assert diffs["num_swapped_blocks"][1] == 0 < diffs["num_swapped_blocks"][0]
    assert result.whatif.whatif.mean_max_used > result.whatif.recorded.mean_max_used
    assert result.whatif.num_steps_max_used_differs > 0
    tight = replay(path, threshold=4, max_swaps=8, pad_sizes=(8,))
    assert tight.whatif is not None and tight.whatif.whatif.config.max_swaps == 8
    assert "num_swap_plans" in tight.whatif.differences


def test_an_altered_event_is_named_by_its_sequence_number(
    recorded: tuple[str, str], tmp_path: str
) -> None:
    path, _ = recorded
    seq, original = first_allocation_after(path, 400)
    edited_path = os.path.join(tmp_path, "edited.kvlog")
    ids = list(reversed(original.block_ids))  # same blocks, another table order: still valid
    edited = rewrite(path, edited_path, seq, lambda r: msgspec.structs.replace(r, block_ids=ids))
    against = replay(edited_path, against=path)
    d = against.divergence
    assert d is not None and d.kind == "event" and d.seq == seq
    assert d.event is not None and d.event["block_ids"] == ids
    assert d.other_event is not None and d.other_event["block_ids"] == original.block_ids
    assert d.expected_digest != d.actual_digest
    alone = replay(edited_path)  # one log: the checkpoints bound it
    d = alone.divergence
    assert d is not None and d.kind == "checkpoint" and d.after_seq < seq <= d.seq
    assert d.expected_digest and d.actual_digest and d.expected_digest != d.actual_digest
    assert edited != original
    assert replay(path, against=path).divergence is None


def test_an_invalid_edit_is_rejected_at_its_sequence_number(
    recorded: tuple[str, str], tmp_path: str
) -> None:
    path, _ = recorded
    seq, _ = first_allocation_after(path, 200)
    edited_path = os.path.join(tmp_path, "bad.kvlog")
    rewrite(path, edited_path, seq, lambda r: msgspec.structs.replace(r, block_ids=[0, 10**6]))
    d = replay(edited_path).divergence
    assert d is not None and d.kind == "rejected" and d.seq == seq
    assert "1000000" in d.message and d.event is not None and d.event["block_ids"] == [0, 10**6]


def test_a_log_that_ends_early_is_a_divergence(recorded: tuple[str, str], tmp_path: str) -> None:
    path, _ = recorded
    short = os.path.join(tmp_path, "short.kvlog")
    with LogWriter(short, sync="none") as writer:
        for seq, record in LogReader(path).records():
            if seq >= 300:
                break
            writer.append(record)
    last_event = max(s for s, r in LogReader(short).records() if not isinstance(r, Checkpoint))
    d = replay(short, against=path).divergence
    assert d is not None and d.kind == "event" and d.seq == last_event + 1
    assert d.event is None and d.other_event is not None


def test_execute_checks_every_live_block(recorded: tuple[str, str]) -> None:
    path, digest = recorded
    result = replay(path, execute=True)
    assert result.ok and result.final_digest == digest
    assert result.canary is not None and result.canary.num_checked > 100
    whatif = replay(path, execute=True, threshold=0, max_swaps=64, pad_sizes=(64,))
    assert whatif.canary is not None and whatif.canary.ok and whatif.canary.num_checked > 100


def test_canary_names_a_block_that_holds_someone_elses_bytes() -> None:
    from kvlog.analysis.canary import make_canary_executor

    config = CacheConfigured(num_gpu_blocks=16, block_size=4)
    executor, tracker = make_canary_executor(config)
    engine = Engine(config, executor=executor)
    for event in (
        BlocksAllocated(req_id="a", block_ids=[5, 6]),
        BlocksAllocated(req_id="b", block_ids=[9]),
    ):
        tracker.before(engine.state, event)
        engine.apply(event)
        tracker.after(engine.state, event)
    assert tracker.check(engine.state).ok
    size = tracker.page_bytes()
    executor.write_gpu_block(6, executor.read_gpu_block(9))  # a copy that went to the wrong block
    report = tracker.check(engine.state)
    assert report.num_failed == 1
    (failure,) = report.failures
    assert (failure.req_id, failure.block_id, failure.physical_id) == ("a", 6, 6)
    assert failure.found_token == -1 and failure.expected_token >= 0
    assert canary_bytes(failure.expected_token, size) != executor.read_gpu_block(6)
    assert isinstance(tracker, CanaryTracker)


@settings(max_examples=25)
@given(config=machine_configs(), data=st.data())
def test_random_programs_replay_and_one_edit_is_found(
    config: CacheConfigured, data: st.DataObject
) -> None:
    """Any valid program: its replay equals the live run, and changing the step number of
    one StepEnded (still valid) is reported at exactly that sequence number."""
    import tempfile

    model = PlainModel()
    model.apply(config)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "p.kvlog")
        with Engine(config, path, sync="none", checkpoint_every=3) as engine:
            for _ in range(data.draw(st.integers(5, 40))):
                event = draw_valid_event(data.draw, model)
                model.apply(event)
                engine.apply(event)
            engine.apply(StepEnded(step=model.step + 1))
            digest = engine.digest()
        assert replay(path).final_digest == digest and replay(path).ok
        steps = [s for s, r in LogReader(path).records() if isinstance(r, StepEnded)]
        seq = data.draw(st.sampled_from(steps))
        edited = os.path.join(tmp, "e.kvlog")
        rewrite(path, edited, seq, lambda r: StepEnded(step=r.step + 10**6))
        d = replay(edited, against=path).divergence
        assert d is not None and d.seq == seq and d.kind == "event"
        assert not isinstance(dict(LogReader(edited).records())[seq], Checkpoint)


def test_a_torn_tail_is_reported_and_the_rest_verifies(
    recorded: tuple[str, str], tmp_path: str
) -> None:
    path, _ = recorded
    torn = os.path.join(tmp_path, "torn.kvlog")
    shutil.copyfile(path, torn)
    LogWriter(torn, sync="none").abandon()  # reopened, then a crash: no longer closed cleanly
    with open(torn, "rb") as src:
        data = src.read()
    with open(torn, "wb") as dst:
        dst.write(data[: len(data) - 7])  # the final checkpoint loses its last bytes
    with open(path, "rb") as src, open(os.path.join(tmp_path, "cut.kvlog"), "wb") as dst:
        dst.write(src.read()[:-7])  # the same cut of the log closed cleanly: corruption
    with pytest.raises(CorruptLogError):
        replay(os.path.join(tmp_path, "cut.kvlog"))
    result = replay(torn)
    assert result.tail and result.divergence is None
    assert result.num_verified == result.num_checkpoints == replay(path).num_checkpoints - 1

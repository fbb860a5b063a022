"""The Engine: apply/log/reduce/execute, resolve, checkpoints, restore, resume, atomicity."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvlog import Engine, errors, replay
from kvlog.analysis.canary import make_canary_executor
from kvlog.events import (
    BlocksAllocated,
    CacheConfigured,
    Checkpoint,
    RequestFinished,
    StepEnded,
    StoreRequested,
    SwapPlan,
    TransferFinished,
    TransferPlan,
)
from kvlog.log import LogReader

CONFIG = CacheConfigured(num_gpu_blocks=16, block_size=4, num_cpu_blocks=8, threshold=2)


def records(path: str) -> list[tuple[int, object]]:
    return list(LogReader(path).records())


def fragmented(engine: Engine) -> list[object]:
    """Request a holds 10, 11, 12: the next StepEnded compacts them into 1, 2, 3."""
    return engine.apply(BlocksAllocated(req_id="a", block_ids=[10, 11, 12]))


def test_step_compacts_and_resolve_follows(tmp_path: str) -> None:
    engine = Engine(CONFIG, os.path.join(tmp_path, "a.kvlog"))
    assert fragmented(engine) == []
    plans = engine.apply(StepEnded(step=0))
    assert plans == [SwapPlan(step=0, pairs=[(12, 1), (11, 2), (10, 3)], padded_to=8, mode="move")]
    assert [engine.resolve(b) for b in (10, 11, 12, 1, 0)] == [3, 2, 1, 12, 0]
    assert engine.resolve_all([[10, 11], [12], []]) == [[3, 2], [1], []]
    table = np.array([[10, 11, 12, -1], [0, -1, -1, -1]], dtype=np.int32)
    resolved = engine.resolve_all(table)
    assert resolved.dtype == np.int32 and resolved.shape == table.shape
    assert resolved.tolist() == [[3, 2, 1, -1], [0, -1, -1, -1]]
    assert table[0, 0] == 10, "resolve_all must not change its input"
    with pytest.raises(errors.BlockOutOfRange):
        engine.resolve(16)
    with pytest.raises(errors.BlockOutOfRange):
        engine.resolve_all(np.array([[16]]))
    engine.close()


def test_rejected_event_is_not_logged_and_changes_nothing(tmp_path: str) -> None:
    path = os.path.join(tmp_path, "a.kvlog")
    with Engine(CONFIG, path, sync="none") as engine:
        fragmented(engine)
        before = engine.digest()
        with pytest.raises(errors.BlockOutOfRange) as info:
            engine.apply(BlocksAllocated(req_id="b", block_ids=[3, 16]))
        assert isinstance(info.value, ValueError)
        with pytest.raises(errors.BlockInUse):
            engine.apply(BlocksAllocated(req_id="b", block_ids=[11]))
        with pytest.raises(errors.UnknownJob):
            engine.apply(TransferFinished(job_id=5, success=True))
        assert engine.digest() == before
        engine.apply(StepEnded(step=0))
    kinds = [type(r).__name__ for _, r in records(path)]
    assert kinds == ["CacheConfigured", "BlocksAllocated", "StepEnded", "Checkpoint"]


def test_checkpoints_every_n_steps_with_snapshots_every_m(tmp_path: str) -> None:
    path = os.path.join(tmp_path, "a.kvlog")
    digests = {}
    with Engine(CONFIG, path, sync="none", checkpoint_every=2, snapshot_every=2) as engine:
        fragmented(engine)
        for step in range(5):
            engine.apply(StepEnded(step=step))
            digests[step] = engine.running_digest()
    log = records(path)
    checkpoints = [(seq, r) for seq, r in log if isinstance(r, Checkpoint)]
    assert [cp.step for _, cp in checkpoints] == [1, 3, 4]  # two periodic, one at close
    assert [bool(cp.snapshot) for _, cp in checkpoints] == [False, True, True]
    for seq, cp in checkpoints:
        assert cp.seq == seq - 1 and isinstance(dict(log)[cp.seq], StepEnded)
        assert cp.digest == digests[cp.step]
    result = replay(path)
    assert result.ok and result.num_verified == 3


def test_restore_continues_and_replay_verifies_the_snapshot(tmp_path: str) -> None:
    path = os.path.join(tmp_path, "a.kvlog")
    engine = Engine(CONFIG, path, sync="none")
    fragmented(engine)
    engine.apply(StepEnded(step=0))
    blob, digest = engine.snapshot(), engine.digest()
    engine.close()
    copy = Engine.restore(blob)
    assert copy.digest() == digest and copy.resolve(10) == 3
    with Engine.restore(blob, log_path=path, sync="none") as again:
        again.apply(RequestFinished(req_id="a"))
        final = again.digest()
    assert replay(path).final_digest == final
    with pytest.raises(FileNotFoundError):
        Engine.restore(blob, log_path=os.path.join(tmp_path, "new.kvlog"))


def test_existing_log_needs_resume(tmp_path: str) -> None:
    path = os.path.join(tmp_path, "a.kvlog")
    engine = Engine(CONFIG, path, sync="none")
    fragmented(engine)
    engine.apply(StepEnded(step=0))
    digest = engine.digest()
    assert engine._log is not None
    engine._log.abandon()  # a crash: a log closed cleanly can have no torn tail
    size = os.path.getsize(path)
    with open(path, "ab") as f:
        f.write(b"\x07torn")  # a torn tail that a writer would cut
    with pytest.raises(FileExistsError):
        Engine(CONFIG, path)
    assert os.path.getsize(path) == size + 5, "refusing must not modify the log"
    with Engine.resume(path, sync="none") as resumed:
        assert resumed.digest() == digest
        resumed.apply(BlocksAllocated(req_id="b", block_ids=[7]))
        final = resumed.digest()
    result = replay(path)
    assert result.ok and result.final_digest == final


def test_failed_append_poisons_the_engine_and_resume_recovers(
    tmp_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = os.path.join(tmp_path, "a.kvlog")
    engine = Engine(CONFIG, path, sync="step")
    engine.apply(StepEnded(step=0))  # durable: group commit at StepEnded
    durable = engine.digest()
    import kvlog.log.writer as writer

    def broken(fd: int, data: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writer, "_write_all", broken)
    fragmented(engine)  # buffered
    buffered = engine.digest()
    with pytest.raises(errors.LogPoisoned):
        engine.apply(StepEnded(step=1))  # its commit fails: not reduced
    assert engine.digest() == buffered
    with pytest.raises(errors.LogPoisoned):
        engine.apply(StepEnded(step=2))
    engine.close()
    monkeypatch.undo()
    with Engine.resume(path, sync="none") as resumed:
        assert resumed.digest() == durable  # exactly what reached the disk


def test_unencodable_size_is_refused_before_reducing(
    tmp_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a log the writer refuses the record (nothing buffered), without one the engine's
    own bound does: either way the state is unchanged and nothing is logged."""
    import kvlog.log.writer as writer_module
    import kvlog.runtime.records as records_module

    path = os.path.join(tmp_path, "a.kvlog")
    for log_path in (path, None):
        with Engine(CONFIG, log_path, sync="none") as engine:
            monkeypatch.setattr(records_module, "MAX_RECORD_BYTES", 32)
            monkeypatch.setattr(writer_module, "MAX_RECORD_BYTES", 32)
            before = engine.digest()
            big = BlocksAllocated(req_id="a-long-request-id", block_ids=list(range(1, 15)))
            with pytest.raises(errors.RecordRejected):
                engine.apply(big)
            assert engine.digest() == before
            monkeypatch.undo()
            engine.apply(StepEnded(step=0))
    result = replay(path)
    assert result.ok and result.counts.get("BlocksAllocated", 0) == 0


def test_poll_logs_transfer_finished_where_the_executor_reported_it(tmp_path: str) -> None:
    path = os.path.join(tmp_path, "a.kvlog")
    executor, _ = make_canary_executor(CONFIG, backend="fake")
    with Engine(CONFIG, path, executor=executor, sync="none") as engine:
        engine.apply(BlocksAllocated(req_id="a", block_ids=[5, 6]))
        plans = engine.apply(StoreRequested(job_id=7, gpu_block_ids=[5, 6], cpu_block_ids=[0, 1]))
        assert [type(p) for p in plans] == [TransferPlan]
        assert engine.state.jobs_in_flight() == [7]
        results = []
        for _ in range(20):  # the fake backend finishes late, after a few polls
            results += engine.poll()
            if results:
                break
        assert [r.job_id for r in results] == [7]
        assert engine.state.jobs_in_flight() == []
    executor.shutdown()
    events = [r for _, r in records(path) if not isinstance(r, Checkpoint)]
    assert events[-1] == TransferFinished(job_id=7, success=results[0].success)


def test_closed_engine_refuses_events(tmp_path: str) -> None:
    engine = Engine(CONFIG)
    engine.close()
    engine.close()  # idempotent
    with pytest.raises(errors.LogClosed):
        engine.apply(StepEnded(step=0))

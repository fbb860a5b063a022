"""The threading contract: one Engine used from several threads at once is serialized by
its lock, so the state keeps its invariants and the log replays to the live digest; the
stress test itself sees a missing lock (two unlocked threads break ``check_invariants``)."""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvlog import Engine, replay
from kvlog.events import (
    BlocksAllocated,
    CacheConfigured,
    RequestFinished,
    RequestPreempted,
    StepEnded,
)
from kvlog.reducers import check_invariants, checkpoint
from kvlog.runtime.fold import state_at_end

THREADS = 4
BLOCKS_PER_THREAD = 48
CONFIG = CacheConfigured(
    num_gpu_blocks=THREADS * BLOCKS_PER_THREAD + 8,
    block_size=16,
    page_size_bytes=4096,
    threshold=1,
)


@contextlib.contextmanager
def _switch_interval(seconds: float) -> Iterator[None]:
    old = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


def _worker(engine: Engine, index: int, rounds: int, errors: list[BaseException]) -> None:
    """Requests of its own over blocks of its own: allocate, grow, preempt or finish, end a
    step, resolve its tables."""
    base = 8 + index * BLOCKS_PER_THREAD
    try:
        for r in range(rounds):
            req = f"t{index}-r{r}"
            first = base + (r * 5) % (BLOCKS_PER_THREAD - 8)
            engine.apply(BlocksAllocated(req, [first, first + 1, first + 2]))
            engine.apply(BlocksAllocated(req, [first + 3]))
            engine.resolve_all([[first, first + 1, first + 2, first + 3]])
            release = RequestPreempted(req) if r % 3 == 0 else RequestFinished(req)
            engine.apply(release)
            engine.apply(StepEnded(index * rounds + r))
    except BaseException as exc:  # reported by the test thread
        errors.append(exc)


def _hammer(engine: Engine, rounds: int) -> list[BaseException]:
    errors: list[BaseException] = []
    threads = [
        threading.Thread(target=_worker, args=(engine, i, rounds, errors)) for i in range(THREADS)
    ]
    with _switch_interval(1e-6):
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    return errors


def test_four_threads_on_one_engine_keep_the_invariants_and_a_replayable_log(
    tmp_path: Path,
) -> None:
    path = tmp_path / "threads.kvlog"
    engine = Engine(CONFIG, path, sync="none", checkpoint_every=8, snapshot_every=2)
    errors = _hammer(engine, rounds=300)
    assert not errors, errors[:3]
    check_invariants(engine.state)
    live = engine.running_digest()
    engine.close()
    result = replay(path, verify=True)
    assert result.ok, result.divergence
    assert result.counts["StepEnded"] == THREADS * 300
    state, _ = state_at_end(path)
    assert checkpoint.checkpoint_digest(state) == live


def test_the_stress_test_sees_a_missing_lock(tmp_path: Path) -> None:
    """The test above can fail: with the lock taken out, the same threads break the
    engine (an invariant, a refused event, or a log that does not replay)."""
    broken = 0
    for trial in range(3):
        path = tmp_path / f"nolock{trial}.kvlog"
        engine = Engine(CONFIG, path, sync="none", checkpoint_every=8, snapshot_every=2)
        engine._lock = contextlib.nullcontext()  # type: ignore[assignment]
        errors = _hammer(engine, rounds=300)
        try:
            check_invariants(engine.state)
            engine.close()
            ok = replay(path, verify=True).ok
        except (AssertionError, ValueError, OSError):
            ok = False
        broken += bool(errors) or not ok
    if broken == 0:
        pytest.fail("three lock-free runs of four threads all came out sound")

"""Crash consistency at every line: exceptions raised at line
events of the Engine, the Machine, the reducers and the log writer (``fuzz/campaign.py
crash`` at CI size), an observer's error between append and commit, and real ``kvlog
synth`` processes interrupted with SIGINT. Every log left behind replays and verifies;
the engine holds the logged state or refuses every call with ``EngineBroken``."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvlog import Engine, replay
from kvlog.errors import EngineBroken
from kvlog.events import BlocksAllocated, CacheConfigured, Event, Plan, StepEnded
from kvlog.reducers import State
from kvlog.runtime.machine import Observer
from tests.support.campaign import campaign

HERE = Path(__file__).resolve().parent.parent
ROOT = HERE.parent
CONFIG = CacheConfigured(num_gpu_blocks=64, block_size=16, page_size_bytes=4096)


@pytest.fixture(scope="module")
def counts(tmp_path_factory: pytest.TempPathFactory) -> object:
    return campaign.crash_locations(tmp_path_factory.mktemp("dry"), writer=True)


def _is_core(location: tuple[str, int]) -> bool:
    return Path(location[0]).name in ("engine.py", "machine.py")


def test_every_engine_and_machine_line_and_a_sample_of_the_reducers(
    counts: object, tmp_path: Path
) -> None:
    """Every line location of engine.py and machine.py at its first and a random
    occurrence, 120 reducer locations at a random one; the three exceptions in turn."""
    assert isinstance(counts, dict)
    rng = random.Random(20)
    core = sorted(loc for loc in counts if _is_core(loc))
    reducers = sorted(loc for loc in counts if "/reducers/" in loc[0])
    assert len(core) > 100 and len(reducers) > 300  # the program reaches what it should
    points = [(loc, 1) for loc in core]
    points += [(loc, rng.randint(1, counts[loc])) for loc in core]
    points += [(loc, rng.randint(1, counts[loc])) for loc in rng.sample(reducers, 120)]
    names = list(campaign.CRASH_EXCEPTIONS)
    campaign._JUDGED.clear()
    verified = 0
    for index, (location, occurrence) in enumerate(points):
        exc = campaign.CRASH_EXCEPTIONS[names[index % len(names)]]
        verified += campaign.crash_trial(tmp_path, location, occurrence, exc)
    outcomes = campaign._JUDGED
    assert {"broken", "consistent", "closed", "constructor"} <= set(outcomes), outcomes
    assert verified > len(points) // 2


def test_every_line_of_resume(tmp_path: Path) -> None:
    """``Engine.resume`` cut short at each of its line locations leaves no lock and a log
    that still replays and resumes."""
    assert campaign._resume_points(tmp_path, random.Random(1), 40) == 40


def test_every_line_of_the_log_writer(counts: object, tmp_path: Path) -> None:
    """The writer's lines (kvlog/log/writer.py, made interrupt-safe by its own change):
    a frame cut short must not stay in the buffer, a close cut short must not keep the
    descriptor and its lock."""
    assert isinstance(counts, dict)
    writer = sorted(loc for loc in counts if loc[0].endswith("writer.py"))
    assert len(writer) > 30
    failures = []
    for location in writer:
        try:
            campaign.crash_trial(tmp_path, location, 1, KeyboardInterrupt, writer=True)
        except Exception as exc:
            failures.append(f"writer.py:{location[1]}: {type(exc).__name__}: {exc}")
    assert not failures, "\n".join(failures)


class _FailingObserver(Observer):
    """Raises once, in ``before``: after the append, before the state changes."""

    def __init__(self, exc: BaseException) -> None:
        self.exc: BaseException | None = exc

    def before(self, state: State, event: Event) -> None:
        exc, self.exc = self.exc, None
        if exc is not None and type(event) is StepEnded:
            raise exc

    def after(self, state: State, event: Event, plans: list[Plan]) -> None:
        return None


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), RuntimeError("observer"), MemoryError()])
def test_a_raise_between_append_and_commit_breaks_the_engine(
    tmp_path: Path, exc: BaseException
) -> None:
    """A raise after the append and before the commit breaks the engine: no logged event
    is missing from the state, and the log left behind replays (its checkpoints too)."""
    path = tmp_path / "a.kvlog"
    engine = Engine(CONFIG, path, checkpoint_every=1)
    engine.apply(BlocksAllocated("a", [1, 2]))
    engine.machine.observers.append(_FailingObserver(exc))
    with pytest.raises(type(exc)):
        engine.apply(StepEnded(0))
    assert engine.broken
    for call in (lambda: engine.apply(StepEnded(1)), engine.poll, engine.checkpoint):
        with pytest.raises(EngineBroken, match="cut short"):
            call()
    with pytest.raises(EngineBroken):
        engine.resolve(1)
    engine.close()
    result = replay(path, verify=True)
    assert result.ok, result.divergence
    assert result.counts.get("StepEnded") == 1  # logged, so applied by replay
    reference = Engine(CONFIG)
    reference.apply(BlocksAllocated("a", [1, 2]))
    reference.apply(StepEnded(0))
    with Engine.resume(path) as resumed:
        assert resumed.digest() == reference.digest()


def test_an_executor_error_counts_the_plan_as_applied(tmp_path: Path) -> None:
    """The plan's event is logged and the state changed: replay applies it; the engine
    stops (the tensors' bytes are unknown) and closes without a checkpoint."""

    class Failing:
        def execute(self, plan: Plan) -> None:
            raise RuntimeError("device lost")

        def poll(self) -> list[object]:
            return []

    path = tmp_path / "a.kvlog"
    config = CacheConfigured(num_gpu_blocks=64, block_size=16, page_size_bytes=4096, threshold=1)
    engine = Engine(config, path)
    engine.apply(BlocksAllocated("a", [60, 61]))
    engine.executor = Failing()  # type: ignore[assignment]
    with pytest.raises(RuntimeError, match="device lost"):
        engine.apply(StepEnded(0))  # defrag moves 60, 61 down
    with pytest.raises(EngineBroken):
        engine.apply(StepEnded(1))
    engine.close()
    assert replay(path, verify=True).ok


def _cli() -> list[str]:
    return [sys.executable, "-c", "import sys; from kvlog.cli import main; sys.exit(main())"]


@pytest.mark.parametrize("trial", range(3))
def test_sigint_of_a_real_synth_leaves_a_log_that_replays(tmp_path: Path, trial: int) -> None:
    """``kvlog synth --steps 30000 --sync step`` interrupted at a random moment (SIGINT, as
    Ctrl-C): ``kvlog replay`` exits 0. (The exit status of the interrupted synth is the
    CLI's business.)"""
    out = tmp_path / "s.kvlog"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = ["synth", "--out", str(out), "--steps", "30000", "--sync", "step"]
    child = subprocess.Popen(
        _cli() + args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    started = time.monotonic()
    while not out.exists() and child.poll() is None and time.monotonic() - started < 120:
        time.sleep(0.01)
    time.sleep(random.Random(trial).uniform(0.1, 1.5))
    child.send_signal(signal.SIGINT)
    _, err = child.communicate(timeout=120)
    assert out.exists(), err.decode()[-2000:]
    done = subprocess.run(
        [*_cli(), "replay", str(out)], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "verified: the replay agrees" in done.stdout

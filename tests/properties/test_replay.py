"""Replay properties over programs the engine accepts.

- A program written to a log and replayed gives the same plans (re-reduced from the log's
  events) and the same digest (``kvlog.analysis.replay``, every checkpoint verified).
- Snapshot and restore at any point, then continuing, gives the same plans and the same
  digest as not snapshotting; with a log, the restored engine continues the same log and
  a replay of it still verifies; ``Engine.resume`` continues it the same way.
"""

from __future__ import annotations

import os
import tempfile

from hypothesis import given
from hypothesis import strategies as st

from kvlog import Engine, reducers, replay
from kvlog.events import CacheConfigured, Checkpoint, Event, Plan
from kvlog.log import read_log
from tests.support.model import PlainModel
from tests.support.strategies import draw_valid_event, machine_configs


@st.composite
def programs(draw: st.DrawFn, max_events: int = 80) -> tuple[CacheConfigured, list[Event]]:
    """A config and a realistic event program that the plain model accepts throughout."""
    config = draw(machine_configs())
    model = PlainModel()
    model.apply(config)
    events = []
    for _ in range(draw(st.integers(1, max_events))):
        event = draw_valid_event(draw, model)
        model.apply(event)
        events.append(event)
    return config, events


def run(engine: Engine, events: list[Event]) -> list[list[Plan]]:
    return [engine.apply(event) for event in events]


def replanned(path: str) -> list[list[Plan]]:
    """The plans of every event in a log, re-reduced from a fresh state."""
    state = reducers.initial_state()
    plans = []
    for _, record in read_log(path):
        if not isinstance(record, Checkpoint):
            state, these = reducers.reduce(state, record)
            plans.append(these)
    return plans[1:]  # the CacheConfigured record plans nothing


@given(programs(), st.sampled_from(["none", "step", "always"]), st.integers(0, 4))
def test_a_logged_program_replays_to_the_same_plans_and_digest(
    program: tuple[CacheConfigured, list[Event]], sync: str, checkpoint_every: int
) -> None:
    config, events = program
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "program.kvlog")
        with Engine(config, path, sync=sync, checkpoint_every=checkpoint_every) as engine:  # type: ignore[arg-type]
            plans = run(engine, events)
            digest = engine.digest()
        result = replay(path)
        assert result.divergence is None, result.divergence
        assert result.final_digest == digest
        assert result.num_events == len(events) + 1
        assert replanned(path) == plans
        resumed = replay(path, from_snapshot=True)
        assert resumed.divergence is None and resumed.final_digest == digest


@given(programs(), st.data())
def test_snapshot_and_restore_anywhere_changes_nothing(
    program: tuple[CacheConfigured, list[Event]], data: st.DataObject
) -> None:
    config, events = program
    split = data.draw(st.integers(0, len(events)), label="split")
    straight = Engine(config)
    plans = run(straight, events)
    first = Engine(config)
    run(first, events[:split])
    restored = Engine.restore(first.snapshot())
    assert restored.digest() == first.digest()
    assert run(restored, events[split:]) == plans[split:]
    assert restored.digest() == straight.digest()


@given(programs(), st.data(), st.booleans())
def test_a_restored_or_resumed_engine_continues_its_log(
    program: tuple[CacheConfigured, list[Event]], data: st.DataObject, resume: bool
) -> None:
    config, events = program
    split = data.draw(st.integers(0, len(events)), label="split")
    straight = Engine(config)
    plans = run(straight, events)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "program.kvlog")
        first = Engine(config, path, sync="none", checkpoint_every=2)
        run(first, events[:split])
        blob = first.snapshot()
        first.close()
        second = Engine.resume(path) if resume else Engine.restore(blob, log_path=path)
        assert second.digest() == Engine.restore(blob).digest()
        assert run(second, events[split:]) == plans[split:]
        second.close()
        result = replay(path)
        assert result.divergence is None, result.divergence
        assert result.final_digest == straight.digest()
        assert replanned(path) == plans

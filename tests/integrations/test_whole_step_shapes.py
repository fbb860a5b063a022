"""Every step shape the Gaudi runner produces is one ``StepScheduled`` (issue 33).

Steps whose requests take over blocks a load's placeholder holds, and steps where the
books infer a preemption the runner did not report, used to leave the one-event path and
run as fine-grained events (with the books' planning per request). They are now one
``StepScheduled``: the placeholders that let go are among its ``finished`` (the rest of
their blocks held again under a new name among its allocations), the inferred
preemptions among its ``preempted``. Only a partial release (a request that lost some of
its batches and kept later ones) still needs fine-grained events.

The property drives random runner programs (arrivals, growth, finishes, preemptions told
and untold, resumed tables, async loads into blocks the runner sees only later) through
three facades: whole steps (``update_state`` + ``defragment``); the same steps split
(the pending step settled into its fine-grained events before ``defragment``); and the
fine-grained path alone (no folding: the behaviour before). After every step the three
must agree on every request's table, every block's references, the blocks held for
loads and the swaps; the whole-step log must replay to the live digest.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlog import replay
from kvlog.events import (
    BlocksReleased,
    RequestPreempted,
    StepEnded,
    StepPacked,
    StepScheduled,
    unbatched,
)
from kvlog.integrations import OffloadingWorker, OnlineDefragmenter
from kvlog.integrations import books as books_module
from kvlog.integrations.holds import Claims, LoadHolds
from kvlog.log import LogReader
from tests.support.seed_reference import make_hpu_caches

BS = 4
NUM_BLOCKS = 32


def make(log: Path | None = None, prefix_caching: bool = False) -> OnlineDefragmenter:
    defrag = OnlineDefragmenter(
        environ={"VLLM_DEFRAG_THRESHOLD": "2"}, prefix_caching=prefix_caching, log_path=log
    )
    defrag.initialize(make_hpu_caches(NUM_BLOCKS, BS), BS)
    return defrag


def records(path: Path) -> list[object]:
    """The log's events; a step recorded packed (``StepPacked``, a step checked in bulk)
    as the ``StepScheduled`` it stands for."""
    got = (r for _, r in LogReader(path).records() if type(r).__name__ != "Checkpoint")
    return [r.unpacked() if isinstance(r, StepPacked) else r for r in unbatched(got)]


def steps_of(path: Path) -> list[StepScheduled]:
    return [r for r in records(path) if isinstance(r, StepScheduled)]


# -- narrative cases ---------------------------------------------------------------------
def test_a_request_taking_over_a_loads_blocks_is_one_step_record(tmp_path: Path) -> None:
    log = tmp_path / "a.kvlog"
    defrag = make(log)
    worker = OffloadingWorker(defrag, num_cpu_blocks=4)
    defrag.update_state({"a": [30]}, [])
    defrag.defragment()
    worker.declare("load", 1, [0, 1], [20, 21], req_id="r", sync=False)
    assert worker.submit_load(1, [0, 1], [20, 21])
    worker.wait({1})
    assert [r.job_id for r in worker.get_finished()] == [1]
    hold = f"{defrag.session.holds.prefix}1"
    assert defrag.session.held_blocks == {20: hold, 21: hold}
    defrag.update_state({"r": [20, 22]}, [])  # r takes 20; 21 stays held
    defrag.defragment()
    assert defrag.session.held_blocks == {21: f"{hold}.1"}
    assert defrag.req_blocks == {"a": [30], "r": [20, 22]}
    defrag.close()
    last = steps_of(log)[-1]
    assert last == StepScheduled(
        step=1, allocated={f"{hold}.1": [21], "r": [20, 22]}, finished=[hold]
    )
    assert replay(str(log)).ok


def test_an_inferred_preemption_is_one_step_record(tmp_path: Path) -> None:
    log = tmp_path / "a.kvlog"
    defrag = make(log)
    defrag.update_state({"a": [1, 2], "b": [3]}, [])
    defrag.defragment()
    defrag.update_state({"c": [2, 4]}, [])  # vLLM preempted a and said nothing
    defrag.defragment()
    defrag.update_state({"b": [3, 5]}, [])  # b resumed with its own block back
    defrag.defragment()
    assert defrag.req_blocks == {"b": [3, 5], "c": [2, 4]}
    defrag.close()
    assert steps_of(log)[1:] == [
        StepScheduled(step=1, allocated={"c": [2, 4]}, finished=[], preempted=["a"]),
        StepScheduled(step=2, allocated={"b": [3, 5]}, finished=[], preempted=["b"]),
    ]
    assert replay(str(log)).ok


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_a_step_reusing_its_releases_or_sharing_blocks_is_logged_packed(
    tmp_path: Path, prefix_caching: bool
) -> None:
    """The runner's usual full-pool step (a finished request's blocks handed to a new one
    in the same ``update_state``) and, under prefix caching, a cached prefix shared with a
    live request are checked in bulk: one ``StepPacked`` record each."""
    log = tmp_path / "a.kvlog"
    defrag = make(log, prefix_caching=prefix_caching)
    defrag.update_state({"a": [1, 2], "b": [3]}, [])
    defrag.defragment()
    defrag.update_state({"c": [2, 1, 4]}, ["a"])  # a's blocks, straight to c
    defrag.defragment()
    steps = [{"d": [3, 5]}] if prefix_caching else []  # b's block 3, shared
    for allocated in steps:
        defrag.update_state(allocated, [])
        defrag.defragment()
    defrag.close()
    raw = [type(r).__name__ for _, r in LogReader(log).records()]
    assert [k for k in raw if k.startswith("Step")] == ["StepPacked"] * (2 + len(steps))
    assert replay(str(log)).ok


def test_a_partial_release_stays_fine_grained(tmp_path: Path) -> None:
    """a got [1] then [2] (two batches); 1 handed to c proves a lost its first batch, and
    its second may be a resumed table: a keeps [2]. No StepScheduled states that."""
    log = tmp_path / "a.kvlog"
    defrag = make(log)
    defrag.update_state({"a": [1]}, [])
    defrag.defragment()
    defrag.update_state({"a": [2]}, [])
    defrag.defragment()
    defrag.update_state({"c": [1]}, [])
    defrag.defragment()
    assert defrag.req_blocks == {"a": [2], "c": [1]}
    defrag.close()
    got = records(log)
    assert BlocksReleased(req_id="a", block_ids=[1]) in got
    assert not any(isinstance(r, RequestPreempted) for r in got)


# -- the property ------------------------------------------------------------------------
@dataclass
class Step:
    """One runner step of a program: the runner's call, then async loads declared (the
    connector's bind after ``defragment``), submitted and finished in the step."""

    new: dict[str, list[int]]
    finished: list[str]
    preempted: list[str]
    loads: list[tuple[str, list[int]]] = field(default_factory=list)


@dataclass
class Model:
    """vLLM's side, reduced: a free list, running tables, waiting (preempted) requests,
    loaded requests not yet scheduled."""

    free: list[int] = field(default_factory=lambda: list(range(1, NUM_BLOCKS)))
    running: dict[str, list[int]] = field(default_factory=dict)
    waiting: list[str] = field(default_factory=list)
    loaded: dict[str, list[int]] = field(default_factory=dict)  # ready to be scheduled
    loading: dict[str, list[int]] = field(default_factory=dict)  # loaded in this step
    rest: dict[str, list[int]] = field(default_factory=dict)  # loaded, given later
    serial: int = 0

    def take(self, k: int) -> list[int]:
        out, self.free = self.free[:k], self.free[k:]
        return out

    def fresh(self) -> str:
        self.serial += 1
        return f"q{self.serial}"


@st.composite
def programs(draw: st.DrawFn) -> list[Step]:
    model = Model()
    out: list[Step] = []
    for _ in range(draw(st.integers(1, 14))):
        step = Step({}, [], [])
        for _ in range(draw(st.integers(1, 4))):
            _draw_op(draw, model, step)
        model.loaded.update(model.loading)
        model.loading.clear()
        out.append(step)
    return out


def _draw_op(draw: st.DrawFn, model: Model, step: Step) -> None:
    ops = ["arrive", "grow", "finish", "preempt", "resume", "load", "schedule_loaded", "rest"]
    op = draw(st.sampled_from(ops))
    busy = set(step.new) | set(step.finished) | set(step.preempted) | set(model.waiting)
    running = sorted(r for r in model.running if r not in busy)
    waiting = [r for r in model.waiting if r not in step.preempted and r not in step.finished]
    if op == "arrive" and len(model.free) >= 3:
        req = model.fresh()
        model.running[req] = step.new[req] = model.take(draw(st.integers(1, 3)))
    elif op == "grow" and running and model.free:
        req = draw(st.sampled_from(running))
        block = model.take(1)
        model.running[req] = model.running[req] + block
        step.new[req] = block
    elif op == "finish" and running:
        req = draw(st.sampled_from(running))
        model.free = model.running.pop(req) + model.free  # reused first
        step.finished.append(req)
    elif op == "preempt" and running:
        req = draw(st.sampled_from(running))
        model.free = model.running.pop(req) + model.free
        model.waiting.append(req)
        if draw(st.booleans()):  # the runner's call reports none; the switch's does
            step.preempted.append(req)
    elif op == "resume" and waiting and len(model.free) >= 2:
        req = draw(st.sampled_from(waiting))
        model.waiting.remove(req)
        model.running[req] = step.new[req] = model.take(draw(st.integers(1, 2)))
    elif op == "load" and len(model.free) >= 2:
        req = model.fresh()
        model.loading[req] = blocks = model.take(draw(st.integers(1, 2)))
        step.loads.append((req, blocks))
    elif op == "schedule_loaded" and model.loaded:
        req = sorted(model.loaded)[0]
        blocks = model.loaded.pop(req)
        now = draw(st.integers(1, len(blocks)))  # the rest given in a later step
        if now < len(blocks):
            model.rest[req] = blocks[now:]
        extra = model.take(1) if model.free and draw(st.booleans()) else []
        model.running[req] = step.new[req] = blocks[:now] + extra
    elif op == "rest":
        ready = sorted(r for r in model.rest if r in running)
        if ready:
            req = ready[0]
            block_ids = model.rest.pop(req)
            model.running[req] = model.running[req] + block_ids
            step.new[req] = block_ids


Seen = tuple[dict[str, list[int]], dict[int, int], list[int], list[tuple[int, int]] | None]


def run(program: list[Step], prefix_caching: bool, split: bool, log: Path | None) -> list[Seen]:
    defrag = make(log, prefix_caching)
    worker = OffloadingWorker(defrag, num_cpu_blocks=8)
    seen: list[Seen] = []
    job = 0
    for step in program:
        defrag.update_state(step.new, step.finished, step.preempted)
        if split:
            assert defrag.engine is not None  # settles the pending step: fine-grained
        defrag.defragment()
        for req, blocks in step.loads:
            job += 1
            cpu = list(range(len(blocks)))
            worker.declare("load", job, cpu, blocks, req_id=req, sync=False)
            assert worker.submit_load(job, cpu, blocks)
        worker.wait(None)
        worker.get_finished()
        pairs = None if defrag.last_swap is None else list(defrag.last_swap.pairs)
        seen.append(
            (defrag.req_blocks, defrag.used_blocks, sorted(defrag.session.held_blocks), pairs)
        )
    live = defrag.engine.digest()
    defrag.close()
    if log is not None:
        result = replay(str(log))
        assert result.ok and result.final_digest == live
    return seen


@contextlib.contextmanager
def fine_grained_only() -> Iterator[None]:
    """The facade as before issue 33: no claim and no inferred release in a step event."""

    def no_claim(self: LoadHolds, given: Any) -> Claims:
        del self, given
        return Claims([], {}, 0)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(LoadHolds, "plan", no_claim)
        patch.setattr(books_module, "fold", lambda plan, step: None)
        yield


@settings(deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(program=programs(), prefix_caching=st.booleans())
def test_every_step_shape_is_one_event_with_the_fine_grained_outcome(
    program: list[Step], prefix_caching: bool, tmp_path_factory: pytest.TempPathFactory
) -> None:
    log = tmp_path_factory.mktemp("shapes") / "whole.kvlog"
    whole = run(program, prefix_caching, split=False, log=log)
    split = run(program, prefix_caching, split=True, log=None)
    with fine_grained_only():
        before = run(program, prefix_caching, split=False, log=None)
    assert whole == split == before
    # one record per step: a StepEnded (a step applied as fine-grained events) only
    # where the step released part of a request's table
    ends, partial = 0, False
    for record in records(log):
        if isinstance(record, BlocksReleased):
            partial = True
        elif isinstance(record, StepScheduled):
            ends, partial = ends + 1, False
        elif isinstance(record, StepEnded):
            assert partial, "a step without a partial release was applied fine-grained"
            ends, partial = ends + 1, False
    assert ends == len(program)


def test_the_held_blocks_of_a_claim_are_counted_until_claimed() -> None:
    """A placeholder's remaining blocks (held again by the step) are never defrag
    destinations: their references stay."""
    defrag = make()
    worker = OffloadingWorker(defrag, num_cpu_blocks=4)
    worker.declare("load", 1, [0, 1, 2], [5, 6, 7], req_id="r", sync=False)
    assert worker.submit_load(1, [0, 1, 2], [5, 6, 7])
    worker.wait(None)
    worker.get_finished()
    defrag.update_state({"r": [6]}, [])
    defrag.defragment()
    refs = defrag.used_blocks
    assert all(refs.get(defrag.resolve(b)) == 1 for b in (5, 6, 7))
    assert np.array_equal(sorted(defrag.session.held_blocks), [5, 7])

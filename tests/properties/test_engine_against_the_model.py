"""The Engine (no executor) against the plain model of tests/support/model.py, as a state machine.

Rules allocate (sharing blocks with prefix caching, reusing blocks unfinished stores still
read), finish, preempt, end steps, store, load (deferred or not, with KV-cache groups or
not), submit deferred jobs, finish transfers in any order, snapshot and restore, and feed
one-defect invalid events of every kind (loads' blocks allocated, CPU sub-blocks shared by
a store and a load, deferred jobs finished early, bad group specs among them). After every
rule the engine and the model agree on every resolved block, every plan (exact
``SwapPlan``/``TransferPlan``/``FencePlan`` equality), every rejection (the error is one
of the model's classes and the digest does not move), the deferred jobs not yet submitted,
the quarantined blocks, and ``check_invariants`` holds. With a log, the teardown replays it
and checks the digest.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

import pytest
from hypothesis import event as note_event
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from kvlog import Engine, errors, reducers, replay
from kvlog.events import (
    BlocksAllocated,
    CacheConfigured,
    Event,
    LoadRequested,
    RequestFinished,
    RequestPreempted,
    StepEnded,
    StoreRequested,
    TransferFinished,
    TransferSubmitted,
)
from tests.support.model import ModelRejected, PlainModel
from tests.support.strategies import (
    EXPECTED_ERROR,
    INVALID_KINDS,
    draw_allocation,
    draw_blocks_released,
    draw_invalid_event,
    draw_load,
    draw_release,
    draw_step,
    draw_store,
    draw_submit,
    draw_transfer_finished,
    machine_configs,
)


def engine_state(engine: Any) -> Any:
    """The reducer State inside an Engine."""
    return engine.state


class EngineAgainstModel(RuleBasedStateMachine):
    """One Engine and one PlainModel fed the same events."""

    def __init__(self) -> None:
        super().__init__()
        self.model = PlainModel()
        self.engine: Any = None
        self.tmp: str | None = None
        self.log_path: str | None = None
        self.num_accepted = 0

    # -- driving both sides --------------------------------------------------------------
    def apply(self, event: Event | None) -> None:
        """Apply ``event`` to the model and the engine; they must agree on the outcome."""
        if event is None:
            return
        try:
            expected = self.model.apply(event)
        except ModelRejected as rejected:
            self.expect_rejection(event, rejected.kinds)
            return
        plans = self.engine.apply(event)
        assert plans == expected, f"{event!r}: engine planned {plans!r}, model {expected!r}"
        self.num_accepted += 1
        for plan in plans:
            note_event(f"plan {type(plan).__name__}")

    def expect_rejection(self, event: Event, kinds: set[str]) -> None:
        before = self.engine.digest()
        classes = tuple(getattr(errors, kind) for kind in kinds)
        try:
            self.engine.apply(event)
        except errors.InvalidEvent as exc:
            assert isinstance(exc, classes), (
                f"{event!r} raised {type(exc).__name__}: {exc}; expected one of {sorted(kinds)}"
            )
            assert isinstance(exc, ValueError)
        else:
            raise AssertionError(f"engine accepted {event!r}; the model refuses it: {kinds}")
        assert self.engine.digest() == before, f"rejected {event!r} changed the digest"

    # -- rules ---------------------------------------------------------------------------
    @initialize(
        config=machine_configs(), logged=st.booleans(), warm_up=st.integers(0, 8), data=st.data()
    )
    def configure(
        self, config: CacheConfigured, logged: bool, warm_up: int, data: st.DataObject
    ) -> None:
        """A fresh engine (with a log or without), then ``warm_up`` serving steps so that the
        pool is populated and fragmented before the other rules start."""
        self.model.apply(config)
        if logged:
            self.tmp = tempfile.mkdtemp(prefix="kvlog-machine-")
            self.log_path = os.path.join(self.tmp, "machine.kvlog")
        self.engine = Engine(config, log_path=self.log_path, sync="none")
        for _ in range(warm_up):
            self.serve_step(data, data.draw(st.integers(0, 2)), data.draw(st.integers(1, 3)))

    @rule(data=st.data())
    def allocate(self, data: st.DataObject) -> None:
        self.apply(draw_allocation(data.draw, self.model))

    @rule(data=st.data(), preempt=st.booleans())
    def release(self, data: st.DataObject, preempt: bool) -> None:
        self.apply(draw_release(data.draw, self.model, preempt))

    @rule(data=st.data(), num_released=st.integers(0, 2), num_allocated=st.integers(1, 3))
    def serve_step(self, data: st.DataObject, num_released: int, num_allocated: int) -> None:
        """One scheduler step as vLLM reports it: finished, then allocated, then StepEnded."""
        for _ in range(num_released):
            self.apply(draw_release(data.draw, self.model, data.draw(st.booleans())))
        for _ in range(num_allocated):
            self.apply(draw_allocation(data.draw, self.model))
        self.apply(draw_step(data.draw, self.model))

    @rule(data=st.data())
    def end_step(self, data: st.DataObject) -> None:
        self.apply(draw_step(data.draw, self.model))

    @rule(data=st.data())
    def store(self, data: st.DataObject) -> None:
        self.apply(draw_store(data.draw, self.model))

    @rule(data=st.data())
    def load(self, data: st.DataObject) -> None:
        self.apply(draw_load(data.draw, self.model))

    @rule(data=st.data())
    def release_some(self, data: st.DataObject) -> None:
        self.apply(draw_blocks_released(data.draw, self.model))

    @rule(data=st.data())
    def submit(self, data: st.DataObject) -> None:
        self.apply(draw_submit(data.draw, self.model))

    @rule(data=st.data())
    def finish_transfer(self, data: st.DataObject) -> None:
        self.apply(draw_transfer_finished(data.draw, self.model))

    @rule(data=st.data(), kind=st.sampled_from(INVALID_KINDS))
    def invalid(self, data: st.DataObject, kind: str) -> None:
        event = draw_invalid_event(data.draw, self.model, kind)
        note_event(f"invalid {kind}: {'planted' if event is not None else 'not possible'}")
        if event is None:
            return
        try:
            self.model.apply(event)
        except ModelRejected as rejected:
            assert EXPECTED_ERROR[kind] in rejected.kinds | {"InvalidEvent"}, (kind, rejected)
            self.expect_rejection(event, rejected.kinds)
        else:
            raise AssertionError(f"test bug: the {kind} event {event!r} is valid")

    @rule()
    def snapshot_and_restore(self) -> None:
        """Continue on a restored copy (the rest of the program checks its future too); a
        logged engine keeps its log and only compares the copy's digest."""
        restored = Engine.restore(self.engine.snapshot())
        assert restored.digest() == self.engine.digest()
        if self.log_path is None:
            self.engine.close()
            self.engine = restored
        else:
            restored.close()

    # -- invariants ----------------------------------------------------------------------
    @invariant()
    def engine_agrees_with_model(self) -> None:
        if self.engine is None:
            return
        state = engine_state(self.engine)
        reducers.check_invariants(state)
        model = self.model
        num_gpu_blocks = model.config.num_gpu_blocks
        everything = list(range(num_gpu_blocks))
        assert self.engine.resolve_all([everything]) == [[model.resolve(b) for b in everything]]
        tables = {r: state.request_blocks(r) for r in state.live_requests()}
        assert {r: t for r, t in tables.items() if t} == dict(sorted(model.tables.items()))
        resolved = {r: [self.engine.resolve(b) for b in t] for r, t in tables.items() if t}
        assert resolved == model.resolved_tables()
        used = {b for b, n in model.refs().items() if n > 0}
        assert state.num_used == len(used)
        assert state.max_used == max(used, default=-1)
        assert state.jobs_in_flight() == sorted(model.jobs)
        waiting = [j for j in state.jobs_in_flight() if not state.job(j).submitted]
        assert waiting == model.unsubmitted()
        assert state.quarantined == model.quarantined
        pinned = {b for b, n in model.pins().items() if n > 0}
        assert [b for b in everything if state.is_pinned(b)] == sorted(pinned)
        assert state.step == model.step

    def teardown(self) -> None:
        try:
            if self.engine is not None:
                digest = self.engine.digest()
                self.engine.close()
                if self.log_path is not None:
                    assert replayed_digest(self.log_path) == digest
        finally:
            if self.tmp is not None:
                shutil.rmtree(self.tmp, ignore_errors=True)


def replayed_digest(log_path: str) -> str:
    """The digest a verified replay of ``log_path`` ends with."""
    return str(replay(log_path).final_digest)


TestEngineAgainstModel = EngineAgainstModel.TestCase


@pytest.mark.parametrize(
    "event",
    [
        BlocksAllocated(req_id="a", block_ids=[1]),
        RequestFinished(req_id="a"),
        RequestPreempted(req_id="a"),
        StepEnded(step=0),
        StoreRequested(job_id=0, gpu_block_ids=[1], cpu_block_ids=[0]),
        LoadRequested(job_id=0, cpu_block_ids=[0], gpu_block_ids=[1]),
        TransferFinished(job_id=0, success=True),
        TransferSubmitted(job_id=0),
    ],
)
def test_every_event_before_cache_configured_is_refused(event: Event) -> None:
    state = reducers.initial_state()
    before = reducers.digest(state)
    with pytest.raises(errors.NotConfigured):
        reducers.reduce(state, event)
    assert reducers.digest(state) == before

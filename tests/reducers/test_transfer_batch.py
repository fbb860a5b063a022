"""``TransferBatch`` is exactly the transfer events it holds, applied one after another.

A hypothesis property drives two machines over realistic programs whose runs of stores,
loads, submissions and finishes are cut into batches (with stray, shuffled and repeated
events for refusals): one applies each batch as one ``TransferBatch``, the other its events
one by one, all or nothing. Acceptance (the error's type and text), plans, both digests and
the invariants agree after every batch. Narrative cases pin the vLLM connector's batches
and what a refused batch leaves (nothing).
"""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given, settings

from kvlog.errors import BlockInUse, DuplicateJob, InvalidEvent, KvlogError, UnknownJob
from kvlog.events import (
    BlocksAllocated,
    CacheConfigured,
    Event,
    FencePlan,
    LoadRequested,
    Plan,
    StoreRequested,
    TransferBatch,
    TransferFinished,
    TransferPlan,
    TransferSubmitted,
    decode,
    encode,
)
from kvlog.reducers import check_invariants, checkpoint, digest, restore, snapshot
from kvlog.runtime.machine import Machine
from tests.support.strategies import transfer_batch_programs


def _fine(machine: Machine, events: list[Event]) -> list[Plan] | KvlogError:
    """The batch as its events one by one, all or nothing (restored on a refusal)."""
    saved = snapshot(machine.state)
    plans: list[Plan] = []
    try:
        for event in events:
            plans += machine.apply(event)
    except KvlogError as exc:
        machine.state = restore(saved)
        return exc
    return plans


def _whole(machine: Machine, events: list[Event]) -> list[Plan] | KvlogError:
    try:
        return machine.apply(TransferBatch(events=events))  # type: ignore[arg-type]
    except KvlogError as exc:
        return exc


def _same(whole: Machine, fine: Machine) -> None:
    assert checkpoint.checkpoint_digest(whole.state) == checkpoint.checkpoint_digest(fine.state)
    assert digest(whole.state) == digest(fine.state)
    check_invariants(whole.state)


@settings(max_examples=150, deadline=None)
@given(program=transfer_batch_programs())
def test_a_batch_is_its_transfer_events(program: list[list[Event] | Event]) -> None:
    whole, fine = Machine(), Machine()
    for item in program:
        if not isinstance(item, list):
            for machine in (whole, fine):
                with contextlib.suppress(KvlogError):
                    machine.apply(item)
            _same(whole, fine)
            continue
        got, want = _whole(whole, item), _fine(fine, item)
        if isinstance(want, KvlogError):
            assert isinstance(got, KvlogError), f"{item} accepted; its events refuse {want!r}"
            assert (type(got), str(got)) == (type(want), str(want)), item
        else:
            assert got == want, item
        _same(whole, fine)


CONFIG = CacheConfigured(num_gpu_blocks=16, block_size=4, num_cpu_blocks=8, defrag=False)


def _machine() -> Machine:
    machine = Machine()
    machine.apply(CONFIG)
    machine.apply(BlocksAllocated(req_id="r", block_ids=[1, 2, 3, 4]))
    return machine


def test_a_steps_declarations_then_submissions_then_finishes() -> None:
    """The connector's three batches a step: declare (pins, no plan), submit (the plans,
    each load fenced behind the store it shares a block with), finish (unpinned)."""
    machine = _machine()
    declared = machine.apply(
        TransferBatch(
            events=[
                StoreRequested(5, [1, 2], [0, 1], deferred=True),
                LoadRequested(6, [2], [2], deferred=True),
            ]
        )
    )
    assert declared == [] and machine.state.jobs_in_flight() == [5, 6]
    plans = machine.apply(TransferBatch(events=[TransferSubmitted(5), TransferSubmitted(6)]))
    assert [type(p) for p in plans] == [TransferPlan, FencePlan, TransferPlan]
    assert plans[1] == FencePlan(job_ids=[5])
    machine.apply(TransferBatch(events=[TransferFinished(6, True), TransferFinished(5, True)]))
    assert machine.state.jobs_in_flight() == [] and not machine.state.store_pins.any()


@pytest.mark.parametrize(
    ("events", "error"),
    [
        ([StoreRequested(5, [1], [0]), StoreRequested(5, [2], [1])], DuplicateJob),
        ([LoadRequested(5, [0], [9]), LoadRequested(6, [1], [9])], BlockInUse),
        ([StoreRequested(5, [1], [0]), TransferSubmitted(7)], UnknownJob),
        ([TransferSubmitted(6), StoreRequested(6, [1], [0], deferred=True)], UnknownJob),
    ],
)
def test_a_refused_batch_leaves_nothing(events: list[Event], error: type[KvlogError]) -> None:
    machine = _machine()
    before = digest(machine.state)
    with pytest.raises(error):
        machine.apply(TransferBatch(events=events))  # type: ignore[arg-type]
    assert digest(machine.state) == before and machine.state.last_job_id == -1


def test_a_finish_twice_in_one_batch_is_refused_whole() -> None:
    machine = _machine()
    machine.apply(StoreRequested(5, [1], [0]))
    with pytest.raises(UnknownJob, match="job 5 is not in flight"):
        machine.apply(TransferBatch(events=[TransferFinished(5, True), TransferFinished(5, True)]))
    assert machine.state.jobs_in_flight() == [5]


def test_the_batch_round_trips_and_holds_only_transfer_events() -> None:
    batch = TransferBatch(events=[StoreRequested(5, [1], [0], deferred=True), TransferSubmitted(5)])
    assert decode(encode(batch)) == batch
    with pytest.raises(InvalidEvent):
        Machine().apply(TransferBatch(events=[]))
    with pytest.raises(InvalidEvent):
        _machine().apply(TransferBatch(events=[BlocksAllocated("x", [5])]))  # type: ignore[list-item]

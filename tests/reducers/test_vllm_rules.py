"""Narrative scenarios for the reducer rules the real vLLM flow needed (exact block ids).

``BlocksReleased`` (a partial release the facade proves), a store of blocks a sync load is
still filling (fenced, not refused), and a quarantined release under ``quarantine_released``.
"""

from __future__ import annotations

import pytest

from kvlog import errors
from kvlog.events import (
    BlocksAllocated,
    BlocksReleased,
    CacheConfigured,
    FencePlan,
    LoadRequested,
    StepEnded,
    StoreRequested,
    TransferFinished,
    TransferPlan,
    TransferSubmitted,
)
from kvlog.reducers import State, check_invariants, digest, initial_state, reduce


def make(**kwargs: object) -> State:
    config = CacheConfigured(num_gpu_blocks=16, block_size=4, num_cpu_blocks=8, **kwargs)  # type: ignore[arg-type]
    state, _ = reduce(initial_state(), config)
    return state


def run(state: State, *events: object) -> list[object]:
    plans: list[object] = []
    for event in events:
        state, out = reduce(state, event)  # type: ignore[arg-type]
        plans.extend(out)
        check_invariants(state)
    return plans


def test_blocks_released_keeps_the_rest_of_the_table_in_order() -> None:
    state = make(defrag=False)
    run(state, BlocksAllocated("r", [3, 4]), BlocksAllocated("r", [7]), BlocksAllocated("s", [9]))
    run(state, BlocksReleased("r", [3, 4]))
    assert state.tables == {"r": [7], "s": [9]}
    assert state.refs[3] == state.refs[4] == 0 and state.refs[7] == 1
    run(state, BlocksReleased("r", [7]))
    assert state.tables == {"s": [9]}


def test_blocks_released_refuses_a_block_the_request_does_not_hold() -> None:
    state = make(defrag=False)
    run(state, BlocksAllocated("r", [3]))
    before = digest(state)
    with pytest.raises(errors.InvalidEvent, match="does not hold block 4"):
        reduce(state, BlocksReleased("r", [3, 4]))
    with pytest.raises(errors.InvalidEvent):
        reduce(state, BlocksReleased("nobody", [3]))
    assert digest(state) == before


def test_a_store_of_blocks_a_sync_load_fills_waits_for_the_load() -> None:
    """vLLM may store a chunk in the step a sync load fills part of it: the store's plan
    comes after a fence on the load, instead of being refused."""
    state = make(defrag=False)
    run(state, BlocksAllocated("r", [1, 2, 3, 4]))
    run(state, LoadRequested(1, [0, 3], [1, 2], deferred=True))
    assert run(state, StoreRequested(2, [1, 2], [1, 2], deferred=True)) == []
    run(state, TransferSubmitted(1))
    plans = run(state, TransferSubmitted(2))
    assert plans[0] == FencePlan(job_ids=[1])
    assert isinstance(plans[1], TransferPlan) and plans[1].job_id == 2
    run(state, TransferFinished(1, True), TransferFinished(2, True))
    assert not state.is_pinned(1)


def test_released_blocks_wait_one_step_before_they_are_destinations() -> None:
    """With quarantine_released, a block freed in a step is no defrag destination at its
    end (a store the scheduler decided may still read it); at the next step it is."""
    state = make(threshold=0, quarantine_released=True)
    run(state, BlocksAllocated("a", [1, 2]), BlocksAllocated("b", [9]))
    run(state, StepEnded(0))  # compacts 9 -> 3
    run(state, BlocksAllocated("c", [10]))
    run(state, BlocksReleased("a", [1]))
    (plan,) = run(state, StepEnded(1))
    assert plan.pairs == [(10, 4)]  # type: ignore[attr-defined]  # 1 is quarantined
    (plan,) = run(state, StepEnded(2))
    assert plan.pairs == [(4, 1)]  # type: ignore[attr-defined]

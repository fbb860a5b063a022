"""Narrative scenarios for the reducers, each asserting exact block ids.

Every scenario is a short story ("blocks 1..5 to A, 6..9 to B, A finishes, step 0 ->
pairs (9,1),(8,2),(7,3),(6,4)") and checks the plans, the resolved tables and
``check_invariants`` after every event.
"""

from __future__ import annotations

import pytest

from kvlog import errors
from kvlog.events import (
    CacheConfigured,
    Event,
    FencePlan,
    LoadRequested,
    RequestFinished,
    RequestPreempted,
    StepEnded,
    StoreRequested,
    SwapPlan,
    TransferFinished,
    TransferPlan,
)
from kvlog.reducers import State, check_invariants, digest, initial_state
from tests.support.reducer_helpers import alloc, make, rejected, run


def swap(step: int, pairs: list[tuple[int, int]], padded_to: int, mode: str = "move") -> SwapPlan:
    return SwapPlan(step=step, pairs=pairs, padded_to=padded_to, mode=mode)  # type: ignore[arg-type]


def resolved(state: State, req_id: str) -> list[int]:
    return [state.resolve(b) for b in state.request_blocks(req_id)]


# -- defrag --------------------------------------------------------------------------------
def test_highest_used_into_lowest_free_and_both_mappings_follow() -> None:
    state = make()
    run(state, alloc("A", 1, 2, 3, 4, 5), alloc("B", 6, 7, 8, 9), RequestFinished("A"))
    assert (state.num_used, state.max_used) == (4, 9)
    plans = run(state, StepEnded(step=0))
    assert plans == [swap(0, [(9, 1), (8, 2), (7, 3), (6, 4)], padded_to=8)]
    assert state.step == 0
    assert state.request_blocks("B") == [6, 7, 8, 9]
    assert resolved(state, "B") == [4, 3, 2, 1]
    # the logical ids of the free destinations now map to the vacated sources
    assert [state.resolve(b) for b in (1, 2, 3, 4)] == [9, 8, 7, 6]
    assert [state.unresolve(p) for p in (1, 2, 3, 4, 9)] == [9, 8, 7, 6, 1]
    assert (state.num_used, state.max_used) == (4, 4)
    assert run(state, StepEnded(step=1)) == []  # compact now: 4 - 0 > 4 is false


def test_trigger_is_max_used_minus_threshold_above_num_used() -> None:
    events = [alloc("A", 1, 2, 3, 4, 5), alloc("B", 6, 7, 8, 9), RequestFinished("A")]
    state = make(threshold=5)  # 9 - 5 = 4, not > 4
    assert run(state, *events, StepEnded(step=0)) == []
    state = make(threshold=4)  # 9 - 4 = 5 > 4
    assert run(state, *events, StepEnded(step=0)) == [
        swap(0, [(9, 1), (8, 2), (7, 3), (6, 4)], padded_to=8)
    ]


def test_block_zero_is_never_a_destination() -> None:
    state = make()
    run(state, alloc("A", 0), alloc("B", 1, 2), alloc("C", 3, 4, 5, 6), RequestFinished("A"))
    run(state, RequestFinished("B"))
    # used {3,4,5,6}; free 0,1,2: 0 is skipped, and 7 > 4 ends the pairing
    assert run(state, StepEnded(step=3)) == [swap(3, [(6, 1), (5, 2)], padded_to=8)]
    assert resolved(state, "C") == [3, 4, 2, 1]


def test_pairing_stops_when_the_next_free_block_passes_the_next_used_block() -> None:
    state = make()
    run(state, alloc("A", 1), alloc("x", 2), alloc("B", 3), alloc("y", 4), alloc("C", 5))
    run(state, alloc("z", 6, 7, 8), alloc("D", 9), RequestFinished("x"), RequestFinished("y"))
    run(state, RequestFinished("z"))
    # used 1,3,5,9 descending; free 2,4,6,...: (9,2), (5,4), then 6 > 3 stops
    assert run(state, StepEnded(step=0)) == [swap(0, [(9, 2), (5, 4)], padded_to=8)]
    assert [resolved(state, r)[0] for r in "ABCD"] == [1, 3, 4, 2]


def test_max_swaps_caps_a_step_and_the_next_step_goes_on() -> None:
    state = make(max_swaps=2, pad_sizes=(1, 2, 4))
    run(state, alloc("A", 1, 2, 3, 4, 5), alloc("B", 6, 7, 8, 9), RequestFinished("A"))
    assert run(state, StepEnded(step=0)) == [swap(0, [(9, 1), (8, 2)], padded_to=2)]
    assert run(state, StepEnded(step=1)) == [swap(1, [(7, 3), (6, 4)], padded_to=2)]
    assert resolved(state, "B") == [4, 3, 2, 1]


@pytest.mark.parametrize(
    ("pad_sizes", "max_swaps", "padded_to"),
    [((2, 4, 8), 8, 4), ((3,), 3, 3), ((1, 2), 2, 2), ((8, 16, 32, 64, 128, 256, 512), 512, 8)],
)
def test_pad_bucket_is_the_smallest_pad_that_fits(
    pad_sizes: tuple[int, ...], max_swaps: int, padded_to: int
) -> None:
    state = make(pad_sizes=pad_sizes, max_swaps=max_swaps)
    run(state, alloc("A", 1, 2, 3), alloc("B", 4, 5, 6), RequestFinished("A"))
    (plan,) = run(state, StepEnded(step=7))
    assert isinstance(plan, SwapPlan)
    assert plan.pairs == [(6, 1), (5, 2), (4, 3)][:max_swaps]
    assert plan.padded_to == padded_to


def test_prefix_caching_shares_blocks_counts_refs_and_swaps() -> None:
    state = make(prefix_caching=True)
    run(state, alloc("A", 1, 2, 3), alloc("B", 1, 2, 7), alloc("C", 8))
    assert state.refs[1] == 2 and state.refs[3] == 1 and state.num_used == 5
    run(state, RequestFinished("A"))  # 1 and 2 still held by B; 3 is free
    assert state.refs[1] == 1 and state.refs[3] == 0
    assert run(state, StepEnded(step=0)) == [swap(0, [(8, 3), (7, 4)], padded_to=8, mode="swap")]
    assert resolved(state, "B") == [1, 2, 4] and resolved(state, "C") == [3]
    assert state.resolve(3) == 8 and state.resolve(4) == 7  # cached data moved with them


def test_defrag_off_never_plans_and_resolve_stays_identity() -> None:
    state = make(defrag=False)
    run(state, alloc("A", *range(1, 12)), alloc("B", 12, 13, 14, 15), RequestFinished("A"))
    assert run(state, *(StepEnded(step=s) for s in range(3))) == []
    assert resolved(state, "B") == [12, 13, 14, 15]
    assert (state.num_used, state.max_used, state.step) == (4, 15, 2)


def test_preemption_releases_and_a_resumed_request_starts_a_fresh_table() -> None:
    state = make(threshold=32)
    run(state, alloc("A", 1, 2, 3), alloc("A", 4), RequestPreempted("A"))
    assert state.request_blocks("A") == [] and state.num_used == 0
    assert not state.refs.any()
    run(state, alloc("A", 9, 5))
    assert state.request_blocks("A") == [9, 5] and state.live_requests() == ["A"]
    assert int(state.refs.sum()) == 2


def test_appending_to_a_live_request_and_finishing_unknown_requests() -> None:
    state = make()
    run(state, alloc("A", 3), alloc("A", 1, 2), alloc("A"))
    assert state.request_blocks("A") == [3, 1, 2]
    before = digest(state)
    assert run(state, RequestFinished("nobody"), RequestPreempted("nobody"), alloc("B")) == []
    assert digest(state) == before and state.live_requests() == ["A"]


# -- transfers -----------------------------------------------------------------------------
def test_store_expands_cpu_blocks_and_counts_bytes() -> None:
    state = make(num_cpu_blocks=4, block_size_factor=2, page_size_bytes=100)
    run(state, alloc("A", 3, 4, 5, 6))
    (plan,) = run(state, StoreRequested(job_id=0, gpu_block_ids=[3, 4, 5, 6], cpu_block_ids=[1, 0]))
    assert plan == TransferPlan(0, "store", [(3, 2), (4, 3), (5, 0), (6, 1)], 400, -1)
    assert [state.is_pinned(b) for b in (2, 3, 6, 7)] == [False, True, True, False]


def test_load_skips_the_first_sub_blocks_of_the_first_cpu_block() -> None:
    state = make(num_gpu_blocks=32, num_cpu_blocks=8, block_size_factor=4, page_size_bytes=10)
    gpu = [10, 11, 12, 13, 14]  # 5 GPU blocks from 2 CPU blocks of 4: skip (-5) % 4 = 3
    (plan,) = run(state, LoadRequested(job_id=5, cpu_block_ids=[2, 5], gpu_block_ids=gpu))
    assert plan == TransferPlan(
        5, "load", [(11, 10), (20, 11), (21, 12), (22, 13), (23, 14)], 50, -1
    )


@pytest.mark.parametrize(
    ("event", "counts"),
    [
        (StoreRequested(job_id=0, gpu_block_ids=[1, 2, 3], cpu_block_ids=[0]), "4 destination"),
        (LoadRequested(job_id=0, cpu_block_ids=[0], gpu_block_ids=[1, 2, 3, 4, 5]), "5 dest"),
        (LoadRequested(job_id=0, cpu_block_ids=[0, 1], gpu_block_ids=[1, 2, 3, 4]), "minus 0"),
    ],
)
def test_sizes_that_do_not_fit_the_factor_are_refused(event: Event, counts: str) -> None:
    state = make(num_cpu_blocks=4, block_size_factor=4)
    run(state, alloc("A", 1, 2, 3, 4, 5))
    rejected(state, event, errors.TransferSizeMismatch, counts)


def test_transfers_resolve_logical_ids_at_submit_time() -> None:
    state = make(num_cpu_blocks=4)
    run(state, alloc("A", 1, 2, 3, 4, 5), alloc("B", 6, 7, 8, 9), RequestFinished("A"))
    run(state, StepEnded(step=0))  # B now lives in physical 4, 3, 2, 1
    (store,) = run(state, StoreRequested(job_id=0, gpu_block_ids=[9, 6], cpu_block_ids=[0, 1]))
    assert isinstance(store, TransferPlan) and store.pairs == [(1, 0), (4, 1)]
    (load,) = run(state, LoadRequested(job_id=1, cpu_block_ids=[2], gpu_block_ids=[7]))
    assert isinstance(load, TransferPlan) and load.pairs == [(2, 3)]
    assert [state.is_pinned(p) for p in (1, 2, 3, 4, 9)] == [True, False, True, True, False]


def test_defrag_skips_pinned_sources_and_resumes_after_the_store() -> None:
    state = make(num_cpu_blocks=4)
    run(state, alloc("A", 1, 2, 3, 4, 5), alloc("B", 6, 7, 8, 9))
    run(state, StoreRequested(job_id=0, gpu_block_ids=[9], cpu_block_ids=[0]))
    run(state, RequestFinished("A"))
    # trigger counts 9 (pinned): 9 - 0 > 4; sources 8, 7, 6 skip the pinned 9
    assert run(state, StepEnded(step=0)) == [swap(0, [(8, 1), (7, 2), (6, 3)], padded_to=8)]
    assert resolved(state, "B") == [3, 2, 1, 9]
    run(state, TransferFinished(job_id=0, success=True))
    assert run(state, StepEnded(step=1)) == [swap(1, [(9, 4)], padded_to=8)]
    assert resolved(state, "B") == [3, 2, 1, 4]


def test_a_finished_request_keeps_its_blocks_pinned_until_its_store_ends() -> None:
    state = make(num_cpu_blocks=4)
    run(state, alloc("A", 1, 2), alloc("C", 3, 4), alloc("B", 5, 6, 7, 8, 9))
    run(state, StoreRequested(job_id=0, gpu_block_ids=[1, 2], cpu_block_ids=[0, 1]))
    run(state, RequestFinished("A"), RequestFinished("C"))
    assert state.refs[1] == 0 and state.is_pinned(1)
    # 1 and 2 are free but pinned: destinations start at 3; then 10 > 7 stops
    assert run(state, StepEnded(step=0)) == [swap(0, [(9, 3), (8, 4)], padded_to=8)]
    # the scheduler may hand the block out again (vLLM fences its own reuse with
    # jobs_to_flush): the new owner waits for the store that still reads it
    assert run(state, alloc("D", 1)) == [FencePlan(job_ids=[0])]
    assert resolved(state, "D") == [1] and state.is_pinned(1)
    run(state, TransferFinished(job_id=0, success=False))  # a failed job ends and unpins too
    assert not state.is_pinned(1) and not state.is_pinned(2)


def test_prefix_caching_may_reuse_a_block_a_store_still_reads() -> None:
    state = make(num_cpu_blocks=4, prefix_caching=True)
    run(state, alloc("A", 1), StoreRequested(job_id=0, gpu_block_ids=[1], cpu_block_ids=[0]))
    run(state, RequestFinished("A"), alloc("B", 1))
    assert resolved(state, "B") == [1] and state.is_pinned(1)


def test_pins_are_counts_and_conflicts_are_refused() -> None:
    state = make(num_cpu_blocks=8)
    run(state, alloc("A", 1, 2, 3))
    run(state, StoreRequested(job_id=0, gpu_block_ids=[1, 2], cpu_block_ids=[0, 1]))
    run(state, StoreRequested(job_id=1, gpu_block_ids=[2], cpu_block_ids=[2]))
    assert (state.store_pins[2], state.store_pins[1]) == (2, 1)
    # a load into a block unfinished stores read runs after them (vLLM loads into a block
    # whose flushed store has not run yet): submission order, by a fence
    plans = run(state, LoadRequested(job_id=2, cpu_block_ids=[3], gpu_block_ids=[2]))
    assert plans[0] == FencePlan(job_ids=[0, 1]) and isinstance(plans[1], TransferPlan)
    rejected(  # two loads into one block are nonsense
        state,
        LoadRequested(job_id=3, cpu_block_ids=[4], gpu_block_ids=[2]),
        errors.BlockInUse,
        r"unfinished load jobs \[2\] write it too",
    )
    run(state, LoadRequested(job_id=3, cpu_block_ids=[5], gpu_block_ids=[5]))
    # a store of a block a load fills runs after the load (vLLM stores a chunk a sync load
    # just filled)
    plans = run(state, StoreRequested(job_id=4, gpu_block_ids=[5], cpu_block_ids=[4]))
    assert plans[0] == FencePlan(job_ids=[3]) and isinstance(plans[1], TransferPlan)
    rejected(  # but a store may not write a CPU block an unfinished load reads
        state,
        StoreRequested(job_id=5, gpu_block_ids=[1], cpu_block_ids=[5]),
        errors.BlockInUse,
        "CPU sub-block 5 that unfinished load job 3 reads",
    )
    run(state, TransferFinished(job_id=0, success=True))
    assert state.is_pinned(2) and not state.is_pinned(1)
    for job_id in (1, 2, 3, 4):
        run(state, TransferFinished(job_id=job_id, success=True))
    assert not state.pinned.any() and state.jobs_in_flight() == []


def test_after_job_id_is_the_latest_unfinished_job_of_the_same_direction() -> None:
    state = make(num_cpu_blocks=16)
    run(state, alloc("A", *range(1, 9)))

    def store(job_id: int, block: int) -> int:
        (plan,) = run(state, StoreRequested(job_id, gpu_block_ids=[block], cpu_block_ids=[job_id]))
        assert isinstance(plan, TransferPlan)
        return plan.after_job_id

    def load(job_id: int, block: int) -> int:
        (plan,) = run(state, LoadRequested(job_id, cpu_block_ids=[job_id], gpu_block_ids=[block]))
        assert isinstance(plan, TransferPlan)
        return plan.after_job_id

    assert [store(1, 1), store(2, 2), load(3, 10), load(4, 11)] == [-1, 1, -1, 3]
    run(state, TransferFinished(job_id=2, success=True))
    assert store(5, 3) == 1  # 2 is done, 1 is still in flight
    run(state, TransferFinished(job_id=1, success=True), TransferFinished(job_id=5, success=True))
    assert [store(6, 4), load(7, 12)] == [-1, 4]
    assert state.jobs_in_flight() == [3, 4, 6, 7]


def test_job_ids_must_increase_and_finish_only_in_flight_jobs() -> None:
    state = make(num_cpu_blocks=4)
    run(state, alloc("A", 1, 2), StoreRequested(job_id=3, gpu_block_ids=[1], cpu_block_ids=[0]))
    again = StoreRequested(job_id=3, gpu_block_ids=[2], cpu_block_ids=[1])
    rejected(state, again, errors.DuplicateJob, "job id 3 is in flight.*strictly increasing")
    lower = LoadRequested(job_id=2, cpu_block_ids=[1], gpu_block_ids=[5])
    rejected(state, lower, errors.DuplicateJob, "was used before.*one counter")
    rejected(state, TransferFinished(job_id=9, success=True), errors.UnknownJob, "never")
    run(state, TransferFinished(job_id=3, success=True))
    rejected(state, TransferFinished(job_id=3, success=True), errors.UnknownJob, "finished")
    rejected(state, again, errors.DuplicateJob, "was used before")


def test_jobs_in_flight_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kvlog.reducers.transfers.MAX_JOBS_IN_FLIGHT", 2)
    state = make(num_cpu_blocks=4)
    run(state, alloc("A", 1, 2, 3))
    run(state, StoreRequested(job_id=0, gpu_block_ids=[1], cpu_block_ids=[0]))
    run(state, StoreRequested(job_id=1, gpu_block_ids=[2], cpu_block_ids=[1]))
    third = StoreRequested(job_id=2, gpu_block_ids=[3], cpu_block_ids=[2])
    rejected(state, third, errors.TooManyJobs, "2 jobs are already in flight")
    run(state, TransferFinished(job_id=0, success=True), third)


# -- validation ----------------------------------------------------------------------------
def test_bad_input_is_refused_with_a_typed_error_and_changes_nothing() -> None:
    state = make(num_cpu_blocks=4)
    run(state, alloc("A", 1, 2), StoreRequested(job_id=0, gpu_block_ids=[1], cpu_block_ids=[0]))
    cases: list[tuple[Event, type[Exception], str | None]] = [
        (alloc("B", 3, 16), errors.BlockOutOfRange, "block id 16, outside"),
        (alloc("B", 3, -1), errors.BlockOutOfRange, "block id -1"),
        (alloc("B", 2), errors.BlockInUse, "held by live request 'A'"),
        (alloc("A", 1), errors.BlockInUse, "held by live request 'A'"),
        (alloc("B", 4, 5, 4), errors.DuplicateBlock, "twice"),
        (
            StoreRequested(job_id=1, gpu_block_ids=[2], cpu_block_ids=[4]),
            errors.BlockOutOfRange,
            "cpu_block_ids holds block id 4",
        ),
        (
            LoadRequested(job_id=1, cpu_block_ids=[0], gpu_block_ids=[99]),
            errors.BlockOutOfRange,
            "gpu_block_ids",
        ),
        (
            StoreRequested(job_id=1, gpu_block_ids=[2, 2], cpu_block_ids=[1]),
            errors.DuplicateBlock,
            None,
        ),
        (CacheConfigured(num_gpu_blocks=8, block_size=16), errors.AlreadyConfigured, None),
        (StepEnded(step=-1), errors.InvalidEvent, None),
    ]
    for event, error, match in cases:
        rejected(state, event, error, match)
        assert issubclass(error, ValueError)
    fresh = initial_state()
    rejected(fresh, alloc("A", 1), errors.NotConfigured, "CacheConfigured")
    rejected(fresh, StepEnded(step=0), errors.NotConfigured)


def test_queries_before_configuration_are_the_identity() -> None:
    state = initial_state()
    assert (state.resolve(5), state.unresolve(5), state.num_used, state.max_used) == (5, 5, 0, -1)
    assert state.live_requests() == [] and state.jobs_in_flight() == [] and state.step == -1
    check_invariants(state)

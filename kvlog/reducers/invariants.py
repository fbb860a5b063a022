"""``check_invariants``: a debug tool that recomputes everything derivable and compares.

O(num_gpu_blocks + blocks in tables and jobs), vectorized; every failure is an
``AssertionError`` whose message names the broken invariant (a bug in kvlog).
"""

from __future__ import annotations

import numpy as np

from kvlog.reducers import checkpoint
from kvlog.reducers.blockset import ALL_ONES, BlockSet, pack_words, summaries
from kvlog.reducers.state import MAX_JOBS_IN_FLIGHT, State

__all__ = ["check_invariants"]


def check_invariants(state: State) -> None:
    """Assert that the state is internally consistent (see the module docstring)."""
    n = state.num_gpu_blocks
    if state.config is None:
        assert n == 0 and not state.tables and state.jobs_in_flight() == [], (
            "an unconfigured state holds blocks, tables or jobs"
        )
        return
    assert n == state.config.num_gpu_blocks, "arrays are not sized num_gpu_blocks"
    _check_mapping(state)
    _check_refs(state)
    _check_bitmap(state.used, state.refs > 0, "used")
    _check_jobs(state)
    _check_last_swap(state)
    _check_running_digest(state)


def _check_running_digest(state: State) -> None:
    fwd, tables, per_request, jobs = checkpoint.recompute(state)
    sums = state.running
    assert sums.fwd == fwd, "the running digest's mapping sum drifted"
    assert sums.tables == tables, "the running digest's table sum drifted"
    assert sums.per_request == per_request, "a request's running table sum drifted"
    assert sums.jobs == jobs, "the running digest's job sum drifted"


def _check_mapping(state: State) -> None:
    n = state.num_gpu_blocks
    identity = np.arange(n, dtype=np.int32)
    fwd, bwd = state.fwd, state.bwd
    assert fwd.min(initial=0) >= 0 and fwd.max(initial=0) < max(n, 1), "fwd leaves the pool"
    assert np.array_equal(bwd[fwd], identity), "bwd is not the inverse of fwd"
    assert np.array_equal(fwd[bwd], identity), "fwd is not the inverse of bwd"
    assert state.config is not None
    if not state.config.defrag:
        assert np.array_equal(fwd, identity), "defrag is off but the mapping moved"


def _check_refs(state: State) -> None:
    n = state.num_gpu_blocks
    assert state.config is not None
    logical = [np.asarray(t, dtype=np.int64) for t in state.tables.values()]
    assert all(t.size for t in logical), "a live request has an empty table"
    flat = np.concatenate(logical) if logical else np.zeros(0, dtype=np.int64)
    assert flat.size == 0 or (flat.min() >= 0 and flat.max() < n), "a table leaves the pool"
    expected = np.bincount(state.fwd[flat], minlength=n)
    assert np.array_equal(expected, state.refs), "ref counts differ from the live tables"
    if not state.config.prefix_caching:
        assert state.refs.max(initial=0) <= 1, "a block is shared without prefix caching"
    used = np.flatnonzero(state.refs > 0)
    assert state.num_used == used.size, "num_used differs from the ref counts"
    top = int(used[-1]) if used.size else -1
    assert state.max_used == top, f"max_used is {state.max_used}, the ref counts say {top}"
    assert state.step >= -1, "step below -1"


def _check_bitmap(blocks: BlockSet, mask: np.ndarray, name: str) -> None:
    assert np.array_equal(blocks.words, pack_words(mask)), f"{name} bitmap differs from counts"
    assert blocks.count == int(np.count_nonzero(mask)), f"{name} count is wrong"
    nonempty, notfull = summaries(blocks.words)
    assert np.array_equal(blocks.nonempty, nonempty), f"{name} nonempty summary is wrong"
    assert np.array_equal(blocks.notfull, notfull), f"{name} notfull summary is wrong"
    assert not (blocks.words == ALL_ONES).any() or blocks.size >= 64, f"{name} overflows"


def _check_jobs(state: State) -> None:
    n = state.num_gpu_blocks
    assert state.config is not None
    for kind, jobs, pins in (
        ("store", state.store_jobs, state.store_pins),
        ("load", state.load_jobs, state.load_pins),
    ):
        ids = list(jobs)
        assert ids == sorted(ids), f"{kind} jobs are not in submit order"
        assert all(j.kind == kind and j.job_id == i for i, j in jobs.items()), (
            f"{kind} job records are mislabelled"
        )
        gpu = [j.gpu_block_ids for j in jobs.values()]
        flat = np.concatenate(gpu) if gpu else np.zeros(0, dtype=np.int64)
        assert flat.size == 0 or (flat.min() >= 0 and flat.max() < n), f"{kind} leaves the pool"
        assert np.array_equal(np.bincount(flat, minlength=n), pins), (
            f"{kind} pin counts differ from the unfinished {kind} jobs"
        )
        for j in jobs.values():
            cpu = j.cpu_block_ids
            assert cpu.size == 0 or cpu.max() < state.config.num_cpu_blocks, "CPU id range"
    in_flight = state.jobs_in_flight()
    assert len(in_flight) <= MAX_JOBS_IN_FLIGHT, "too many jobs in flight"
    assert all(j <= state.last_job_id for j in in_flight), "a job id above last_job_id"
    assert not set(state.store_jobs) & set(state.load_jobs), "a job is both store and load"
    pinned = (state.store_pins | state.load_pins) > 0
    if state.quarantined:
        pinned[np.fromiter(state.quarantined, np.int64, len(state.quarantined))] = True
    assert np.array_equal(state.pinned, pack_words(pinned)), (
        "pinned bitmap differs from pins and quarantine"
    )


def _check_last_swap(state: State) -> None:
    plan = state.last_swap
    if plan is None:
        return
    assert state.config is not None and state.config.defrag, "a SwapPlan with defrag off"
    assert 0 < len(plan.pairs) <= state.config.max_swaps, "SwapPlan size out of bounds"
    moved = np.asarray(plan.pairs, dtype=np.int64)
    src, dst = moved[:, 0], moved[:, 1]
    assert (dst > 0).all(), "block 0 is a SwapPlan destination"
    assert (dst < src).all(), "a SwapPlan moves a block upward"
    assert np.unique(moved).size == moved.size, "a block appears twice in a SwapPlan"
    pins = state.store_pins | state.load_pins
    assert not pins[dst].any(), "a pinned block is a SwapPlan destination"
    assert not pins[src].any(), "a pinned block is a SwapPlan source"
    assert (state.refs[dst] > 0).all() and not state.refs[src].any(), "refs did not move"

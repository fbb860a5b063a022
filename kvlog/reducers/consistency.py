"""``check_consistent``: the invariants of a State read from outside (a snapshot), checked
with typed errors.

``check_invariants`` asserts (a broken invariant there is a kvlog bug, and ``python -O``
drops it); a snapshot is input, so ``restore`` checks it with ``CorruptLogError``. Where
asserts are on, ``check_invariants`` does it (it checks all of the below and the derived
data; its ``AssertionError`` becomes ``CorruptLogError``); where they are off, the checks
here run instead: the mapping is a permutation and its inverse, ref counts are those of
the live tables, pin counts those of the unfinished jobs, and every id is in range.
O(num_gpu_blocks), vectorized.
"""

from __future__ import annotations

import numpy as np

from kvlog.errors import CorruptLogError
from kvlog.reducers.invariants import check_invariants
from kvlog.reducers.state import State

__all__ = ["check_consistent"]


def _require(condition: bool, what: str) -> None:
    if not condition:
        raise CorruptLogError(f"bad state snapshot: {what}")


def check_consistent(state: State) -> None:
    """Raise ``CorruptLogError`` naming the first broken invariant of ``state``."""
    config = state.config
    _require(state.step >= -1 and state.last_job_id >= -1, "step or last job id below -1")
    if config is None:
        _require(
            state.num_gpu_blocks == 0 and not state.tables and not state.jobs_in_flight(),
            "an unconfigured state holds blocks, tables or jobs",
        )
        return
    n = state.num_gpu_blocks
    _require(n == config.num_gpu_blocks, "arrays are not sized num_gpu_blocks")
    if __debug__:
        try:
            check_invariants(state)
        except AssertionError as exc:
            raise CorruptLogError(f"bad state snapshot: {exc}") from exc
        return
    fwd, bwd = state.fwd, state.bwd
    in_range = n == 0 or (
        int(min(fwd.min(), bwd.min())) >= 0 and int(max(fwd.max(), bwd.max())) < n
    )
    _require(in_range, "the mapping leaves the pool")
    _require(np.array_equal(bwd[fwd], np.arange(n, dtype=np.int32)), "bwd is not fwd's inverse")
    _check_tables(state, fwd)
    _check_jobs(state)


def _check_tables(state: State, fwd: np.ndarray) -> None:
    n = state.num_gpu_blocks
    tables = [np.asarray(t, dtype=np.int64) for t in state.tables.values()]
    _require(all(t.ndim == 1 and t.size for t in tables), "a live request has an empty table")
    flat = np.concatenate(tables) if tables else np.zeros(0, dtype=np.int64)
    _require(flat.size == 0 or bool(flat.min() >= 0 and flat.max() < n), "a table id range")
    expected = np.bincount(fwd[flat], minlength=n)
    _require(np.array_equal(expected, state.refs), "ref counts differ from the live tables")
    assert state.config is not None
    if not state.config.prefix_caching:
        _require(int(state.refs.max(initial=0)) <= 1, "a block shared without prefix caching")


def _check_jobs(state: State) -> None:
    n = state.num_gpu_blocks
    assert state.config is not None
    num_cpu = state.config.num_cpu_blocks
    _require(not set(state.store_jobs) & set(state.load_jobs), "a job is a store and a load")
    for kind, jobs, pins in (
        ("store", state.store_jobs, state.store_pins),
        ("load", state.load_jobs, state.load_pins),
    ):
        _require(list(jobs) == sorted(jobs), f"{kind} jobs out of submit order")
        for job_id, job in jobs.items():
            _require(job.kind == kind and 0 <= job_id <= state.last_job_id, f"{kind} job id")
            cpu = job.cpu_block_ids
            _require(cpu.size == 0 or bool(cpu.min() >= 0 and cpu.max() < num_cpu), "CPU ids")
        gpu = [j.gpu_block_ids for j in jobs.values()]
        flat = np.concatenate(gpu) if gpu else np.zeros(0, dtype=np.int64)
        _require(flat.size == 0 or bool(flat.min() >= 0 and flat.max() < n), f"{kind} GPU ids")
        counts = np.bincount(flat, minlength=n)
        _require(np.array_equal(counts, pins), f"{kind} pin counts differ from the jobs")

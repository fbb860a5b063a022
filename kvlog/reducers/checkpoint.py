"""A checkpoint's digest of a state: the running sums (``running.py``) read out in O(1), and
the same sums recomputed from scratch (after a restore, and by ``check_invariants`` to check
the running ones)."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from kvlog.events import CacheConfigured
from kvlog.reducers.running import (
    DIGEST_V2_PREFIX,
    MASK,
    fwd_terms,
    job_term,
    request_key,
    submitted_term,
    table_sums,
)

if TYPE_CHECKING:
    from kvlog.reducers.state import State

__all__ = ["DIGEST_V2_PREFIX", "checkpoint_digest", "recompute", "reseat"]


def recompute(
    state: State, *, keep_terms: bool = False
) -> tuple[int, int, dict[str, list[int]], int]:
    """The three sums and the per-request ``[key, sum]`` from scratch (tables are never
    empty); ``keep_terms``: also store each job's term on it."""
    n = state.num_gpu_blocks
    fwd = fwd_terms(np.arange(n, dtype=np.int64), state.fwd.astype(np.int64)) if n else 0
    req_ids = list(state.tables)
    keys = [request_key(req_id) for req_id in req_ids]
    tables = [state.tables[req_id] for req_id in req_ids]
    sums = table_sums(keys, [0] * len(tables), tables)
    per_request = {
        req_id: [key, total] for req_id, key, total in zip(req_ids, keys, sums, strict=True)
    }
    jobs = 0
    for job in [*state.store_jobs.values(), *state.load_jobs.values()]:
        term = job_term(job)
        if keep_terms:
            job.term = term
        jobs += term + (submitted_term(job.job_id) if job.submitted else 0)
    return fwd, sum(sums) & MASK, per_request, jobs & MASK


def checkpoint_digest(state: State) -> str:
    """``"v2:"`` + the sha256 of the running sums and the few O(1) fields (the quarantined
    blocks are those released since the last step): O(1) in the pool."""
    sums = state.running
    body: list[Any] = [
        2,
        _config(state.config),
        state.step,
        state.last_job_id,
        sums.fwd,
        sums.tables,
        sums.jobs,
        sorted(state.quarantined),
    ]
    return DIGEST_V2_PREFIX + hashlib.sha256(msgspec.msgpack.encode(body)).hexdigest()


def _config(config: CacheConfigured | None) -> Any:
    return None if config is None else msgspec.to_builtins(config)


def reseat(state: State) -> None:
    """Rebuild ``state.running`` from scratch (after a restore), each job's term kept."""
    fwd, tables, per_request, jobs = recompute(state, keep_terms=True)
    state.running.reseat(fwd, tables, jobs, {r: total for r, (_, total) in per_request.items()})

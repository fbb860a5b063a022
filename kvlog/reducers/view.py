"""What a caller outside the reducers may read of a :class:`~kvlog.reducers.state.State`:
one small read-only view (:class:`BooksView`). The facades read the books through it, never
the state's buffers, so the state's layout can change without them noticing, and nothing
outside the reducers can write a block of it by accident: the arrays it hands out are
read-only numpy views."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from kvlog.events import CacheConfigured, Event, StepScheduled
from kvlog.reducers import kernels, step
from kvlog.reducers.state import State

__all__ = ["BooksView", "JobView"]


class JobView:
    """An unfinished transfer, as a facade sees it: its id, kind, and whether its plan ran."""

    __slots__ = ("job_id", "kind", "submitted")

    def __init__(self, job_id: int, kind: str, submitted: bool) -> None:
        self.job_id, self.kind, self.submitted = job_id, kind, submitted


def _read_only(array: np.ndarray) -> np.ndarray:
    view = array.view()
    view.flags.writeable = False
    return view


class BooksView:
    """A read-only window on one State (live: it follows the state as events change it)."""

    __slots__ = ("_state",)

    def __init__(self, state: State) -> None:
        self._state = state

    @property
    def config(self) -> CacheConfigured | None:
        return self._state.config

    @property
    def num_gpu_blocks(self) -> int:
        return self._state.num_gpu_blocks

    @property
    def num_moves(self) -> int:
        """Defrag moves so far: the mapping changed since a caller's copy if this did."""
        return self._state.num_moves

    @property
    def last_job_id(self) -> int:
        return self._state.last_job_id

    def resolve(self, block_id: int) -> int:
        """A logical block's physical block."""
        return self._state.resolve(block_id)

    def resolver(self) -> Callable[[int], int]:
        """``resolve`` with no view in between (one call per id: a runner resolves a block
        id at a time, hundreds a step); it follows the state as ``resolve`` does."""
        return self._state.resolve

    def unresolve(self, physical: int) -> int:
        """The logical block now at a physical block."""
        return self._state.unresolve(physical)

    def resolve_into(self, block_ids: np.ndarray, out: np.ndarray) -> None:
        """``resolve`` over a 2-D table of ids (any integer dtype and strides), written to
        ``out`` (the same shape): one compiled pass, no temporaries (a runner's decode
        table, thousands of ids a step). Ids outside the pool pass unchanged."""
        assert block_ids.shape == out.shape and block_ids.ndim == 2, "resolve_into's shapes"
        kernels.resolve_into(self._state.fwd, block_ids, out)

    def forward(self) -> np.ndarray:
        """The forward table (logical -> physical), read only."""
        return _read_only(self._state.fwd)

    def backward(self) -> Sequence[int]:
        """The backward table (physical -> logical) as a sequence of ints: indexing it is
        a C lookup, cheaper than a numpy scalar (read it, never write it)."""
        return self._state.bwd_buffer

    def references(self) -> np.ndarray:
        """Per physical block, how many live tables hold it (0: free), read only."""
        return _read_only(self._state.refs)

    def in_use(self, block_ids: Sequence[int]) -> list[bool]:
        """Per logical block, whether its physical block is held by any table (an id
        outside the pool: False, for the event's own check to refuse): a lookup a block
        in C (a load's few ids; no numpy set-up)."""
        state = self._state
        fwd, refs, size = state.fwd_buffer, state.refs_buffer, len(state.fwd_buffer)
        return [0 <= b < size and refs[fwd[b]] > 0 for b in block_ids]

    def being_loaded(self, block_ids: np.ndarray) -> np.ndarray:
        """Positions in ``block_ids`` (logical, in range) of blocks an unfinished load writes."""
        state = self._state
        return np.flatnonzero(state.load_pins[state.fwd[block_ids]] > 0)

    def request_blocks(self, req_id: str) -> list[int]:
        return list(self._state.request_blocks(req_id))

    def live_requests(self) -> list[str]:
        return self._state.live_requests()

    def jobs_in_flight(self) -> list[int]:
        return self._state.jobs_in_flight()

    def has_transfers(self) -> bool:
        """Whether any store or load is unfinished."""
        return bool(self._state.store_jobs or self._state.load_jobs)

    def job(self, job_id: int) -> JobView | None:
        """An unfinished job, or None."""
        job = self._state.job(job_id)
        return None if job is None else JobView(job.job_id, job.kind, job.submitted)

    def held_by_receiver(self, allocated: dict[str, list[int]], released: set[str]) -> bool:
        """Whether a step's allocation gives a request a block it already holds (prefix
        caching; ``reducers.step.held_by_receiver``): such a step takes the fine path."""
        return step.held_by_receiver(self._state, allocated, released)

    def expand_step(self, event: StepScheduled) -> list[Event]:
        """The fine-grained events a whole step stands for, against the state as it is."""
        return step.expand(self._state, event)

"""Hypothesis strategies shared by the test suite.

Add new strategies at the end of this file; do not rewrite existing ones (other tests use them).
"""

from __future__ import annotations

from hypothesis import strategies as st

from kvlog.events import (
    BlocksAllocated,
    CacheConfigured,
    Checkpoint,
    Event,
    LoadRequested,
    Record,
    RequestFinished,
    RequestPreempted,
    StepEnded,
    StoreRequested,
    TransferFinished,
)

__all__ = [
    "any_event",
    "any_record",
    "block_lists",
    "cache_configs",
    "req_ids",
]

req_ids = st.text(alphabet="abcdefghij0123456789-", min_size=1, max_size=12)


def block_lists(max_block: int = 1 << 20, max_size: int = 64) -> st.SearchStrategy[list[int]]:
    """Distinct non-negative block ids."""
    return st.lists(st.integers(0, max_block), max_size=max_size, unique=True)


@st.composite
def cache_configs(draw: st.DrawFn, max_gpu_blocks: int = 4096) -> CacheConfigured:
    """Valid cache configurations, small enough for fast tests."""
    pads = draw(
        st.lists(st.integers(1, 512), min_size=1, max_size=7, unique=True).map(sorted)
    )
    return CacheConfigured(
        num_gpu_blocks=draw(st.integers(2, max_gpu_blocks)),
        block_size=draw(st.sampled_from([1, 16, 128])),
        num_cpu_blocks=draw(st.integers(0, 1024)),
        block_size_factor=draw(st.integers(1, 8)),
        prefix_caching=draw(st.booleans()),
        defrag=draw(st.booleans()),
        threshold=draw(st.integers(0, 64)),
        max_swaps=draw(st.integers(1, pads[-1])),
        pad_sizes=tuple(pads),
        page_size_bytes=draw(st.integers(0, 1 << 20)),
    )


_ids = st.integers(0, 2**63 - 1)

any_event: st.SearchStrategy[Event] = st.one_of(
    cache_configs(),
    st.builds(BlocksAllocated, req_id=req_ids, block_ids=block_lists()),
    st.builds(RequestFinished, req_id=req_ids),
    st.builds(RequestPreempted, req_id=req_ids),
    st.builds(StepEnded, step=_ids),
    st.builds(StoreRequested, job_id=_ids, gpu_block_ids=block_lists(), cpu_block_ids=block_lists()),
    st.builds(LoadRequested, job_id=_ids, cpu_block_ids=block_lists(), gpu_block_ids=block_lists()),
    st.builds(TransferFinished, job_id=_ids, success=st.booleans()),
)
"""Any single event, each well-formed on its own (not necessarily valid for a state)."""

any_record: st.SearchStrategy[Record] = st.one_of(
    any_event,
    st.builds(
        Checkpoint,
        seq=st.integers(0, 2**40),
        digest=st.text(alphabet="0123456789abcdef", min_size=64, max_size=64),
        step=st.integers(-1, 2**40),
        snapshot=st.binary(max_size=64),
    ),
)
"""Any record the log may hold."""

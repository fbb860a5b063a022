"""The reducers' two code paths agree: Python-int loops over ``array.array`` buffers (events
of up to ``SCALAR_LIMIT`` blocks, the common case) and compiled loops (larger events).

Hypothesis programs use small pools, so most events take the loop path; here the limit is
forced to 0 (every update compiled) and the programs must still match the seed pair for
pair, and the loop and compiled bitmap updates must leave identical bitmaps.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kvlog.events import Event
from kvlog.reducers import blockset, defrag, kernels, state
from kvlog.reducers.blockset import BlockSet
from tests.properties.test_reducers_against_the_seed import run_both
from tests.support.strategies import reducer_programs


@contextmanager
def scalar_limit(limit: int) -> Iterator[None]:
    """Every module that reads ``SCALAR_LIMIT`` sees ``limit`` inside the block."""
    modules = (blockset, defrag, state)
    saved = [module.SCALAR_LIMIT for module in modules]
    for module in modules:
        module.SCALAR_LIMIT = limit  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for module, value in zip(modules, saved, strict=True):
            module.SCALAR_LIMIT = value  # type: ignore[attr-defined]


@given(reducer_programs())
def test_vectorized_updates_equal_the_seed(events: list[Event]) -> None:
    with scalar_limit(0):
        run_both(events)


@given(reducer_programs(max_gpu_blocks=600, max_events=60))
def test_loop_updates_of_any_size_equal_the_seed(events: list[Event]) -> None:
    with scalar_limit(1 << 30):
        run_both(events)


@given(
    st.integers(1, 3000),
    st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, 2999), max_size=400)), max_size=12),
)
def test_blockset_loop_and_compiled_updates_agree(
    size: int, ops: list[tuple[bool, list[int]]]
) -> None:
    """The bitmap updates of the Python loops (``BlockSet.add_ids`` / ``remove_ids``) and of
    the compiled reference counting (``kernels.add_refs`` / ``drop_refs``) agree."""
    looped, compiled = BlockSet(size), BlockSet(size)
    refs = np.zeros(size, dtype=np.int32)
    identity = np.arange(size, dtype=np.int32)
    bitmaps = (compiled.words, compiled.nonempty, compiled.notfull)
    model: set[int] = set()
    for add, raw in ops:
        ids = sorted({b % size for b in raw})
        change = [b for b in ids if (b in model) != add]
        array = np.asarray(change, dtype=np.int64)
        if add:
            fresh, _ = kernels.add_refs(*bitmaps, refs, array)
            compiled.count += fresh
        else:
            freed = np.empty(len(change), dtype=np.int64)
            compiled.count -= kernels.drop_refs(*bitmaps, refs, identity, array, freed)
        (looped.add_ids if add else looped.remove_ids)(change)
        model = model | set(change) if add else model - set(change)
        for blocks in (looped, compiled):
            assert blocks.count == len(model)
            assert np.array_equal(blocks.words, BlockSet.from_mask(_mask(model, size)).words)
        assert np.array_equal(looped.nonempty, compiled.nonempty)
        assert np.array_equal(looped.notfull, compiled.notfull)
        assert looped.highest_at_most(size - 1) == max(model, default=-1)


def _mask(members: set[int], size: int) -> np.ndarray:
    mask = np.zeros(size, dtype=bool)
    mask[list(members)] = True
    return mask

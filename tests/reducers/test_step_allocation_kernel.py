"""``kernels.step_allocation``: the whole step's check in one compiled pass. Its verdict
against a plain model (0: all in range, free, unpinned, distinct; 2: an id out of range;
else 1), and the pool's ref counts exactly as they were after it (it marks the blocks it
takes in ``refs`` to find a repeat, and clears the marks)."""

from __future__ import annotations

import numpy as np
from hypothesis import example, given
from hypothesis import strategies as st

from kvlog.reducers import kernels


def _model(fwd: list[int], busy: list[bool], logical: list[int]) -> int:
    if any(not 0 <= b < len(fwd) for b in logical):
        return 2
    physical = [fwd[b] for b in logical]
    if any(busy[p] for p in physical) or len(set(physical)) != len(physical):
        return 1
    return 0


@st.composite
def _pools(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[int]]:
    size = draw(st.integers(1, 40))
    fwd = np.array(draw(st.permutations(range(size))), dtype=np.int32)
    counts = st.lists(st.sampled_from([0, 0, 0, 1, 2]), min_size=size, max_size=size)
    refs, stores, loads = (np.array(draw(counts), dtype=np.int32) for _ in range(3))
    logical = draw(st.lists(st.integers(-2, size + 1), max_size=2 * size))
    return fwd, refs, stores, loads, logical


@given(_pools())
@example((np.arange(4, dtype=np.int32), *(np.zeros(4, dtype=np.int32),) * 3, [1, 2, 1]))
@example((np.arange(4, dtype=np.int32), *(np.zeros(4, dtype=np.int32),) * 3, [3, 0, 2]))
def test_the_verdict_is_the_models_and_refs_are_left_as_they_were(
    pool: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[int]],
) -> None:
    fwd, refs, stores, loads, logical = pool
    before = refs.copy()
    busy = ((refs > 0) | (stores > 0) | (loads > 0)).tolist()
    ids = np.array(logical, dtype=np.int64)
    physical = np.full(ids.size, -1, dtype=np.int64)
    status = kernels.step_allocation(fwd, refs, stores, loads, ids, physical)
    assert status == _model(fwd.tolist(), busy, logical)
    assert np.array_equal(refs, before)
    if status == 0:
        assert np.array_equal(physical, fwd[ids])

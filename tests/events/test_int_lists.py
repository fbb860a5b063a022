"""``int_lists``: lists of ints as one int64 array, read back out of msgspec's encoding;
None for anything else, so that the caller's exact path names it."""

from __future__ import annotations

import enum
import itertools

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kvlog.events.int_lists import int_lists

INT64 = st.integers(-(2**63), 2**63 - 1)
EDGES = [0, 1, 127, 128, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1, 2**32]
EDGES += [2**63 - 1, -1, -32, -33, -128, -129, -32768, -32769, -(2**31), -(2**31) - 1]
EDGES += [-(2**63)]


def _model(lists: list[list[object]], count: int) -> list[int] | None:
    """The plain answer: every item an exact int (or an IntEnum) of int64's range, in
    lists, ``count`` of them."""
    if not all(type(items) in (list, tuple) for items in lists):
        return None
    flat: list[object] = [b for items in lists for b in items]
    if len(flat) != count:
        return None
    ints = [b for b in flat if isinstance(b, int) and type(b) is not bool]
    if len(ints) != len(flat) or not all(-(2**63) <= b < 2**63 for b in ints):
        return None
    return [int(b) for b in ints]


def test_every_width_of_msgpack_int_reads_back_exactly() -> None:
    out = int_lists([EDGES, [], EDGES[::-1], (5, 6)], 2 * len(EDGES) + 2)
    assert out is not None and out.dtype == np.int64
    assert out.tolist() == EDGES + EDGES[::-1] + [5, 6]


@given(st.lists(st.lists(INT64 | st.sampled_from(EDGES), max_size=40), max_size=30))
def test_lists_of_ints_are_their_concatenation(lists: list[list[int]]) -> None:
    count = sum(map(len, lists))
    out = int_lists(lists, count)
    assert out is not None and out.tolist() == list(itertools.chain.from_iterable(lists))


class _Level(enum.IntEnum):
    HIGH = 7


_NOT_INT64 = st.sampled_from(
    [True, False, 1.0, "1", None, b"1", 2**63, 2**64, -(2**63) - 1, np.int64(3), [1], {1: 2}]
)


@given(
    st.lists(st.lists(INT64 | _NOT_INT64 | st.just(_Level.HIGH), max_size=8), max_size=8),
    st.integers(-2, 2),
)
def test_anything_but_ints_of_int64_is_none(lists: list[list[object]], off: int) -> None:
    """Bools, floats, strs, numpy integers, ints past int64, nested containers, and a
    count that is not the items' all answer None; an IntEnum member is its value."""
    count = max(0, sum(map(len, lists)) + off)
    out = int_lists(lists, count)
    expected = _model(lists, count)
    assert (None if out is None else out.tolist()) == expected


def test_not_lists_of_items_is_none() -> None:
    assert int_lists([1, 2], 2) is None
    assert int_lists([[1], 2], 2) is None
    assert int_lists([[[1]]], 1) is None
    assert int_lists([[1]] * 70_000, 70_000) is not None  # an outer array32 header
    assert int_lists([list(range(70_000))], 70_000) is not None  # an inner array32

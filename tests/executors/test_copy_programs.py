"""Copy programs: exact runs and segments, and random pairs against plain numpy copies."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvlog.executors import copies
from kvlog.executors.copies import (
    build_device_transfer_program,
    build_host_program,
    find_runs,
)

ROWS, PAGE = 40, 6


def _rows(seed: int, rows: int = ROWS) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-128, 128, (rows, PAGE), generator=generator, dtype=torch.int8)


def test_runs_forward_reversed_and_single() -> None:
    src = np.array([10, 11, 12, 7, 6, 5, 20, 30])
    dst = np.array([0, 1, 2, 3, 4, 5, 9, 10])
    starts, directions = find_runs(src, dst)
    assert starts.tolist() == [0, 3, 6, 7]
    assert directions.tolist() == [1, -1, 1, 1]


def test_defrag_pairs_become_one_reversed_segment() -> None:
    program = build_host_program(np.array([19, 18, 17]), np.array([1, 2, 3]))
    assert program.segments == ((1, 4, 17, 20, -1),)


def test_consecutive_pairs_become_one_slice_and_scattered_ones_single_rows() -> None:
    program = build_host_program(np.arange(5, 13), np.arange(0, 8))
    assert program.segments == ((0, 8, 5, 13, 1),)
    scattered = build_host_program(np.array([9, 2, 30, 4]), np.array([3, 0, 1, 2]))
    assert scattered.segments == (
        (0, 1, 2, 3, 1),
        (1, 2, 30, 31, 1),
        (2, 3, 4, 5, 1),
        (3, 4, 9, 10, 1),
    )


def test_segments_respect_max_rows() -> None:
    program = build_host_program(np.arange(20, 10, -1), np.arange(0, 10), max_rows=4)
    assert list(program.segments) == [
        (0, 4, 17, 21, -1),
        (4, 8, 13, 17, -1),
        (8, 10, 11, 13, -1),
    ]


@st.composite
def disjoint_pairs(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray]:
    """Pairs over one tensor: distinct sources, distinct destinations, the two disjoint."""
    blocks = draw(st.permutations(range(ROWS)))
    count = draw(st.integers(0, ROWS // 2))
    src, dst = list(blocks[:count]), list(blocks[count : 2 * count])
    if draw(st.booleans()):
        src, dst = sorted(src, reverse=True), sorted(dst)
    return np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64)


@given(pairs=disjoint_pairs(), max_rows=st.integers(1, 8))
def test_in_place_move_and_exchange_match_numpy(
    pairs: tuple[np.ndarray, np.ndarray], max_rows: int
) -> None:
    src, dst = pairs
    moved, swapped = _rows(1), _rows(1)
    expected_move, expected_swap = moved.numpy().copy(), swapped.numpy().copy()
    expected_move[dst] = expected_move[src]
    expected_swap[dst], expected_swap[src] = expected_swap[src], expected_swap[dst].copy()
    build_host_program(src, dst).copy(moved, moved)
    program = build_host_program(src, dst, max_rows=max_rows)
    program.exchange(swapped, torch.empty(max_rows, PAGE, dtype=torch.int8))
    assert np.array_equal(moved.numpy(), expected_move)
    assert np.array_equal(swapped.numpy(), expected_swap)


@st.composite
def transfer_pairs(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray]:
    """Pairs between two tensors: any sources (repeats allowed), distinct destinations."""
    count = draw(st.integers(0, ROWS))
    dst = draw(st.permutations(range(ROWS)))[:count]
    if draw(st.booleans()):
        dst = sorted(dst)
    src = draw(st.lists(st.integers(0, ROWS - 1), min_size=count, max_size=count))
    if draw(st.booleans()):
        src = sorted(src)
    return np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64)


@given(pairs=transfer_pairs())
def test_host_transfer_programs_match_numpy(pairs: tuple[np.ndarray, np.ndarray]) -> None:
    src, dst = pairs
    source, target = _rows(2), _rows(3)
    expected = target.numpy().copy()
    expected[dst] = source.numpy()[src]
    build_host_program(src, dst).copy(target, source)
    assert np.array_equal(target.numpy(), expected)


@given(pairs=transfer_pairs())
def test_small_device_programs_equal_the_numpy_built_ones(
    pairs: tuple[np.ndarray, np.ndarray],
) -> None:
    """Jobs of at most ``INDEXED_MAX_PAIRS`` pairs are compiled on Python ints: the same
    runs and device index as the numpy build (forced here with a threshold of 0)."""
    device_ids, host_ids = pairs
    small = build_device_transfer_program(host_ids, device_ids, torch.device("cpu"))
    threshold = copies.INDEXED_MAX_PAIRS
    copies.INDEXED_MAX_PAIRS = 0
    try:
        reference = build_device_transfer_program(host_ids, device_ids, torch.device("cpu"))
    finally:
        copies.INDEXED_MAX_PAIRS = threshold
    assert small.runs == reference.runs
    if reference.device_index is None:
        assert small.device_index is None
    else:
        assert small.device_index is not None
        assert torch.equal(small.device_index, reference.device_index)


@pytest.mark.parametrize("threshold", [copies.INDEXED_MAX_PAIRS, 0])
@given(pairs=transfer_pairs())
def test_device_transfer_programs_match_numpy(
    threshold: int, pairs: tuple[np.ndarray, np.ndarray]
) -> None:
    saved, copies.INDEXED_MAX_PAIRS = copies.INDEXED_MAX_PAIRS, threshold
    try:
        _device_transfer_matches_numpy(pairs)
    finally:
        copies.INDEXED_MAX_PAIRS = saved


def _device_transfer_matches_numpy(pairs: tuple[np.ndarray, np.ndarray]) -> None:
    device_ids, host_ids = pairs  # store: device rows (repeats allowed) into distinct host rows
    device, host = _rows(4), _rows(5)
    expected = host.numpy().copy()
    expected[host_ids] = device.numpy()[device_ids]
    build_device_transfer_program(host_ids, device_ids, torch.device("cpu")).store(host, device)
    assert np.array_equal(host.numpy(), expected)
    host_ids, device_ids = pairs  # load: host rows into distinct device rows
    expected_device = device.numpy().copy()
    expected_device[device_ids] = host.numpy()[host_ids]
    build_device_transfer_program(host_ids, device_ids, torch.device("cpu")).load(host, device)
    assert np.array_equal(device.numpy(), expected_device)


def test_long_runs_take_the_threaded_torch_copy_and_land_exactly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(copies, "TORCH_COPY_BYTES", 4 << 20)
    page = 1 << 20  # 6 rows of 1 MiB: above TORCH_COPY_BYTES, so torch copy_ runs it
    generator = torch.Generator().manual_seed(9)
    source = torch.randint(-128, 128, (10, page), generator=generator, dtype=torch.int8)
    target = torch.zeros(10, page, dtype=torch.int8)
    src, dst = np.array([0, 1, 2, 3, 4, 5, 9]), np.array([4, 5, 6, 7, 8, 9, 0])
    build_host_program(src, dst).copy(target, source)
    assert torch.equal(target[4:10], source[0:6]) and torch.equal(target[0], source[9])
    assert not target[1:4].any()


@given(pairs=disjoint_pairs(), max_rows=st.integers(1, 24))
def test_indexed_copy_and_exchange_match_numpy_within_and_beyond_max_rows(
    pairs: tuple[np.ndarray, np.ndarray], max_rows: int
) -> None:
    """The indexed paths (a job's few rows: one gather and scatter when they fit in
    ``max_rows``, bounded chunks beyond) move exactly what plain numpy moves."""
    src, dst = pairs
    source, target, swapped = _rows(2).numpy(), _rows(3).numpy(), _rows(4).numpy()
    expected_copy, expected_swap = target.copy(), swapped.copy()
    expected_copy[dst] = source[src]
    expected_swap[dst], expected_swap[src] = expected_swap[src], expected_swap[dst].copy()
    copies.indexed_copy(target, source, dst, src, max_rows)
    copies.indexed_exchange(swapped, src, dst, max_rows)
    assert np.array_equal(target, expected_copy)
    assert np.array_equal(swapped, expected_swap)


@given(pairs=disjoint_pairs(), max_rows=st.integers(1, 24), views=st.integers(1, 4))
def test_indexed_exchange_all_swaps_the_same_rows_of_every_view(
    pairs: tuple[np.ndarray, np.ndarray], max_rows: int, views: int
) -> None:
    """A plan's swap over a model's views (its index arrays built once) is the one-view
    exchange on each view."""
    src, dst = pairs
    tensors = [_rows(5 + v).numpy() for v in range(views)]
    expected = [t.copy() for t in tensors]
    for t in expected:
        copies.indexed_exchange(t, src, dst, max_rows)
    copies.indexed_exchange_all(tensors, src, dst, max_rows)
    assert all(np.array_equal(t, e) for t, e in zip(tensors, expected, strict=True))
    if src.size:  # the rows did move (random pages: two equal rows are out of reach)
        assert not np.array_equal(tensors[0], _rows(5).numpy())

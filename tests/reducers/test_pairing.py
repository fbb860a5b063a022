"""The defrag pairing walk (kvlog/reducers/pairing.py) against a brute-force statement of the
rule, on dense pools built from runs of blocks: whole-run takes, partial runs at a cap, word
boundaries, both cursors meeting inside one word, pinned blocks on both sides, the last
word's unused bits; and the move that follows keeps the bitmaps and summaries exact.

The pools come from events (allocations of runs, stores pinning used blocks, loads pinning
free ones), so the bitmaps are the ones the reducers keep; the expected pairs are computed
from the ref and pin counts alone, the way the seed does it.
"""

from __future__ import annotations

import itertools
import subprocess
import sys

import numba
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kvlog.events import (
    BlocksAllocated,
    CacheConfigured,
    Event,
    LoadRequested,
    StepEnded,
    StoreRequested,
    SwapPlan,
)
from kvlog.reducers import State, check_invariants, initial_state, kernels, reduce
from kvlog.reducers.pairing import walk


def expected_pairs(state: State) -> list[tuple[int, int]]:
    """The rule from counts alone: used unpinned from the top into free unpinned from 1."""
    config = state.config
    assert config is not None
    refs = state.refs.tolist()
    pins = (state.store_pins | state.load_pins).tolist()
    used = [b for b, r in enumerate(refs) if r > 0]
    if not used or used[-1] - config.threshold <= len(used):
        return []
    sources = [b for b in reversed(used) if not pins[b]]
    free = (b for b in itertools.count(1) if b >= len(refs) or not (refs[b] or pins[b]))
    pairs: list[tuple[int, int]] = []
    for src, dst in zip(sources, free, strict=False):
        if len(pairs) == config.max_swaps or dst > src:
            break
        pairs.append((src, dst))
    return pairs


@st.composite
def pools(draw: st.DrawFn) -> tuple[CacheConfigured, list[Event]]:
    """A config and events that leave runs of used blocks, some pinned by stores, and some
    free blocks pinned by loads."""
    num_gpu_blocks = draw(st.integers(1, 700))
    config = CacheConfigured(
        num_gpu_blocks=num_gpu_blocks,
        block_size=16,
        num_cpu_blocks=64,
        threshold=draw(st.integers(0, 4)),
        max_swaps=draw(st.sampled_from([1, 3, 17, 64, 300, 512])),
    )
    used = [False] * num_gpu_blocks
    events: list[Event] = [config]
    lengths = draw(st.lists(st.integers(1, 150), max_size=12))
    starts = draw(st.lists(st.integers(0, num_gpu_blocks - 1), min_size=len(lengths)))
    for i, (start, length) in enumerate(zip(starts, lengths, strict=False)):
        run = [b for b in range(start, min(start + length, num_gpu_blocks)) if not used[b]]
        for b in run:
            used[b] = True
        if run:
            events.append(BlocksAllocated(req_id=f"r{i}", block_ids=run))
    held = [b for b in range(num_gpu_blocks) if used[b]]
    free = [b for b in range(num_gpu_blocks) if not used[b]]
    stored = draw(st.lists(st.sampled_from(held), max_size=6, unique=True)) if held else []
    loaded = draw(st.lists(st.sampled_from(free), max_size=6, unique=True)) if free else []
    for job_id, b in enumerate(stored):
        events.append(StoreRequested(job_id=job_id, gpu_block_ids=[b], cpu_block_ids=[job_id]))
    for job_id, b in enumerate(loaded, start=len(stored)):
        events.append(LoadRequested(job_id=job_id, gpu_block_ids=[b], cpu_block_ids=[job_id]))
    return config, events


@given(pools())
def test_walk_pairs_like_the_rule_and_the_move_keeps_the_bitmaps(
    pool: tuple[CacheConfigured, list[Event]],
) -> None:
    _, events = pool
    state = initial_state()
    for event in events:
        reduce(state, event)
    expected = expected_pairs(state)
    sources, destinations = walk(state)
    assert list(zip(sources.tolist(), destinations.tolist(), strict=True)) == expected
    _, plans = reduce(state, StepEnded(step=0))
    if expected:
        assert isinstance(plans[0], SwapPlan) and plans[0].pairs == expected
    else:
        assert plans == []
    check_invariants(state)


def test_cursors_meeting_inside_one_word() -> None:
    """Used 0..9 and 20..29 in word 0, free 10..19: the walk pairs inside the word and stops
    where the free block passes the used one."""
    config = CacheConfigured(num_gpu_blocks=64, block_size=16, threshold=0)
    state, _ = reduce(initial_state(), config)
    reduce(state, BlocksAllocated(req_id="a", block_ids=list(range(10))))
    reduce(state, BlocksAllocated(req_id="b", block_ids=list(range(20, 30))))
    pairs = [(29, 10), (28, 11), (27, 12), (26, 13), (25, 14), (24, 15), (23, 16), (22, 17)]
    pairs += [(21, 18), (20, 19)]
    sources, destinations = walk(state)
    assert (sources.tolist(), destinations.tolist()) == (
        [s for s, _ in pairs],
        [d for _, d in pairs],
    )
    _, plans = reduce(state, StepEnded(step=0))
    assert isinstance(plans[0], SwapPlan) and plans[0].pairs == pairs
    assert state.max_used == 19 and state.num_used == 20
    check_invariants(state)


def test_a_cap_inside_a_run_takes_its_top_and_bottom() -> None:
    """Used 100..199 in a pool of 256, free 1..99: a cap of 17 takes 199..183 into 1..17."""
    config = CacheConfigured(num_gpu_blocks=256, block_size=16, threshold=0, max_swaps=17)
    state, _ = reduce(initial_state(), config)
    reduce(state, BlocksAllocated(req_id="a", block_ids=list(range(100, 200))))
    _, plans = reduce(state, StepEnded(step=0))
    assert isinstance(plans[0], SwapPlan)
    assert plans[0].pairs == list(zip(range(199, 182, -1), range(1, 18), strict=True))
    assert state.max_used == 182
    check_invariants(state)


@given(pools())
def test_the_compiled_walk_and_move_equal_their_python_source(
    pool: tuple[CacheConfigured, list[Event]],
) -> None:
    """numba compiles ``kernels.py``; its source, run as Python, must decide the same (a
    guard against numba's integer typing changing a bit operation)."""
    _, events = pool
    compiled, interpreted = initial_state(), initial_state()
    for event in events:
        reduce(compiled, event)
        reduce(interpreted, event)
    config = compiled.config
    assert config is not None
    arrays = (compiled.used.words, compiled.used.nonempty, compiled.used.notfull)
    pair_arrays = [np.zeros(config.max_swaps, dtype=np.int64) for _ in range(4)]
    args = (*arrays, compiled.pinned, max(compiled.max_used, 0), config.max_swaps)
    count = kernels.seed_walk(*args, *pair_arrays[:2])
    assert kernels._seed_walk(*args, *pair_arrays[2:]) == count
    assert np.array_equal(pair_arrays[0][:count], pair_arrays[2][:count])
    assert np.array_equal(pair_arrays[1][:count], pair_arrays[3][:count])
    sources, destinations = pair_arrays[0][:count], pair_arrays[1][:count]
    results = []
    for state, move in ((compiled, kernels.move), (interpreted, kernels._move)):
        used = state.used
        arrays = (used.words, used.nonempty, used.notfull, state.refs, state.fwd, state.bwd)
        with np.errstate(over="ignore"):  # the interpreted uint64 sums wrap, as meant
            delta, max_used = move(*arrays, sources, destinations, compiled.max_used)
        results.append((int(delta), int(max_used)))
    assert results[0] == results[1]
    assert results[0][1] == max(
        (b for b in range(config.num_gpu_blocks) if compiled.refs[b]), default=-1
    )
    for name in ("words", "nonempty", "notfull"):
        assert np.array_equal(getattr(compiled.used, name), getattr(interpreted.used, name))
    for name in ("refs", "fwd", "bwd"):
        assert np.array_equal(getattr(compiled, name), getattr(interpreted, name))


def test_the_kernels_compile_where_numba_cannot_cache() -> None:
    """A read-only install with no writable cache directory: numba refuses ``cache=True``
    with a RuntimeError; kvlog must still import and run (compiling in the process)."""
    script = (
        "import numba.core.caching as caching\n"
        "impl = getattr(caching, 'CacheImpl', None) or caching._CacheImpl\n"
        "impl._locator_classes = []\n"
        "from kvlog.reducers import kernels\n"
        "kernels.load()\n"
        "assert kernels.move._cache.__class__.__name__ == 'NullCache'\n"
        "print('compiled')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "compiled"


def test_no_kernel_releases_the_gil() -> None:
    """A kernel runs for microseconds; releasing the GIL would let another thread of the
    serving process take it for a whole switch interval (measured: a 0.5 us call became
    15 us on average and 7.5 ms at worst beside one busy thread)."""
    dispatchers = [
        value
        for value in vars(kernels).values()
        if isinstance(value, numba.core.dispatcher.Dispatcher)
    ]
    assert len(dispatchers) >= 7
    for dispatcher in dispatchers:
        assert not dispatcher.targetoptions.get("nogil"), dispatcher.py_func.__name__

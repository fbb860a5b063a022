"""Property tests for the reducers: invariants, refusals, snapshots, digests, bitmaps.

- ``check_invariants`` holds after every event of random realistic programs.
- Every refused event (planted defects of each kind) raises a typed ``InvalidEvent``,
  ``check`` agrees with ``reduce``, and the digest and snapshot do not move.
- ``snapshot``/``restore`` at any point gives the same digest and the same future plans.
- The digest is a pinned value for a fixed program and does not depend on the process.
- ``BlockSet`` behaves like a Python set; ``resolve_array`` like ``resolve``.
- ``check_invariants`` notices corruption (it can fail).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import msgspec
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvlog import errors
from kvlog.events import (
    BlocksAllocated,
    CacheConfigured,
    Event,
    LoadRequested,
    RequestFinished,
    StepEnded,
    StoreRequested,
    TransferFinished,
    TransferPlan,
    TransferSubmitted,
)
from kvlog.reducers import (
    State,
    check,
    check_invariants,
    digest,
    initial_state,
    reduce,
    restore,
    snapshot,
)
from kvlog.reducers.blockset import BlockSet, pack_words
from tests.support.strategies import random_program, reducer_programs


def apply_all(events: list[Event]) -> tuple[State, list[object]]:
    state, plans = initial_state(), []
    for event in events:
        state, new = reduce(state, event)
        plans.extend(new)
    return state, plans


def planted_defects(state: State, rng: random.Random) -> list[tuple[Event, type[Exception]]]:
    """Events that this state must refuse, each with the error class it must raise."""
    config = state.config
    assert config is not None
    n, last = config.num_gpu_blocks, state.last_job_id
    out: list[tuple[Event, type[Exception]]] = [
        (BlocksAllocated(req_id="bad", block_ids=[n + rng.randrange(3)]), errors.BlockOutOfRange),
        (BlocksAllocated(req_id="bad", block_ids=[1, 1]), errors.DuplicateBlock),
        (TransferFinished(job_id=last + 1 + rng.randrange(3), success=True), errors.UnknownJob),
        (config, errors.AlreadyConfigured),
        (
            StoreRequested(job_id=last + 1, gpu_block_ids=[n], cpu_block_ids=[0]),
            errors.BlockOutOfRange,
        ),
        (
            LoadRequested(
                job_id=last + 1, cpu_block_ids=[config.num_cpu_blocks], gpu_block_ids=[0]
            ),
            errors.BlockOutOfRange,
        ),
    ]
    if last >= 0:
        store = StoreRequested(job_id=rng.randint(0, last), gpu_block_ids=[0], cpu_block_ids=[0])
        out.append((store, errors.DuplicateJob))
    held = [b for r in state.live_requests() for b in state.request_blocks(r)]
    if held and not config.prefix_caching:
        taken = BlocksAllocated(req_id="bad", block_ids=[rng.choice(held)])
        out.append((taken, errors.BlockInUse))
    if config.block_size_factor > 1 and config.num_cpu_blocks:
        bad_size = StoreRequested(job_id=last + 1, gpu_block_ids=[1], cpu_block_ids=[0])
        out.append((bad_size, errors.TransferSizeMismatch))
    if config.num_cpu_blocks > 1 and config.block_size_factor > 1 and n > 2:
        # one group of 2 GPU blocks from block index 0 fills one CPU block, not two
        too_many = LoadRequested(
            job_id=last + 1,
            cpu_block_ids=[0, 1],
            gpu_block_ids=[1, 2],
            group_sizes=(2,),
            block_indices=(0,),
        )
        out.append((too_many, errors.TransferSizeMismatch))
    if n > 2:  # group sizes that do not add up to the GPU blocks
        bad_sum = StoreRequested(
            job_id=last + 1,
            gpu_block_ids=[1, 2],
            cpu_block_ids=[0],
            group_sizes=(1, 2),
            block_indices=(0, 0),
        )
        out.append((bad_sum, errors.InvalidEvent))
    out.extend(_new_rule_defects(state, rng))
    return out


def _new_rule_defects(state: State, rng: random.Random) -> list[tuple[Event, type[Exception]]]:
    """Refusals of the rules of deferred jobs and of the two transfer directions."""
    config = state.config
    assert config is not None
    f, last = config.block_size_factor, state.last_job_id
    out: list[tuple[Event, type[Exception]]] = [
        (TransferSubmitted(job_id=last + 1 + rng.randrange(3)), errors.UnknownJob)
    ]
    waiting = [j for j, job in {**state.store_jobs, **state.load_jobs}.items() if not job.submitted]
    if waiting:
        out.append((TransferFinished(job_id=rng.choice(waiting), success=True), errors.UnknownJob))
    if state.load_jobs:
        load = state.load_jobs[rng.choice(sorted(state.load_jobs))]
        block = state.unresolve(int(rng.choice(load.gpu_block_ids.tolist())))
        out.append((BlocksAllocated(req_id="bad", block_ids=[block]), errors.BlockInUse))
        assert load.pairs is not None
        sub = int(rng.choice(load.pairs[0].tolist()))
        loading = state.load_pins > 0
        readable = [state.unresolve(p) for p in range(state.num_gpu_blocks) if not loading[p]]
        if len(readable) >= f:
            store = StoreRequested(
                job_id=last + 1, gpu_block_ids=readable[:f], cpu_block_ids=[sub // f]
            )
            out.append((store, errors.BlockInUse))
    if state.store_jobs:
        store_job = state.store_jobs[rng.choice(sorted(state.store_jobs))]
        assert store_job.pairs is not None
        sub = int(rng.choice(store_job.pairs[1].tolist()))
        free = [state.unresolve(p) for p in range(state.num_gpu_blocks) if not state.is_pinned(p)]
        if len(free) >= f:
            load_event = LoadRequested(
                job_id=last + 1, cpu_block_ids=[sub // f], gpu_block_ids=free[:f]
            )
            out.append((load_event, errors.BlockInUse))
    return out


@given(reducer_programs(), st.randoms(use_true_random=False))
def test_invariants_hold_and_refusals_change_nothing(
    events: list[Event], rng: random.Random
) -> None:
    state = initial_state()
    with pytest.raises(errors.NotConfigured):
        check(state, events[-1] if len(events) > 1 else BlocksAllocated("a", [1]))
    for i, event in enumerate(events):
        check(state, event)  # a valid event passes the check
        state, _ = reduce(state, event)
        check_invariants(state)
        if i % 7 == 0:
            before, blob = digest(state), snapshot(state)
            for bad, error in planted_defects(state, rng):
                with pytest.raises(error) as raised:
                    check(state, bad)
                assert isinstance(raised.value, errors.InvalidEvent)
                with pytest.raises(error):
                    reduce(state, bad)
                assert digest(state) == before and snapshot(state) == blob
            check_invariants(state)


@given(reducer_programs(), st.data())
def test_restore_gives_the_same_digest_and_the_same_future(
    events: list[Event], data: st.DataObject
) -> None:
    cut = data.draw(st.integers(1, len(events)))
    state, _ = apply_all(events[:cut])
    copy = restore(snapshot(state))
    assert digest(copy) == digest(state)
    assert snapshot(copy) == snapshot(state)
    check_invariants(copy)
    for event in events[cut:]:
        _, ours = reduce(state, event)
        _, theirs = reduce(copy, event)
        assert ours == theirs
    assert digest(copy) == digest(state)


def test_restore_refuses_bytes_that_are_not_a_snapshot() -> None:
    state, _ = apply_all(random_program(random.Random(3), CONFIG, 200))
    blob = bytearray(snapshot(state))
    with pytest.raises(errors.CorruptLogError):
        restore(b"not a snapshot")
    with pytest.raises(errors.CorruptLogError):
        restore(bytes(blob[: len(blob) // 2]))


CONFIG = CacheConfigured(
    num_gpu_blocks=96,
    block_size=16,
    num_cpu_blocks=16,
    block_size_factor=2,
    prefix_caching=True,
    threshold=2,
    max_swaps=8,
    pad_sizes=(2, 8),
    page_size_bytes=256,
)
PINNED_DIGEST = "c1d248e714f623b0c416e2cd1129b9ec7afb8b23b4373d314d2719f7cb8fa439"
"""A change here is a format change, or a change of ``random_program`` (re-recorded when
it learned deferred jobs, chunks, reuse of store-read blocks and CPU conflicts)."""
PINNED_DIGEST_GROWN = "5d2a4c49436769ed15e6a205f0664a7b710fb876d81d3ed3b5fba71321305a8d"
"""The digest after ``GROWN_PROGRAM`` (written out, so no generator change moves it)."""


def _fixed_digest() -> str:
    state, _ = apply_all(random_program(random.Random(7), CONFIG, 400))
    return digest(state)


def test_digest_is_pinned_for_a_fixed_program() -> None:
    assert _fixed_digest() == PINNED_DIGEST


GROWN_PROGRAM: list[Event] = [
    msgspec.structs.replace(CONFIG, quarantine_released=True, prefix_caching=False),
    BlocksAllocated(req_id="A", block_ids=[1, 2, 3, 4, 5, 6]),
    BlocksAllocated(req_id="B", block_ids=[20, 21, 22]),
    StepEnded(step=0),
    StoreRequested(job_id=0, gpu_block_ids=[1, 2], cpu_block_ids=[0]),
    StoreRequested(job_id=1, gpu_block_ids=[3, 4], cpu_block_ids=[1], deferred=True),
    LoadRequested(
        job_id=2,
        cpu_block_ids=[2, 3],
        gpu_block_ids=[30, 31, 32],
        group_sizes=(1, 2),
        block_indices=(3, 4),
    ),
    RequestFinished(req_id="A"),
]
"""A state holding what schema 1 did not know: a non-default config field
(``quarantine_released``), quarantined blocks, a deferred job not yet submitted, and a job
whose CPU sub-blocks follow vLLM's chunk rule (5, 6, 7, not the seed's)."""


def test_digest_is_pinned_for_a_state_with_the_grown_fields() -> None:
    state, plans = apply_all(GROWN_PROGRAM)
    assert state.quarantined == {1, 2, 3, 4, 5, 6}
    job = state.job(1)
    assert job is not None and not job.submitted
    assert plans[-1] == TransferPlan(2, "load", [(5, 30), (6, 31), (7, 32)], 3 * 256, -1)
    assert digest(state) == PINNED_DIGEST_GROWN


def test_digest_does_not_depend_on_the_process() -> None:
    code = (
        "from tests.properties.test_reducer_invariants import _fixed_digest; print(_fixed_digest())"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == _fixed_digest()


@given(reducer_programs(), st.lists(st.integers(-3, 200), max_size=40))
def test_resolve_array_matches_resolve(events: list[Event], ids: list[int]) -> None:
    state, _ = apply_all(events)
    array = np.asarray(ids, dtype=np.int64)
    assert state.resolve_array(array).tolist() == [state.resolve(b) for b in ids]
    assert state.resolve_array(array).dtype == array.dtype
    n = state.num_gpu_blocks
    assert all(state.unresolve(state.resolve(b)) == b for b in range(n))


def test_check_invariants_notices_corruption() -> None:
    state, _ = apply_all(random_program(random.Random(5), CONFIG, 300))
    check_invariants(state)
    corruptions = [
        lambda s: s.refs.__setitem__(5, s.refs[5] + 1),
        lambda s: s.fwd.__setitem__(slice(1, 3), s.fwd[[2, 1]]),
        lambda s: s.store_pins.__setitem__(7, s.store_pins[7] + 1),
        lambda s: s.used.words.__setitem__(0, s.used.words[0] ^ np.uint64(2)),
        lambda s: setattr(s, "_max_used", s.max_used + 1),
    ]
    for corrupt in corruptions:
        broken = restore(snapshot(state))
        corrupt(broken)
        with pytest.raises(AssertionError):
            check_invariants(broken)


def _members_descending(blocks: BlockSet, limit: int) -> list[int]:
    """Members ``<= limit``, highest first, by repeated ``highest_at_most``."""
    out = []
    b = blocks.highest_at_most(limit)
    while b >= 0:
        out.append(b)
        b = blocks.highest_at_most(b - 1)
    return out


def _clear_ascending(blocks: BlockSet, start: int) -> list[int]:
    """Non-members ``>= start``, lowest first, through the words ``next_notfull`` finds
    (may include ids at or above ``size`` from the last word's unused bits)."""
    out = []
    w = blocks.next_notfull(start >> 6)
    while w >= 0:
        word = int(blocks.words[w])
        out.extend(64 * w + i for i in range(64) if not word >> i & 1 and 64 * w + i >= start)
        w = blocks.next_notfull(w + 1)
    return out


@given(
    st.integers(1, 5000),
    st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, 4999), max_size=40)), max_size=30),
    st.integers(0, 4999),
)
def test_blockset_behaves_like_a_set(
    size: int, ops: list[tuple[bool, list[int]]], probe: int
) -> None:
    blocks, model = BlockSet(size), set()
    probe %= size
    for add, raw in ops:
        ids = sorted({b % size for b in raw})
        change = [b for b in ids if (b in model) != add]
        if add:
            blocks.add_ids(change)
            model |= set(change)
        else:
            blocks.remove_ids(change)
            model -= set(change)
        assert blocks.count == len(model)
        assert _members_descending(blocks, probe) == sorted(
            (b for b in model if b <= probe), reverse=True
        )
        clear = [b for b in _clear_ascending(blocks, probe) if b < size]
        assert clear == [b for b in range(probe, size) if b not in model]
        assert blocks.highest_at_most(size - 1) == max(model, default=-1)
        assert all(blocks.contains(b) == (b in model) for b in ids)
    mask = np.array([b in model for b in range(size)], dtype=bool)
    assert np.array_equal(pack_words(mask), blocks.words)
    same = BlockSet.from_mask(mask)
    assert same.count == blocks.count
    assert np.array_equal(same.words, blocks.words)
    assert np.array_equal(same.nonempty, blocks.nonempty)
    assert np.array_equal(same.notfull, blocks.notfull)

"""``StepScheduled`` is exactly the fine-grained events it stands for.

A hypothesis property drives two machines over random programs of whole steps (finished,
preempted and resumed requests, allocations that may reuse, share, repeat or overrun
blocks, stores in flight, quarantine, prefix caching on and off): one applies each step as
one ``StepScheduled``, the other as ``reducers.step.expand``'s events, all or nothing.
Acceptance, plans, both digests and the invariants must agree after every step. On the
public trace slices, the synthetic serving loop's fine-grained logs are regrouped into
whole steps and must replay to the same checkpoint digests.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlog import Engine, replay
from kvlog.errors import BlockInUse, DuplicateBlock, InvalidEvent, KvlogError
from kvlog.events import (
    BlocksAllocated,
    CacheConfigured,
    Checkpoint,
    Event,
    LoadRequested,
    Plan,
    RequestFinished,
    RequestPreempted,
    StepEnded,
    StepPacked,
    StepScheduled,
    StoreRequested,
    TransferFinished,
    decode,
    encode,
    packed_step,
    to_dict,
)
from kvlog.log import read_log
from kvlog.reducers import check_invariants, checkpoint, digest, restore, snapshot
from kvlog.reducers import step as step_reducer
from kvlog.runtime.machine import Machine, Ticket
from kvlog.synth import read_trace, run_trace
from tests.synth.test_trace import AZURE, MOONCAKE, azure_config, mooncake_config

NUM_BLOCKS = 24
REQS = [f"r{i}" for i in range(6)]


def _fine(machine: Machine, event: StepScheduled) -> list[Plan] | KvlogError:
    """The step as its fine-grained events, all or nothing (restored on a refusal)."""
    saved = snapshot(machine.state)
    plans: list[Plan] = []
    try:
        for fine in step_reducer.expand(machine.state, event):
            plans += machine.apply(fine)
    except KvlogError as exc:
        machine.state = restore(saved)
        return exc
    return plans


def _whole(
    machine: Machine, event: StepScheduled, ticket: Ticket | None = None
) -> list[Plan] | KvlogError:
    try:
        return machine.apply(event, ticket=ticket)
    except KvlogError as exc:
        return exc


@st.composite
def steps(draw: st.DrawFn) -> list[tuple[StepScheduled | Event, ...]]:
    """Programs of whole steps, with now and then a store or its completion between them."""
    program: list[tuple[StepScheduled | Event, ...]] = []
    job = 0
    for step in range(draw(st.integers(1, 12))):
        allocated = {}
        for req_id in draw(st.lists(st.sampled_from(REQS), unique=True, max_size=4)):
            allocated[req_id] = draw(
                st.lists(st.integers(-1, NUM_BLOCKS), unique=draw(st.booleans()), max_size=5)
            )
        event = StepScheduled(
            step=step,
            allocated=allocated,
            finished=draw(st.lists(st.sampled_from(REQS), max_size=2)),
            preempted=draw(st.lists(st.sampled_from(REQS), max_size=2)),
            resumed=draw(st.lists(st.sampled_from(REQS), max_size=2)),
        )
        extra: tuple[Event, ...] = ()
        if draw(st.integers(0, 3)) == 0:
            job += 1
            gpu = draw(
                st.lists(st.integers(1, NUM_BLOCKS - 1), min_size=1, max_size=3, unique=True)
            )
            extra = (StoreRequested(job, gpu, list(range(len(gpu)))),)
        elif job and draw(st.booleans()):
            extra = (TransferFinished(job, True),)
        program.append((*extra, event))
    return program


def _configured_pair(
    threshold: int, prefix_caching: bool, quarantine: bool
) -> tuple[Machine, Machine]:
    """Two machines configured alike for ``steps()``'s programs (``NUM_BLOCKS`` blocks of
    4 tokens, 64 CPU blocks, pads 2/4/8, at most 8 swaps a step)."""
    config = CacheConfigured(
        num_gpu_blocks=NUM_BLOCKS, block_size=4, num_cpu_blocks=64, threshold=threshold,
        pad_sizes=(2, 4, 8), max_swaps=8, prefix_caching=prefix_caching,
        quarantine_released=quarantine,
    )  # fmt: skip
    first, second = Machine(), Machine()
    first.apply(config)
    second.apply(config)
    return first, second


@settings(deadline=None)
@given(
    program=steps(),
    prefix_caching=st.booleans(),
    quarantine=st.booleans(),
    threshold=st.sampled_from([0, 2, 32]),
    checked_first=st.booleans(),
)
def test_a_step_is_its_fine_grained_events(
    program: list[tuple[StepScheduled | Event, ...]],
    prefix_caching: bool,
    quarantine: bool,
    threshold: int,
    checked_first: bool,
) -> None:
    """``checked_first``: the whole-step machine checks each step before the events that
    precede it (as the facade checks at ``update_state`` and applies at ``defragment()``,
    after a poll's ``TransferFinished``): a check kept across them must still hold."""
    whole, fine = _configured_pair(threshold, prefix_caching, quarantine)
    for events in program:
        *extras, event = events
        ticket = None
        if checked_first:
            with contextlib.suppress(KvlogError):
                ticket = whole.check(event)
        for extra in extras:
            for machine in (whole, fine):
                with contextlib.suppress(KvlogError):
                    machine.apply(extra)
        assert isinstance(event, StepScheduled)
        got, want = _whole(whole, event, ticket), _fine(fine, event)
        if isinstance(want, KvlogError):
            assert isinstance(got, KvlogError), f"{event} accepted; its events refuse {want!r}"
        else:
            assert got == want, event
        assert checkpoint.checkpoint_digest(whole.state) == checkpoint.checkpoint_digest(fine.state)
        assert digest(whole.state) == digest(fine.state)
        check_invariants(whole.state)


def _regrouped(path: str) -> list[Event]:
    """A fine-grained log's events with every step that is only releases then allocations
    (finished, preempted, allocated, in that order, each request allocated once) then
    ``StepEnded`` turned into one ``StepScheduled``; other steps stay as they were."""
    out: list[Event] = []
    run: list[Event] = []
    for _, record in read_log(path):
        if isinstance(record, Checkpoint):
            continue
        if isinstance(record, (RequestFinished, RequestPreempted, BlocksAllocated)):
            run.append(record)
            continue
        if isinstance(record, StepEnded) and _canonical(run):
            out.append(_as_step(record.step, run))
        else:
            out += run
            out.append(record)
        run = []
    return out + run


def _canonical(run: list[Event]) -> bool:
    order = {RequestFinished: 0, RequestPreempted: 1, BlocksAllocated: 2}
    ranks = [order[type(e)] for e in run]
    allocated = [e.req_id for e in run if isinstance(e, BlocksAllocated)]
    return ranks == sorted(ranks) and len(set(allocated)) == len(allocated)


def _as_step(step: int, run: list[Event]) -> StepScheduled:
    return StepScheduled(
        step=step,
        allocated={e.req_id: e.block_ids for e in run if isinstance(e, BlocksAllocated)},
        finished=[e.req_id for e in run if isinstance(e, RequestFinished)],
        preempted=[e.req_id for e in run if isinstance(e, RequestPreempted)],
    )


def _fold(events: list[Event]) -> list[str]:
    """The checkpoint digest after every step."""
    machine = Machine()
    out = []
    for event in events:
        machine.apply(event)
        if isinstance(event, (StepEnded, StepScheduled)):
            out.append(checkpoint.checkpoint_digest(machine.state))
    check_invariants(machine.state)
    return out


def test_trace_logs_regrouped_into_whole_steps_fold_to_the_same_states(tmp_path: Path) -> None:
    """Mooncake (prefix caching) and Azure (offload, block_size_factor 2): the same state
    after every step, whether a step is one event or many."""
    runs = [
        (mooncake_config(), read_trace(MOONCAKE)),
        (azure_config(num_cpu_blocks=512, block_size_factor=2), read_trace(AZURE, "azure")),
    ]
    for number, (config, requests) in enumerate(runs):
        path = os.path.join(tmp_path, f"{number}.kvlog")
        run_trace(config, requests, path, sync="none")
        fine = [record for _, record in read_log(path) if not isinstance(record, Checkpoint)]
        whole = _regrouped(path)
        num_steps = sum(isinstance(e, StepScheduled) for e in whole)
        assert num_steps > len(whole) // 20, "the trace's steps were not regrouped"
        assert _fold(whole) == _fold(fine)


@pytest.mark.parametrize(
    ("prefix_caching", "quarantine"), [(False, False), (True, False), (False, True)]
)
def test_a_step_that_reuses_its_own_releases_is_checked_in_bulk(
    prefix_caching: bool, quarantine: bool
) -> None:
    """A full pool's usual step hands the blocks of a request that finished (or was
    preempted) in the same step straight to another: one compiled check after the
    releases (``step._after_releases``), and the outcome of the fine-grained events."""
    whole, fine = _configured_pair(
        threshold=NUM_BLOCKS, prefix_caching=prefix_caching, quarantine=quarantine
    )
    first = StepScheduled(0, {"r0": [1, 2, 3], "r1": [4, 5], "r2": [6]}, [])
    reuse = StepScheduled(
        1, {"r3": [5, 2], "r4": [4, 3, 7]}, ["r0"], preempted=["r1"]
    )  # 2, 3 from r0 and 4, 5 from r1, released by the step itself
    for event in (first, reuse):
        assert whole.check(event).checked.found.bulk is not None
        assert _whole(whole, event) == _fine(fine, event)
        assert digest(whole.state) == digest(fine.state)
        check_invariants(whole.state)
    assert dict(whole.state.tables) == {"r2": [6], "r3": [5, 2], "r4": [4, 3, 7]}
    assert sorted(np.flatnonzero(whole.state.refs).tolist()) == [2, 3, 4, 5, 6, 7]


def test_shared_prefix_blocks_are_checked_in_bulk_under_prefix_caching() -> None:
    """Under prefix caching a step may give a block a live table holds, or the same block
    to two of its requests (a cached prefix): bulk, one reference a taker, the fine-grained
    outcome. The same block twice in one allocation is still refused, as its
    ``BlocksAllocated`` is, and so is a block an unfinished load writes."""
    whole, fine = _configured_pair(threshold=NUM_BLOCKS, prefix_caching=True, quarantine=False)
    first = StepScheduled(0, {"r0": [1, 2, 3]}, [])
    shared = StepScheduled(1, {"r1": [1, 2, 4], "r2": [1, 4, 5]}, [])  # 1 thrice, 4 twice
    for event in (first, shared):
        assert whole.check(event).checked.found.bulk is not None
        assert _whole(whole, event) == _fine(fine, event)
        assert digest(whole.state) == digest(fine.state)
        check_invariants(whole.state)
    refs = whole.state.refs
    assert [int(refs[p]) for p in (1, 2, 3, 4, 5)] == [3, 2, 1, 2, 1]
    for bad in (
        StepScheduled(2, {"r3": [6, 1, 6]}, []),  # 6 twice in one allocation
        StepScheduled(2, {"r3": [7], "r4": [8, 8]}, []),
    ):
        assert isinstance(_whole(whole, bad), DuplicateBlock)
        assert isinstance(_fine(fine, bad), DuplicateBlock)
    for machine in (whole, fine):
        machine.apply(LoadRequested(1, [0], [9]))
    loading = StepScheduled(2, {"r3": [1, 9]}, [])
    assert isinstance(_whole(whole, loading), BlockInUse)
    assert isinstance(_fine(fine, loading), BlockInUse)
    assert digest(whole.state) == digest(fine.state)


def test_a_step_reusing_blocks_a_store_still_reads_flushes_them_in_bulk() -> None:
    """A released block that an unfinished store still reads may be handed on once that
    store is flushed (the deferred store submitted, then fenced): the step commits in
    bulk, with each allocation's flush in order before its defrag decision, the plans of
    the fine-grained events. A check kept across a finished transfer is not trusted then
    (the finished store would have nothing left to flush)."""
    whole, fine = _configured_pair(threshold=NUM_BLOCKS, prefix_caching=False, quarantine=False)
    setup = [
        StepScheduled(0, {"r0": [1, 2], "r1": [3, 5]}, []),
        StoreRequested(1, [2], [0], deferred=True),
        StoreRequested(2, [5], [1]),
    ]
    for event in setup:
        whole.apply(event)
        fine.apply(event)
    reuse = StepScheduled(1, {"r2": [2, 4], "r3": [6], "r4": [5]}, ["r0", "r1"])
    ticket = whole.check(reuse)
    assert ticket.checked.found.bulk is not None
    assert ticket.checked.found.flushes == [[2], [5]]
    plans = _whole(whole, reuse, ticket)
    assert plans == _fine(fine, reuse)
    assert [type(p).__name__ for p in plans] == ["TransferPlan", "FencePlan", "FencePlan"]
    assert digest(whole.state) == digest(fine.state)
    check_invariants(whole.state)
    kept = whole.check(StepScheduled(2, {"r5": [3]}, ["r2"]))
    whole.apply(TransferFinished(2, True))
    assert whole.still_checked(kept) is not None  # nothing to flush: still holds
    flushing = whole.check(StepScheduled(2, {"r5": [2]}, ["r2"]))
    assert flushing.checked.found.flushes == [[2]]
    whole.apply(TransferFinished(1, True))
    assert whole.still_checked(flushing) is None


def test_a_resumed_request_is_released_just_before_its_own_blocks() -> None:
    """Found by the fuzz profile: a resumed request's old table is released between the
    allocations, not before all of them, so an earlier request cannot take its block."""
    config = CacheConfigured(num_gpu_blocks=8, block_size=4, threshold=32)
    machine = Machine()
    machine.apply(config)
    machine.apply(StepScheduled(step=0, allocated={"r1": [1]}, finished=[]))
    early = StepScheduled(step=1, allocated={"r2": [1], "r1": [2]}, finished=[], resumed=["r1"])
    assert isinstance(_whole(machine, early), KvlogError)
    late = StepScheduled(step=1, allocated={"r1": [2], "r2": [1]}, finished=[], resumed=["r1"])
    assert _whole(machine, late) == []
    assert machine.state.tables == {"r1": [2], "r2": [1]}
    check_invariants(machine.state)


@settings(deadline=None)
@given(
    program=steps(),
    prefix_caching=st.booleans(),
    quarantine=st.booleans(),
    threshold=st.sampled_from([0, 2, 32]),
    decoded=st.booleans(),
)
def test_a_packed_step_is_the_step_it_packs(
    program: list[tuple[StepScheduled | Event, ...]],
    prefix_caching: bool,
    quarantine: bool,
    threshold: int,
    decoded: bool,
) -> None:
    """``StepPacked`` (the form the log records a step in) and the ``StepScheduled`` it
    packs: the same acceptance, the same refusal (type and message), plans, both digests,
    after every step; ``decoded``: the packed form goes through the log's codec and the
    replay's path (``apply_decoded``) first."""
    plain, packed = _configured_pair(threshold, prefix_caching, quarantine)
    for events in program:
        *extras, event = events
        for extra in extras:
            for machine in (plain, packed):
                with contextlib.suppress(KvlogError):
                    machine.apply(extra)
        assert isinstance(event, StepScheduled)
        twin = packed_step(event)
        assert twin.unpacked() == event
        want = _whole(plain, event)
        try:
            if decoded:
                decoded_twin = decode(encode(twin))
                assert decoded_twin == twin
                got: list[Plan] | KvlogError = packed.apply_decoded(decoded_twin)
            else:
                got = packed.apply(twin)
        except KvlogError as exc:
            got = exc
        if isinstance(want, KvlogError):
            assert isinstance(got, KvlogError), f"{twin} accepted; {event} refused: {want!r}"
            assert (type(got), str(got)) == (type(want), str(want))
        else:
            assert got == want, event
        assert checkpoint.checkpoint_digest(packed.state) == checkpoint.checkpoint_digest(
            plain.state
        )
        assert digest(packed.state) == digest(plain.state)


def test_the_log_records_a_step_checked_in_bulk_packed(tmp_path: Path) -> None:
    """The Engine logs a step its check took in bulk as ``StepPacked`` and any other step
    as it came; the log replays to the Engine's digest. A step that hands a released
    request's block to another is in bulk; one whose resumed request takes back its own
    block (released between its allocations) is not."""
    path = tmp_path / "steps.kvlog"
    config = CacheConfigured(num_gpu_blocks=16, block_size=4, threshold=0)
    with Engine(config, log_path=str(path), sync="none") as engine:
        engine.apply(StepScheduled(0, {"a": [1, 2, 3], "b": [], "c": [7]}, []))
        engine.apply(StepScheduled(1, {"a": [9], "d": [3]}, [], preempted=["a"]))  # reuses 3
        engine.apply(StepScheduled(2, {"c": [7, 10]}, [], resumed=["c"]))  # takes 7 back
        final = digest(engine.state)
    kinds = [type(r).__name__ for _, r in read_log(str(path)) if not isinstance(r, Checkpoint)]
    assert kinds == ["CacheConfigured", "StepPacked", "StepPacked", "StepScheduled"]
    first = next(r for _, r in read_log(str(path)) if isinstance(r, StepPacked))
    assert first.unpacked() == StepScheduled(0, {"a": [1, 2, 3], "b": [], "c": [7]}, [])
    result = replay(str(path))
    assert result.ok and result.final_digest == final


@pytest.mark.parametrize(
    ("counts", "block_ids", "req_ids", "id_bytes", "message"),
    [
        ([2], [1], ["a"], 4, "block_ids holds 4 bytes where counts add up to 2"),
        ([1, 1], [1, 2], ["a"], 4, "counts holds 8 bytes for 1 requests"),
        ([-1, 2], [1], ["a", "b"], 4, "counts holds a negative count"),
        ([1, 1], [1, 2], ["a", "a"], 4, "req_ids holds 'a' twice"),
        ([2], [1, 2], ["a"], 3, "id_bytes must be 2 or 4, got 3"),
        ([3], [1, 2], ["a"], 2, "block_ids holds 4 bytes where counts add up to 3 ids of 2 bytes"),
    ],
)
def test_a_packed_step_that_does_not_fit_its_requests_is_refused(
    counts: list[int], block_ids: list[int], req_ids: list[str], id_bytes: int, message: str
) -> None:
    dtype = "<u2" if id_bytes == 2 else "<i4"
    event = StepPacked(
        step=0,
        req_ids=req_ids,
        counts=np.asarray(counts, dtype="<i4").tobytes(),
        block_ids=np.asarray(block_ids, dtype=dtype).tobytes(),
        finished=[],
        id_bytes=id_bytes,
    )
    machine = Machine()
    machine.apply(CacheConfigured(num_gpu_blocks=16, block_size=4))
    with pytest.raises(InvalidEvent, match=re.escape(message)):
        machine.apply(event)


def test_a_packed_step_reads_as_numbers_in_json() -> None:
    """``kvlog inspect`` and divergence reports show a ``StepPacked``'s ids, not base64."""
    packed = packed_step(StepScheduled(3, {"a": [1, 2], "b": [5]}, ["x"]))
    assert to_dict(packed) == {
        "type": "StepPacked", "step": 3, "req_ids": ["a", "b"], "counts": [2, 1],
        "block_ids": [1, 2, 5], "finished": ["x"], "preempted": [], "resumed": [], "id_bytes": 2,
    }  # fmt: skip


def test_a_step_packs_its_ids_in_2_bytes_where_they_fit_else_in_4(tmp_path: Path) -> None:
    """A pool of more than 65,536 blocks: a step whose ids all fit in 16 bits is logged 2
    bytes an id, one with a larger id 4; both replay to the live digest."""
    small = packed_step(StepScheduled(0, {"a": [5, 65535]}, []))
    large = packed_step(StepScheduled(1, {"b": [6, 65536]}, []))
    assert (small.id_bytes, len(small.block_ids)) == (2, 4)
    assert (large.id_bytes, len(large.block_ids)) == (4, 8)
    assert small.allocated == {"a": [5, 65535]} and large.allocated == {"b": [6, 65536]}
    assert packed_step(StepScheduled(2, {"c": [-1]}, [])).id_bytes == 4  # refused later, kept
    ids = np.array([6, 65536], dtype=np.int64)  # a checked step's ids, in its pool
    assert packed_step(StepScheduled(1, {"b": [6, 65536]}, []), ids, pool=70_000) == large
    ids = np.array([5, 65535], dtype=np.int64)
    assert packed_step(StepScheduled(0, {"a": [5, 65535]}, []), ids, pool=65_536) == small
    path = tmp_path / "wide.kvlog"
    with Engine(CacheConfigured(num_gpu_blocks=70_000, block_size=4), log_path=path) as engine:
        engine.apply(StepScheduled(0, {"a": [5, 65535]}, []))
        engine.apply(StepScheduled(1, {"b": [6, 69_999]}, []))
        final = digest(engine.state)
    logged = [r for _, r in read_log(str(path)) if isinstance(r, StepPacked)]
    assert [r.id_bytes for r in logged] == [2, 4]
    assert [r.unpacked().allocated for r in logged] == [{"a": [5, 65535]}, {"b": [6, 69_999]}]
    assert replay(str(path)).final_digest == final

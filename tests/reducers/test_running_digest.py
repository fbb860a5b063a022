"""The running digest (checkpoints' ``"v2:"``): history-independent, sensitive, O(changes)."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from kvlog import Engine
from kvlog.events import (
    BlocksAllocated,
    BlocksReleased,
    CacheConfigured,
    RequestFinished,
    StepEnded,
    StoreRequested,
    TransferFinished,
)
from kvlog.reducers import check_invariants, checkpoint, restore, snapshot
from kvlog.reducers.running import RunningDigest, request_key

CONFIG = CacheConfigured(num_gpu_blocks=64, block_size=16, num_cpu_blocks=16, threshold=0)


def test_equal_states_reached_by_other_histories_have_equal_running_digests() -> None:
    a, b = Engine(CONFIG), Engine(CONFIG)
    a.apply(BlocksAllocated(req_id="x", block_ids=[3, 4]))
    a.apply(BlocksAllocated(req_id="x", block_ids=[5]))
    a.running_digest()  # a flush in the middle changes nothing
    a.apply(BlocksAllocated(req_id="gone", block_ids=[9]))
    a.apply(RequestFinished(req_id="gone"))
    b.apply(BlocksAllocated(req_id="x", block_ids=[3, 4, 5, 6]))
    b.apply(BlocksReleased(req_id="x", block_ids=[6]))
    assert a.digest() == b.digest()
    assert a.running_digest() == b.running_digest()
    assert a.running_digest().startswith(checkpoint.DIGEST_V2_PREFIX)


def test_the_running_digest_sees_order_mapping_and_jobs() -> None:
    base = Engine(CONFIG)
    base.apply(BlocksAllocated(req_id="x", block_ids=[3, 4]))
    other = Engine(CONFIG)
    other.apply(BlocksAllocated(req_id="x", block_ids=[4, 3]))  # same blocks, other order
    assert base.running_digest() != other.running_digest()
    before = base.running_digest()
    base.apply(StoreRequested(job_id=0, gpu_block_ids=[3], cpu_block_ids=[0]))
    assert base.running_digest() != before
    base.apply(TransferFinished(job_id=0, success=True))
    assert base.state.running.jobs == 0  # the job came and went (last_job_id stays 0)
    base.apply(BlocksAllocated(req_id="y", block_ids=[60]))
    moved = base.apply(StepEnded(step=0))  # threshold 0: defrag moves 60 down
    assert moved
    check_invariants(base.state)
    fresh = Engine(CONFIG)
    fresh.apply(BlocksAllocated(req_id="x", block_ids=[3, 4]))
    fresh.apply(StoreRequested(job_id=0, gpu_block_ids=[4], cpu_block_ids=[1]))
    fresh.apply(TransferFinished(job_id=0, success=False))
    fresh.apply(BlocksAllocated(req_id="y", block_ids=[60]))
    fresh.apply(StepEnded(step=0))
    assert fresh.running_digest() == base.running_digest()


def test_a_restored_snapshot_has_the_running_digest_of_its_state() -> None:
    engine = Engine(CONFIG)
    for i in range(6):
        engine.apply(BlocksAllocated(req_id=f"r{i}", block_ids=[10 + 2 * i, 11 + 2 * i]))
    engine.apply(RequestFinished(req_id="r1"))
    engine.apply(StepEnded(step=0))
    engine.apply(StoreRequested(job_id=3, gpu_block_ids=[14], cpu_block_ids=[2]))
    state = restore(snapshot(engine.state))
    check_invariants(state)
    assert checkpoint.checkpoint_digest(state) == engine.running_digest()


@given(
    st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=80, unique=True),
    st.data(),
)
def test_rows_added_in_bulk_are_the_rows_added_one_by_one(names: list[str], data: Any) -> None:
    """``add_requests`` leaves what ``add_request`` per id leaves: the same slots (free
    rows reused last first, then new ones, past a doubling of the rows), keys, zeroed sums
    and order of ``slots``, whatever rows were freed before."""
    one, bulk = RunningDigest(), RunningDigest()
    first = data.draw(st.integers(0, len(names)), label="rows before")
    for digest in (one, bulk):
        for name in names[:first]:
            digest.add_request(name)
            digest.sums_buffer[digest.slots[name]] = 7  # a freed row's sum is stale
    for name in data.draw(st.lists(st.sampled_from(names[:first] or [""]), unique=True)):
        for digest in (one, bulk):
            digest.table_removed(name) if name in digest.slots else None
    rest = names[first:]
    for name in rest:
        one.add_request(name)
    bulk.add_requests(rest)
    assert list(bulk.slots.items()) == list(one.slots.items())
    assert bulk.free_slots == one.free_slots and bulk.num_rows == one.num_rows
    rows = list(one.slots.values())
    assert bulk.keys[rows].tolist() == one.keys[rows].tolist()
    assert bulk.sums[rows].tolist() == one.sums[rows].tolist()
    assert all(bulk.keys_buffer[one.slots[n]] == request_key(n) for n in rest)

"""Narrative scenarios for the transfer rules of commit 1e4e711, each with exact block ids.

1. Deferred stores: pinned at ``StoreRequested(deferred=True)``, planned at
   ``TransferSubmitted`` (a second submit is a no-op), never finished before submitted;
   ``after_job_id`` follows submitted jobs only.
2. Allocations: a block an unfinished load writes is refused (with and without prefix
   caching: the issue-10 reproducer on the fake backend, nothing logged); a free block a
   store still reads is handed out after the deferred readers are planned and every reader
   is fenced, so the store reads the old bytes; a shared live block gives no plan.
3. GPU blocks and CPU sub-blocks of the two directions: two loads may not write one block;
   a store and a load may share a GPU block and run in submission order (each plan fences
   the other direction's submitted jobs on its blocks); a store may not write a CPU
   sub-block a load reads, a load may not read one a store writes (deferred or not), per
   sub-block, not per CPU block.
4. vLLM 0.33's chunk rule for ``group_sizes`` / ``block_indices``.
5. ``quarantine_released``: blocks freed since the last step are neither destinations nor
   sources at the next decision, and free again after it.
6. ``BlocksReleased`` (a partial release, where the schema has it).

One test is an expected failure that names a kvlog bug of 7f766bd (``BlocksReleased`` on
a table holding a block twice); it passes, and must lose its mark, once the bug is fixed.

Every refusal leaves the digest and the snapshot alone; ``check_invariants`` holds after
every accepted event.
"""

from __future__ import annotations

import os
import random
from typing import Any

import pytest

import kvlog.events
from kvlog import Engine, errors
from kvlog.events import (
    BlocksAllocated,
    CacheConfigured,
    Checkpoint,
    FencePlan,
    LoadRequested,
    RequestFinished,
    RequestPreempted,
    StepEnded,
    StoreRequested,
    SwapPlan,
    TransferFinished,
    TransferPlan,
    TransferSubmitted,
)
from kvlog.executors import make_executor
from kvlog.log import read_log
from kvlog.reducers import State, check_invariants, digest, restore, snapshot
from tests.support import reducer_helpers as helpers
from tests.support.reducer_helpers import alloc, rejected, run

LOADS_DEFER = "deferred" in LoadRequested.__struct_fields__
BlocksReleased: Any = getattr(kvlog.events, "BlocksReleased", None)
PAGE = 100


def make(**config: Any) -> State:
    """A configured state: 16 GPU blocks, 8 CPU blocks, threshold 0, 100-byte pages."""
    config.setdefault("num_cpu_blocks", 8)
    config.setdefault("page_size_bytes", PAGE)
    return helpers.make(**config)


def store(
    job_id: int, gpu: list[int], cpu: list[int], deferred: bool = False, **groups: Any
) -> StoreRequested:
    return StoreRequested(
        job_id=job_id, gpu_block_ids=gpu, cpu_block_ids=cpu, deferred=deferred, **groups
    )


def load(job_id: int, cpu: list[int], gpu: list[int], **fields: Any) -> LoadRequested:
    return LoadRequested(job_id=job_id, cpu_block_ids=cpu, gpu_block_ids=gpu, **fields)


def plan(job_id: int, kind: str, pairs: list[tuple[int, int]], after: int = -1) -> TransferPlan:
    return TransferPlan(job_id, kind, pairs, len(pairs) * PAGE, after)  # type: ignore[arg-type]


def swap(step: int, pairs: list[tuple[int, int]], padded_to: int = 8) -> SwapPlan:
    return SwapPlan(step=step, pairs=pairs, padded_to=padded_to, mode="move")


def submitted(state: State, job_id: int) -> bool:
    job = state.job(job_id)
    assert job is not None, f"job {job_id} is not in flight"
    return job.submitted


# -- 1. deferred stores ----------------------------------------------------------------------
def test_a_deferred_store_pins_at_once_and_plans_at_transfer_submitted() -> None:
    state = make()
    run(state, alloc("A", 1, 2, 3, 4, 5), alloc("B", 9, 10))
    # the scheduler decides to offload B's blocks; the KV is still being computed
    assert run(state, store(0, [9, 10], [0, 1], deferred=True)) == []
    assert state.is_pinned(9) and state.is_pinned(10) and not submitted(state, 0)
    assert state.jobs_in_flight() == [0]
    # A finishes: 10 - 0 > 2 fires, but B's blocks are pinned, so nothing may move
    assert run(state, RequestFinished("A"), StepEnded(step=0)) == []
    # the worker submits it: the plan reads the blocks resolved at the decision
    assert run(state, TransferSubmitted(job_id=0)) == [plan(0, "store", [(9, 0), (10, 1)])]
    assert submitted(state, 0)
    assert run(state, TransferSubmitted(job_id=0)) == []  # already submitted: a no-op
    run(state, TransferFinished(job_id=0, success=True))
    assert not state.is_pinned(9) and not state.is_pinned(10)
    assert run(state, StepEnded(step=1)) == [swap(1, [(10, 1), (9, 2)])]


def test_a_deferred_store_cannot_finish_before_it_is_submitted() -> None:
    state = make()
    run(state, alloc("A", 3), store(0, [3], [0], deferred=True))
    rejected(state, TransferFinished(job_id=0, success=True), errors.UnknownJob, "deferred")
    rejected(state, TransferSubmitted(job_id=1), errors.UnknownJob, "never submitted")
    run(state, TransferSubmitted(job_id=0), TransferFinished(job_id=0, success=False))
    rejected(state, TransferSubmitted(job_id=0), errors.UnknownJob, "finished already")
    rejected(state, TransferFinished(job_id=0, success=True), errors.UnknownJob)
    assert not state.is_pinned(3) and state.jobs_in_flight() == []


def test_after_job_id_chains_the_submitted_jobs_of_a_direction_only() -> None:
    state = make()
    run(state, alloc("A", 1, 2, 3, 4))
    assert run(state, store(0, [1], [0])) == [plan(0, "store", [(1, 0)], after=-1)]
    assert run(state, store(1, [2], [1], deferred=True)) == []
    # job 1 is not submitted: job 2 runs after job 0
    assert run(state, store(2, [3], [2])) == [plan(2, "store", [(3, 2)], after=0)]
    # a load has its own chain
    assert run(state, load(3, [7], [9])) == [plan(3, "load", [(7, 9)], after=-1)]
    # job 1 is submitted last: it runs after the highest submitted store, job 2
    assert run(state, TransferSubmitted(job_id=1)) == [plan(1, "store", [(2, 1)], after=2)]
    run(state, TransferFinished(job_id=2, success=True))
    assert run(state, store(4, [4], [3])) == [plan(4, "store", [(4, 3)], after=1)]


@pytest.mark.skipif(not LOADS_DEFER, reason="this schema defers stores only")
def test_a_deferred_load_pins_its_destination_and_plans_at_transfer_submitted() -> None:
    state = make()
    deferred_load = LoadRequested(job_id=0, cpu_block_ids=[2], gpu_block_ids=[6], deferred=True)
    assert run(state, deferred_load) == []
    assert state.is_pinned(6) and not submitted(state, 0)
    rejected(state, alloc("B", 6), errors.BlockInUse, "unfinished load job 0")
    rejected(state, TransferFinished(job_id=0, success=True), errors.UnknownJob, "deferred")
    rejected(state, store(1, [1], [2]), errors.BlockInUse, "CPU sub-block 2")
    assert run(state, TransferSubmitted(job_id=0)) == [plan(0, "load", [(2, 6)])]
    run(state, TransferFinished(job_id=0, success=True), alloc("B", 6))


# -- 2. allocations: loads refuse, stores flush and fence -------------------------------------
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_a_block_an_unfinished_load_writes_is_never_allocated(prefix_caching: bool) -> None:
    state = make(prefix_caching=prefix_caching)
    run(state, alloc("A", 3), load(0, [0], [3]), load(1, [1], [5]))
    run(state, RequestFinished("A"))
    rejected(state, alloc("B", 3), errors.BlockInUse, "unfinished load job 0")
    rejected(state, alloc("B", 1, 5), errors.BlockInUse, "unfinished load job 1")
    run(state, TransferFinished(job_id=0, success=True))
    run(state, alloc("B", 3))
    assert state.request_blocks("B") == [3]


def test_with_prefix_caching_a_live_block_being_loaded_is_not_shared() -> None:
    state = make(prefix_caching=True)
    run(state, alloc("A", 4), load(0, [2], [4]))
    rejected(state, alloc("B", 4), errors.BlockInUse, "unfinished load job 0")


def test_issue_10_allocating_a_block_a_load_writes_raises_and_logs_nothing(
    tmp_path: Any,
) -> None:
    """Fake backend: A holds 3, a load into 3, A finishes; allocating B on 3 raises
    ``BlockInUse`` with nothing logged and the digest unchanged; after the load, B gets 3
    with the loaded bytes."""
    config = CacheConfigured(num_gpu_blocks=8, block_size=4, num_cpu_blocks=2, page_size_bytes=64)
    executor = make_executor(_caches(config), config, backend="fake", seed=10, max_delay_polls=3)
    path = os.path.join(tmp_path, "issue10.kvlog")
    engine = Engine(config, log_path=path, executor=executor, sync="always")
    page = executor.page_size_bytes
    cpu_bytes = random.Random(10).randbytes(page * config.block_size_factor)
    executor.write_cpu_block(1, cpu_bytes)
    engine.apply(BlocksAllocated(req_id="A", block_ids=[3]))
    assert engine.apply(LoadRequested(job_id=0, cpu_block_ids=[1], gpu_block_ids=[3])) == [
        TransferPlan(0, "load", [(1, 3)], page, -1)
    ]
    engine.apply(RequestFinished(req_id="A"))
    before, size = engine.digest(), os.path.getsize(path)
    with pytest.raises(errors.BlockInUse, match="unfinished load job 0"):
        engine.apply(BlocksAllocated(req_id="B", block_ids=[3]))
    assert engine.digest() == before and os.path.getsize(path) == size
    assert engine.state.request_blocks("B") == []
    (result,) = engine.wait()
    assert result.job_id == 0 and result.success
    assert engine.apply(BlocksAllocated(req_id="B", block_ids=[3])) == []
    assert executor.read_gpu_block(3) == cpu_bytes
    engine.close()
    logged = [type(r).__name__ for _, r in read_log(path) if not isinstance(r, Checkpoint)]
    assert logged == [  # the refused allocation is not among them
        "CacheConfigured",
        "BlocksAllocated",
        "LoadRequested",
        "RequestFinished",
        "TransferFinished",
        "BlocksAllocated",
    ]


def test_reusing_blocks_stores_read_plans_the_deferred_readers_then_fences_all() -> None:
    state = make()
    run(state, alloc("A", 4, 5, 6, 7))
    assert run(state, store(0, [4], [0])) == [plan(0, "store", [(4, 0)])]
    assert run(state, store(1, [5, 6], [1, 2], deferred=True)) == []
    assert run(state, store(2, [7], [3], deferred=True)) == []
    assert run(state, store(3, [6], [4], deferred=True)) == []
    run(state, RequestFinished("A"))  # 4..7 are free, and still read
    # B takes 6: jobs 1 and 3 read it and are deferred: both run now, in job order, then
    # the new owner waits for them
    assert run(state, alloc("B", 6)) == [
        plan(1, "store", [(5, 1), (6, 2)], after=0),
        plan(3, "store", [(6, 4)], after=1),
        FencePlan(job_ids=[1, 3]),
    ]
    assert not submitted(state, 2)
    # C takes 4 and 7: job 0 runs already (fenced only), job 2 is planned first
    assert run(state, alloc("C", 7, 4)) == [
        plan(2, "store", [(7, 3)], after=3),
        FencePlan(job_ids=[0, 2]),
    ]
    # the worker's own submits of flushed jobs are no-ops
    assert run(state, TransferSubmitted(job_id=1), TransferSubmitted(job_id=2)) == []
    assert state.request_blocks("B") == [6] and state.request_blocks("C") == [7, 4]
    # a block no store reads needs nothing
    assert run(state, alloc("D", 9)) == []


def test_with_prefix_caching_a_shared_live_block_a_store_reads_needs_no_fence() -> None:
    state = make(prefix_caching=True)
    run(state, alloc("A", 3), store(0, [3], [0], deferred=True))
    assert run(state, alloc("B", 3)) == []  # a prefix hit only reads the block
    assert not submitted(state, 0) and state.refs[3] == 2
    run(state, RequestFinished("A"), RequestFinished("B"))
    assert run(state, alloc("C", 3)) == [plan(0, "store", [(3, 0)]), FencePlan(job_ids=[0])]


def test_a_fenced_block_stays_pinned_until_its_store_finishes() -> None:
    state = make()
    run(state, alloc("A", 1, 2), alloc("B", 12), store(0, [2], [0]))
    run(state, RequestFinished("A"))
    assert run(state, alloc("C", 2)) == [FencePlan(job_ids=[0])]
    # C holds 2, a store still reads it: 12 moves to 1, 2 stays where it is
    assert run(state, StepEnded(step=0)) == [swap(0, [(12, 1)])]
    assert state.resolve(2) == 2
    run(state, TransferFinished(job_id=0, success=True))
    assert not state.is_pinned(2)


def _caches(config: CacheConfigured) -> list[Any]:
    import torch

    n, bs = config.num_gpu_blocks, config.block_size
    return [
        (torch.zeros((n, bs, 4), dtype=torch.int8), torch.zeros((n, bs, 4), dtype=torch.int8))
        for _ in range(2)
    ]


def _reused_store(backend: str, drop_fences: bool = False) -> tuple[bytes, bytes, bytes]:
    """A deferred store of A's block 3 into CPU block 1; A finishes; B gets block 3 and
    writes new bytes into it at once. Returns (old bytes, new bytes, CPU block 1 after
    the store finished)."""
    config = CacheConfigured(
        num_gpu_blocks=8, block_size=4, num_cpu_blocks=2, defrag=False, page_size_bytes=64
    )
    executor = make_executor(_caches(config), config, backend=backend, seed=3, max_delay_polls=4)
    if drop_fences:  # the engine's fence, lost on the way to the executor
        execute = executor.execute
        executor.execute = lambda p: None if isinstance(p, FencePlan) else execute(p)
    engine = Engine(config, executor=executor)
    page = executor.page_size_bytes
    old, new = random.Random(1).randbytes(page), random.Random(2).randbytes(page)
    engine.apply(BlocksAllocated(req_id="A", block_ids=[3]))
    executor.write_gpu_block(3, old)
    assert engine.apply(store(0, [3], [1], deferred=True)) == []
    engine.apply(RequestFinished(req_id="A"))
    assert engine.apply(BlocksAllocated(req_id="B", block_ids=[3])) == [
        TransferPlan(0, "store", [(3, 1)], page, -1),
        FencePlan(job_ids=[0]),
    ]
    executor.write_gpu_block(engine.resolve(3), new)  # B's KV
    assert engine.apply(TransferSubmitted(job_id=0)) == []  # the worker's submit: no-op
    results = engine.poll() + engine.wait()
    assert [(r.job_id, r.success) for r in results] == [(0, True)]
    engine.close()
    return old, new, executor.read_cpu_block(1)


@pytest.mark.parametrize("backend", ["fake", "cpu"])
def test_a_deferred_store_whose_block_is_reused_reads_the_old_bytes(backend: str) -> None:
    old, new, stored = _reused_store(backend)
    assert stored == old != new


def test_without_the_fence_the_fake_backend_shows_the_store_reading_the_new_bytes() -> None:
    """The control: the fake backend reads a store's source only when the copy runs, so
    the fence is what keeps the old bytes (this is what the tensor machine relies on)."""
    _, new, stored = _reused_store("fake", drop_fences=True)
    assert stored == new


# -- 3. CPU sub-blocks of the two directions -----------------------------------------------
def test_cpu_sub_blocks_are_not_shared_by_a_store_and_a_load() -> None:
    state = make(block_size_factor=2)
    run(state, alloc("A", 4, 5, 6))
    # store 0 writes CPU block 1: sub-blocks 2 and 3
    assert run(state, store(0, [4, 5], [1])) == [plan(0, "store", [(4, 2), (5, 3)])]
    # a load of one GPU block from CPU block 1 reads sub-block 3 (the seed skips 1)
    rejected(state, load(1, [1], [9]), errors.BlockInUse, "CPU sub-block 3 .* store job 0")
    # from CPU block 0 it reads sub-block 1: fine
    assert run(state, load(1, [0], [9])) == [plan(1, "load", [(1, 9)])]
    # a store of CPU block 0 would write sub-block 1, which load 1 reads
    rejected(state, store(2, [5, 6], [0]), errors.BlockInUse, "CPU sub-block 1 .* load job 1")
    # one group of one block from block index 0 writes sub-block 0 only: fine
    grouped = store(2, [6], [0], group_sizes=(1,), block_indices=(0,))
    assert run(state, grouped) == [plan(2, "store", [(6, 0)], after=0)]
    # a deferred store counts from its decision
    run(state, store(3, [4, 6], [2], deferred=True))
    rejected(state, load(4, [2], [10, 11]), errors.BlockInUse, "CPU sub-block 4 .* store job 3")
    # two stores may write one sub-block, two loads may read one
    assert run(state, store(4, [5, 6], [1])) == [plan(4, "store", [(5, 2), (6, 3)], after=2)]
    assert run(state, load(5, [0], [12])) == [plan(5, "load", [(1, 12)], after=1)]
    # once the store finishes its CPU block may be loaded
    run(state, TransferSubmitted(job_id=3), TransferFinished(job_id=3, success=True))
    assert run(state, load(6, [2], [10, 11])) == [plan(6, "load", [(4, 10), (5, 11)], after=5)]


def test_a_load_into_a_block_another_load_writes_is_refused() -> None:
    state = make()
    run(state, alloc("A", 4, 5), load(0, [0], [4], deferred=LOADS_DEFER))
    rejected(state, load(1, [2, 3], [5, 4]), errors.BlockInUse, "unfinished load jobs \\[0\\]")


def test_a_store_and_a_load_sharing_a_block_run_in_submission_order() -> None:
    """vLLM stores a chunk a sync load just filled, and loads into a block whose flushed
    store has not run: each plan fences the submitted jobs of the other direction on its
    blocks, wherever it is handed out (request, submit, flush); unsubmitted ones wait for
    their own turn."""
    state = make()
    run(state, alloc("A", 4, 5, 6), load(0, [0], [4]), load(1, [1], [6]))
    assert run(state, store(2, [4, 5], [2, 3])) == [
        FencePlan(job_ids=[0]),
        plan(2, "store", [(4, 2), (5, 3)]),
    ]
    assert run(state, store(3, [6, 4], [4, 5], deferred=True)) == []
    assert run(state, TransferSubmitted(job_id=3)) == [
        FencePlan(job_ids=[0, 1]),
        plan(3, "store", [(6, 4), (4, 5)], after=2),
    ]
    # a deferred store flushed by a reuse fences its loads too
    run(state, store(4, [6, 7], [6, 7], deferred=True), RequestFinished("A"))
    assert run(state, alloc("B", 7)) == [
        FencePlan(job_ids=[1]),
        plan(4, "store", [(6, 6), (7, 7)], after=3),
        FencePlan(job_ids=[4]),
    ]
    # and a load into blocks stores read waits for the submitted ones
    run(state, TransferFinished(job_id=0, success=True))
    assert run(state, load(5, [0], [5])) == [FencePlan(job_ids=[2]), plan(5, "load", [(0, 5)], 1)]


@pytest.mark.skipif(not LOADS_DEFER, reason="this schema defers stores only")
def test_a_store_submitted_before_the_deferred_load_of_its_block_reads_the_old_bytes() -> None:
    """Submission order, not job order: the store runs first, the load after it."""
    state = make()
    run(state, alloc("A", 4), load(0, [0], [4], deferred=True))
    assert run(state, store(1, [4], [1])) == [plan(1, "store", [(4, 1)])]
    assert run(state, TransferSubmitted(job_id=0)) == [
        FencePlan(job_ids=[1]),
        plan(0, "load", [(0, 4)]),
    ]
    config = CacheConfigured(
        num_gpu_blocks=8, block_size=4, num_cpu_blocks=2, defrag=False, page_size_bytes=64
    )
    executor = make_executor(_caches(config), config, backend="fake", seed=3, max_delay_polls=4)
    engine = Engine(config, executor=executor)
    old, loaded = random.Random(1).randbytes(64), random.Random(2).randbytes(64)
    engine.apply(BlocksAllocated(req_id="A", block_ids=[4]))
    executor.write_gpu_block(4, old)
    executor.write_cpu_block(0, loaded)
    engine.apply(LoadRequested(job_id=0, cpu_block_ids=[0], gpu_block_ids=[4], deferred=True))
    engine.apply(store(1, [4], [1]))
    engine.apply(TransferSubmitted(job_id=0))
    assert sorted((r.job_id, r.success) for r in engine.wait()) == [(0, True), (1, True)]
    assert executor.read_cpu_block(1) == old and executor.read_gpu_block(4) == loaded
    engine.close()


# -- 4. vLLM 0.33's chunk rule ---------------------------------------------------------------
GROUPS = {"group_sizes": (3, 0, 5), "block_indices": (6, 9, 4)}
"""Factor 4: group 0 holds 3 blocks from index 6 (skip 2, 2 CPU blocks), group 1 is empty,
group 2 holds 5 blocks from index 4 (skip 0, 2 CPU blocks, the last one partial)."""
CHUNKED = [(1, 22), (2, 23), (3, 8), (4, 28), (5, 29), (6, 30), (7, 31), (8, 0)]
"""GPU 1..8 with CPU [5, 2, 7, 0]: 5*4+2, 5*4+3, 2*4+0; 7*4+0..3, 0*4+0."""


def test_grouped_stores_and_loads_follow_the_chunk_rule() -> None:
    state = make(block_size_factor=4)
    gpu = [1, 2, 3, 4, 5, 6, 7, 8]
    run(state, alloc("A", *gpu))
    assert run(state, store(0, gpu, [5, 2, 7, 0], **GROUPS)) == [plan(0, "store", CHUNKED)]
    run(state, TransferFinished(job_id=0, success=True), RequestFinished("A"))
    back = [(cpu, g) for g, cpu in CHUNKED]
    assert run(state, load(1, [5, 2, 7, 0], gpu, **GROUPS)) == [plan(1, "load", back)]


def test_grouped_transfers_of_the_wrong_size_are_refused() -> None:
    state = make(block_size_factor=4)
    run(state, alloc("A", 1, 2, 3, 4, 5, 6, 7, 8))
    gpu = [1, 2, 3, 4, 5, 6, 7, 8]
    for cpu in ([5, 2, 7], [5, 2, 7, 0, 1]):
        rejected(state, store(0, gpu, cpu, **GROUPS), errors.TransferSizeMismatch, "need 4 CPU")
        rejected(state, load(0, cpu, gpu, **GROUPS), errors.TransferSizeMismatch, "need 4 CPU")
    # stateless shape rules
    bad_sum = {"group_sizes": (3, 4), "block_indices": (0, 0)}
    rejected(state, store(0, gpu, [1, 2], **bad_sum), errors.InvalidEvent, "sum to 7")
    one_index = {"group_sizes": (3, 5), "block_indices": (0,)}
    rejected(state, load(0, [1, 2], gpu, **one_index), errors.InvalidEvent, "one of each")


def test_a_partial_chunk_is_fine_with_groups_and_refused_by_the_seed_rule() -> None:
    state = make(block_size_factor=4)
    run(state, alloc("A", 1, 2, 3))
    rejected(state, store(0, [1, 2, 3], [6]), errors.TransferSizeMismatch)
    partial = store(0, [1, 2, 3], [6], group_sizes=(3,), block_indices=(8,))
    assert run(state, partial) == [plan(0, "store", [(1, 24), (2, 25), (3, 26)])]
    # without groups a load skips the first (-3) % 4 = 1 sub-block of its first CPU block
    assert run(state, load(1, [7], [9, 10, 11])) == [plan(1, "load", [(29, 9), (30, 10), (31, 11)])]


# -- 5. quarantine_released ------------------------------------------------------------------
def test_blocks_released_this_step_are_no_destination_at_its_decision() -> None:
    events = [alloc("A", 1, 2), alloc("B", 9, 10), RequestFinished("A"), StepEnded(step=0)]
    assert run(make(), *events) == [swap(0, [(10, 1), (9, 2)])]
    state = make(quarantine_released=True)
    assert run(state, *events) == [swap(0, [(10, 3), (9, 4)])]
    assert state.quarantined == set()  # released from quarantine after the decision
    # the next step may fill 1 and 2
    assert run(state, alloc("C", 12), StepEnded(step=1)) == [swap(1, [(12, 1), (4, 2)])]


def test_a_quarantined_block_taken_again_this_step_is_no_source() -> None:
    events = [alloc("A", 14), alloc("B", 1), RequestPreempted("A"), alloc("C", 14)]
    assert run(make(), *events, StepEnded(step=0)) == [swap(0, [(14, 2)])]
    state = make(quarantine_released=True)
    assert run(state, *events) == [] and state.quarantined == {14}
    assert run(state, StepEnded(step=0)) == []
    assert run(state, StepEnded(step=1)) == [swap(1, [(14, 2)])]


def test_only_blocks_that_become_free_are_quarantined() -> None:
    state = make(quarantine_released=True, prefix_caching=True)
    run(state, alloc("A", 5, 6), alloc("B", 6, 11), RequestFinished("A"))
    assert state.quarantined == {5}  # 6 is still B's
    plans = run(state, StepEnded(step=0))
    assert plans == [SwapPlan(step=0, pairs=[(11, 1), (6, 2)], padded_to=8, mode="swap")]


def test_the_quarantine_survives_snapshots_and_is_lifted_without_defrag() -> None:
    state = make(quarantine_released=True)
    run(state, alloc("A", 1, 2), alloc("B", 9, 10), RequestFinished("A"))
    copy = restore(snapshot(state))
    assert copy.quarantined == {1, 2} and digest(copy) == digest(state)
    assert run(copy, StepEnded(step=0)) == run(state, StepEnded(step=0))
    assert digest(copy) == digest(state)
    off = make(quarantine_released=True, defrag=False)
    run(off, alloc("A", 1), RequestFinished("A"))
    assert off.quarantined == {1}
    assert run(off, StepEnded(step=0)) == [] and off.quarantined == set()
    check_invariants(off)


def test_a_store_pinned_block_released_and_quarantined_stays_pinned_after_the_step() -> None:
    state = make(quarantine_released=True)
    run(state, alloc("A", 1, 2), alloc("B", 12), store(0, [2], [0]), RequestFinished("A"))
    assert state.quarantined == {1, 2}
    assert run(state, StepEnded(step=0)) == [swap(0, [(12, 3)])]
    assert state.is_pinned(2) and not state.quarantined
    run(state, TransferFinished(job_id=0, success=True))
    assert not state.is_pinned(2)
    check_invariants(state)


def test_a_store_finished_while_its_block_is_quarantined_leaves_it_pinned_until_the_step() -> None:
    state = make(quarantine_released=True)
    run(state, alloc("A", 1, 2, 3), alloc("B", 12), store(0, [2, 3], [0, 1]))
    run(state, RequestFinished("A"))  # 1, 2, 3 quarantined; 2 and 3 also store-pinned
    run(state, TransferFinished(job_id=0, success=True))  # no pin left: quarantine holds them
    assert not any(state.is_pinned(p) for p in (1, 2, 3)) and state.quarantined == {1, 2, 3}
    assert all(frozen(state, p) for p in (1, 2, 3))  # defrag may not touch them yet
    check_invariants(state)  # the bitmap is the pins and the quarantine
    run(state, StepEnded(step=0))
    assert not any(frozen(state, p) for p in (1, 2, 3))
    check_invariants(state)


def frozen(state: Any, physical: int) -> bool:
    """Whether the ``pinned`` bitmap (pins and quarantine: what defrag skips) holds a block."""
    return bool(int(state.pinned[physical >> 6]) >> (physical & 63) & 1)


# -- 6. BlocksReleased (where the schema has it) ---------------------------------------------
@pytest.mark.skipif(BlocksReleased is None, reason="this schema has no BlocksReleased")
def test_released_blocks_leave_the_table_and_wait_in_quarantine() -> None:
    state = make(quarantine_released=True)
    run(state, alloc("A", 1, 2, 3), alloc("B", 11, 12))
    assert run(state, BlocksReleased(req_id="A", block_ids=[3, 1])) == []
    assert state.request_blocks("A") == [2] and state.quarantined == {1, 3}
    rejected(state, BlocksReleased(req_id="A", block_ids=[3]), errors.InvalidEvent, "hold")
    rejected(state, BlocksReleased(req_id="Z", block_ids=[2]), errors.InvalidEvent, "hold")
    # 12 - 0 > 3: destinations skip the quarantined 1 and 3
    assert run(state, StepEnded(step=0)) == [swap(0, [(12, 4), (11, 5)])]
    assert run(state, BlocksReleased(req_id="A", block_ids=[2])) == []
    assert state.live_requests() == ["B"]


@pytest.mark.skipif(BlocksReleased is None, reason="this schema has no BlocksReleased")
def test_releasing_a_block_a_table_holds_twice_drops_one_copy() -> None:
    state = make(prefix_caching=True)
    run(state, alloc("A", 5), alloc("A", 5))  # accepted: the request holds 5 twice
    assert state.request_blocks("A") == [5, 5] and state.refs[5] == 2
    run(state, BlocksReleased(req_id="A", block_ids=[5]))  # check_invariants fails here
    assert state.request_blocks("A") == [5] and state.refs[5] == 1

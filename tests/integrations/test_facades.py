"""Narrative tests of the facades' surface: exact block ids, exact events, exact errors."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from kvlog import replay
from kvlog.errors import (
    BlockInUse,
    BlockOutOfRange,
    ConfigError,
    DuplicateJob,
    InvalidEvent,
    LayoutError,
    TransferSizeMismatch,
    TransferSpecError,
)
from kvlog.events import (
    BlocksAllocated,
    LoadRequested,
    RequestFinished,
    RequestPreempted,
    StepEnded,
    StepPacked,
    StepScheduled,
    StoreRequested,
    TransferBatch,
    unbatched,
)
from kvlog.integrations import (
    OffloadingHandlers,
    OffloadingWorker,
    OnlineDefragmenter,
    derive_num_gpu_blocks,
)
from kvlog.log import LogReader
from kvlog.reducers import initial_state, reduce
from kvlog.reducers import step as step_reducer
from tests.support.seed_reference import SeedDefragmenter, make_hpu_caches, read_tags, write_canary

BS = 4


def make(num_blocks: int = 64, **kwargs: object) -> OnlineDefragmenter:
    env = {"VLLM_DEFRAG_THRESHOLD": "4"}
    defrag = OnlineDefragmenter(environ=env, **kwargs)  # type: ignore[arg-type]
    defrag.initialize(make_hpu_caches(num_blocks, BS), BS)
    return defrag


def events(path: Path, packed: bool = False) -> list[object]:
    """The log's events, the connector's batches event by event, each step the runner's
    path recorded packed (``StepPacked``) as the ``StepScheduled`` it stands for unless
    ``packed``."""
    records = (r for _, r in LogReader(path).records() if type(r).__name__ != "Checkpoint")
    return [
        r.unpacked() if isinstance(r, StepPacked) and not packed else r for r in unbatched(records)
    ]


def test_num_gpu_blocks_comes_from_the_hpu_layout() -> None:
    caches = make_hpu_caches(10, BS)  # 11 * 4 slots: 10 blocks and the pad block
    assert derive_num_gpu_blocks(caches, BS) == 10
    assert derive_num_gpu_blocks(make_hpu_caches(10, BS, mla=True), BS) == 10
    with pytest.raises(LayoutError):
        derive_num_gpu_blocks(caches, 3)
    defrag = OnlineDefragmenter(environ={})
    defrag.initialize(caches, BS)
    config = defrag.session.cache_config()
    assert (config.num_gpu_blocks, config.block_size, config.page_size_bytes) == (10, BS, 128)


def test_the_seed_surface_and_its_attributes() -> None:
    defrag = make()
    assert defrag.enabled and defrag.threshold == 4 and not defrag.graphed
    assert defrag.to_swap_pad_thresholds == [8, 16, 32, 64, 128, 256, 512]
    assert defrag.cache_utils is not None and defrag.cache_utils.kv_caches is not None
    assert defrag.resolve(40) == 40 and defrag.resolve_all([[1, 40]]) == [[1, 40]]
    defrag.update_state({"a": list(range(1, 37)), "b": [40]}, [])
    defrag.defragment()
    assert defrag.last_swap is None
    defrag.update_state({}, ["a"])
    defrag.defragment()
    assert defrag.last_swap is not None and defrag.last_swap.pairs == [(40, 1)]
    assert defrag.resolve(40) == 1 and defrag.unresolve(1) == 40 and defrag.unresolve(40) == 1
    assert defrag.used_blocks == {1: 1}
    assert defrag.req_blocks == {"b": [40]}
    # pads and ids the Engine does not know pass through, as in the seed
    assert defrag.resolve_all([[40, -1], [], [64, 7]]) == [[1, -1], [], [64, 7]]


def test_decisions_equal_the_seed_on_the_same_runner_calls() -> None:
    defrag, seed = make(), SeedDefragmenter(threshold=4)
    seed.initialize(make_hpu_caches(64, BS), BS)
    steps = [
        ({"a": [1, 2, 3], "b": list(range(10, 40)), "c": [50, 51]}, []),
        ({"d": [4, 5]}, ["b"]),
        ({"a": [6]}, []),
        ({}, ["d"]),
        ({"e": [7, 8, 9]}, ["a"]),
    ]
    for new, finished in steps:
        # the seed frees after allocating; both orders give the same decision (DESIGN.md)
        seed.update_state(new, finished)
        expected = seed.defragment()
        defrag.update_state(new, finished)
        defrag.defragment()
        got = [] if defrag.last_swap is None else defrag.last_swap.pairs
        assert got == expected
        tables = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 50, 51]]
        assert defrag.resolve_all(tables) == seed.resolve_all(tables)


def test_update_state_logs_one_step_event_per_runner_step(tmp_path: Path) -> None:
    """The runner's update_state + defragment is one StepScheduled record, standing for
    finished, then preempted releases, then the allocations, then StepEnded."""
    log = tmp_path / "a.kvlog"
    defrag = make(log_path=log)
    defrag.update_state({"a": [1, 2]}, [])
    defrag.defragment()
    defrag.update_state({"b": [1], "c": [2, 3]}, ["a"], preempted_reqs=["x"])
    defrag.defragment()
    defrag.close()
    assert events(log)[1:] == [
        StepScheduled(step=0, allocated={"a": [1, 2]}, finished=[]),
        StepScheduled(step=1, allocated={"b": [1], "c": [2, 3]}, finished=["a"], preempted=["x"]),
    ]
    fine: list[object] = []
    state = initial_state()
    for event in events(log):
        if isinstance(event, StepScheduled):
            fine += step_reducer.expand(state, event)
        reduce(state, event)
    assert fine == [
        BlocksAllocated(req_id="a", block_ids=[1, 2]),
        StepEnded(step=0),
        RequestFinished(req_id="a"),
        RequestPreempted(req_id="x"),
        BlocksAllocated(req_id="b", block_ids=[1]),
        BlocksAllocated(req_id="c", block_ids=[2, 3]),
        StepEnded(step=1),
    ]


def test_a_silent_preemption_is_released_when_its_blocks_are_handed_out(tmp_path: Path) -> None:
    log = tmp_path / "a.kvlog"
    defrag = make(log_path=log)
    defrag.update_state({"a": [1, 2], "b": [3]}, [])
    defrag.update_state({"c": [2, 4]}, [])  # the scheduler preempted a and said nothing
    assert defrag.req_blocks == {"b": [3], "c": [2, 4]}
    defrag.update_state({"b": [3, 5]}, [])  # b resumed with its own block back
    assert defrag.req_blocks == {"b": [3, 5], "c": [2, 4]}
    defrag.close()
    assert events(log)[3:] == [
        RequestPreempted(req_id="a"),
        BlocksAllocated(req_id="c", block_ids=[2, 4]),
        RequestPreempted(req_id="b"),
        BlocksAllocated(req_id="b", block_ids=[3, 5]),
    ]


def test_a_block_a_store_still_reads_is_fenced_when_reused() -> None:
    """vLLM frees a finished request's blocks at once and may hand them out in the same
    step; the store that still reads one runs to the end before the new owner writes
    (fenced when the step applies: ``defragment()``, which the runner calls right after
    ``update_state``, before the forward)."""
    defrag = make(backend="fake")
    worker = OffloadingWorker(defrag, num_cpu_blocks=4)
    executor = defrag.engine.executor
    assert executor is not None
    defrag.update_state({"a": [1, 2]}, [])
    old = np.full(16, 0xA2, np.uint64).tobytes()
    executor.write_gpu_block(2, old)
    assert worker.submit_store(1, [1, 2], [0, 1])
    defrag.update_state({"b": [2]}, ["a"])  # allowed: the store is fenced ...
    defrag.defragment()  # ... when the step applies, before the forward (the runner's order)
    executor.write_gpu_block(2, np.full(16, 0xB2, np.uint64).tobytes())  # b's forward
    worker.wait(None)
    assert [r.job_id for r in worker.get_finished()] == [1]
    assert executor.read_cpu_block(1) == old
    assert defrag.req_blocks == {"b": [2]}


def test_declarations_kept_for_a_batch_come_before_the_defragmenters_step(
    tmp_path: Path,
) -> None:
    """The connector's ``bind`` keeps the step's declarations in the worker's batch for
    ``start_load_kv`` (one record for both). A runner that runs the defragmenter in between
    gets them applied first (``KvCacheSession.keep``): the store is declared before the
    step hands its block to another request, and is fenced there, as the calls one by one
    would have; a poll and a wait apply them too."""
    path = tmp_path / "kept.kvlog"
    env = {"VLLM_DEFRAG_THRESHOLD": "4", "KVLOG_PATH": str(path), "KVLOG_SYNC": "none"}
    defrag = OnlineDefragmenter(environ=env, backend="fake")
    defrag.initialize(make_hpu_caches(64, BS), BS)
    worker = OffloadingWorker(defrag, num_cpu_blocks=4)
    executor = defrag.engine.executor
    assert executor is not None
    defrag.update_state({"a": [1, 2]}, [])
    defrag.defragment()
    old = np.full(16, 0xA2, np.uint64).tobytes()
    executor.write_gpu_block(2, old)
    assert worker.begin_batch()  # as bind leaves it
    worker.declare("store", 1, [1, 2], [0, 1], req_id="a")
    assert defrag.session.engine.view.job(1) is None  # kept
    defrag.update_state({"b": [2]}, ["a"])  # the kept declaration first, then the check
    assert defrag.session.engine.view.job(1) is not None
    defrag.defragment()  # the step fences the store before b's forward writes block 2
    executor.write_gpu_block(2, np.full(16, 0xB2, np.uint64).tobytes())
    assert worker.submit_store(1, [1, 2], [0, 1])  # kept: the store was flushed already
    worker.declare("store", 2, [2], [2], req_id="b")
    defrag.session.poll()  # a poll applies what is kept first
    assert defrag.session.engine.view.job(2) is not None
    worker.end_batch()
    assert worker.submit_store(2, [2], [2])
    worker.wait(None)
    assert sorted(r.job_id for r in worker.get_finished()) == [1, 2]
    assert executor.read_cpu_block(1) == old
    defrag.close()
    kinds = [type(e).__name__ for e in events(path) if type(e).__name__ != "StepEnded"]
    assert kinds == [
        "CacheConfigured",
        "StepScheduled",  # a: [1, 2]
        "StoreRequested",  # job 1, applied before the step that reuses block 2
        "StepScheduled",  # b: [2], a finished; job 1 flushed (submitted, fenced)
        "StoreRequested",  # job 2, applied by the poll, before the finish it found
        "TransferFinished",
        "TransferSubmitted",
        "TransferFinished",
    ], kinds


def test_every_kept_batch_is_applied_before_the_session_goes_on() -> None:
    """``KvCacheSession.keep``: each facade's kept batch is applied, in the order kept,
    before a step's check and its apply, until that facade lets go."""
    defrag = make(backend="cpu")
    session = defrag.session
    calls: list[str] = []

    def first() -> None:
        calls.append("first")

    def second() -> None:
        calls.append("second")

    session.keep(first)
    session.keep(second)
    session.keep(first)  # kept once
    defrag.update_state({"a": [1]}, [])
    assert calls == ["first", "second"]
    session.let_go(first)
    defrag.defragment()
    assert calls == ["first", "second", "second"]
    session.let_go(second)
    defrag.update_state({"b": [2]}, [])
    defrag.defragment()
    assert calls == ["first", "second", "second"]
    assert defrag.req_blocks == {"a": [1], "b": [2]}


def test_a_block_a_load_still_writes_is_refused_and_nothing_changes() -> None:
    defrag = make(backend="fake")
    worker = OffloadingWorker(defrag, num_cpu_blocks=4)
    defrag.update_state({"a": [3]}, [])
    assert worker.submit_load(1, [0], [3])
    defrag.update_state({}, ["a"])
    before = defrag.engine.digest()
    with pytest.raises(BlockInUse):
        defrag.update_state({"b": [3], "c": [4]}, [])
    assert defrag.engine.digest() == before and defrag.req_blocks == {}
    worker.wait(None)
    worker.get_finished()
    defrag.update_state({"b": [3]}, [])
    assert defrag.req_blocks == {"b": [3]}


def test_loaded_blocks_are_held_until_their_request_shows_up() -> None:
    """vLLM loads into a request's blocks before the runner sees the request: the blocks
    count as used (and move with their bytes) until ``update_state`` names them."""
    defrag = make(backend="fake")
    worker = OffloadingWorker(defrag, num_cpu_blocks=4)
    executor = defrag.engine.executor
    assert executor is not None
    for cpu_block, tag in ((0, 0xC0), (1, 0xC1)):
        executor.write_cpu_block(cpu_block, np.full(16, tag, np.uint64).tobytes())
    defrag.update_state({"a": [30]}, [])
    assert worker.submit_load(1, np.array([0, 1]), np.array([20, 21])) is True
    hold = f"{defrag.session.holds.prefix}1"
    assert defrag.session.held_blocks == {20: hold, 21: hold}
    worker.wait({1})
    assert [r.job_id for r in worker.get_finished()] == [1]
    defrag.defragment()  # used {20, 21, 30}: all three move down, bytes and all
    assert defrag.last_swap is not None
    assert defrag.last_swap.pairs == [(30, 1), (21, 2), (20, 3)]
    defrag.update_state({"r": [20, 21, 22]}, [])  # the loaded request is scheduled
    assert defrag.session.held_blocks == {}
    assert defrag.req_blocks == {"a": [30], "r": [20, 21, 22]}
    caches = defrag.cache_utils.kv_caches  # type: ignore[union-attr]
    tables = defrag.resolve_all([[20, 21]])
    assert tables == [[3, 2]]
    assert [read_tags(caches, BS, b) for b in tables[0]] == [{0xC0}, {0xC1}]  # type: ignore[arg-type]


def test_a_runner_request_named_like_a_placeholder_is_a_request() -> None:
    """vLLM accepts client-chosen request ids: a request named like a load's placeholder
    (``kvlog-load-hold-1``) is a request of its own. Placeholders carry a per-session
    random nonce, so the request keeps its blocks and the load's blocks stay held."""
    defrag = make(backend="fake")
    worker = OffloadingWorker(defrag, num_cpu_blocks=4)
    defrag.update_state({"kvlog-load-hold-1": [30, 31]}, [])
    defrag.defragment()
    assert worker.submit_load(1, np.array([0]), np.array([20])) is True
    worker.wait({1})
    worker.get_finished()
    defrag.update_state({"r": [20]}, [])  # the load's request claims block 20
    defrag.defragment()
    assert defrag.session.held_blocks == {}
    assert defrag.req_blocks == {"kvlog-load-hold-1": [30, 31], "r": [20]}
    refs = defrag.used_blocks
    assert all(refs[defrag.resolve(b)] == 1 for b in (30, 31, 20))


def test_worker_results_carry_job_id_success_bytes_and_seconds() -> None:
    defrag = make(backend="cpu")
    worker = OffloadingWorker(defrag, num_cpu_blocks=4, block_size_factor=2)
    defrag.update_state({"a": [5, 6]}, [])
    write_canary(defrag.cache_utils.kv_caches, BS, 5, 0x55)  # type: ignore[union-attr,arg-type]
    assert worker.submit_store(3, [5, 6], [1])
    worker.wait([3])
    (result,) = worker.get_finished()
    assert (result.job_id, result.success, result.transfer_size) == (3, True, 256)
    assert result.transfer_type == ("GPU", "CPU") and result.transfer_time is not None
    assert result.num_bytes == 256 and result.elapsed_s >= 0
    assert worker.get_finished() == []
    worker.shutdown()
    with pytest.raises(TransferSpecError):
        worker.submit_store(4, [5, 6], [2])


def test_handlers_split_results_by_direction() -> None:
    defrag = make(backend="fake")
    handlers = OffloadingHandlers(defrag, num_cpu_blocks=4)
    defrag.update_state({"a": [5, 6]}, [])

    class Spec:
        def __init__(self, ids: list[int]) -> None:
            self.block_ids = np.array(ids, dtype=np.int32)

    assert handlers.gpu_to_cpu_handler.transfer_async(1, (Spec([5]), Spec([0])))
    assert handlers.cpu_to_gpu_handler.transfer_async(2, (Spec([1]), Spec([9])))
    handlers.gpu_to_cpu_handler.wait({1, 2})
    assert [r.job_id for r in handlers.cpu_to_gpu_handler.get_finished()] == [2]
    assert [r.job_id for r in handlers.gpu_to_cpu_handler.get_finished()] == [1]


@pytest.mark.parametrize(
    "spec",
    [np.array([[1, 2]]), np.array([1.5]), ["x"]],
    ids=["2-d", "floats", "strings"],
)
def test_bad_specs_raise_transfer_spec_error(spec: object) -> None:
    worker = OffloadingWorker(make(), num_cpu_blocks=4)
    with pytest.raises(TransferSpecError):
        worker.submit_store(1, spec, [0])


def test_two_kv_cache_groups_follow_vllms_chunk_rule() -> None:
    """vLLM 0.33's GPULoadStoreSpec: per group, skip ``block_indices[g] % blocks_per_chunk``
    sub-blocks of its first CPU block; a partial last CPU block is allowed."""

    class Spec:
        def __init__(self, ids: list[int], sizes: tuple[int, ...], indices: tuple[int, ...]):
            self.block_ids = np.array(ids, dtype=np.int32)
            self.group_sizes, self.block_indices = sizes, indices

    defrag = make(backend="fake")
    worker = OffloadingWorker(defrag, num_cpu_blocks=8, block_size_factor=2)
    defrag.update_state({"a": [1, 2, 3, 4, 5]}, [])
    # group 0: blocks 1, 2, 3 from index 1 -> CPU blocks 4 (sub 1), 5 (subs 0, 1)
    # group 1: blocks 4, 5 from index 0 -> CPU block 6 (subs 0, 1)
    assert worker.submit_store(1, Spec([1, 2, 3, 4, 5], (3, 2), (1, 0)), [4, 5, 6])
    (job,) = defrag.engine.state.store_jobs.values()
    assert job.pairs is not None and job.pairs[1].tolist() == [9, 10, 11, 12, 13]
    with pytest.raises(InvalidEvent):  # a ValueError: one block index per group
        worker.submit_store(2, Spec([1, 2], (1, 1), (0,)), [0, 1])
    with pytest.raises(TransferSizeMismatch):  # group 1 needs a CPU block of its own
        worker.submit_store(3, Spec([1, 2], (1, 1), (0, 0)), [0])


def test_the_cpu_pool_is_fixed_once_the_engine_started() -> None:
    defrag = make()
    defrag.update_state({"a": [1]}, [])
    with pytest.raises(ConfigError):
        OffloadingWorker(defrag, num_cpu_blocks=4)


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["move", "swap"])
def test_warmup_changes_no_byte_and_logs_nothing(tmp_path: Path, prefix_caching: bool) -> None:
    log = tmp_path / "w.kvlog"
    defrag = make(16, prefix_caching=prefix_caching, log_path=log, backend="fake")
    caches = defrag.cache_utils.kv_caches  # type: ignore[union-attr]
    for block in range(17):
        write_canary(caches, BS, block, 100 + block)  # type: ignore[arg-type]
    digest = defrag.engine.digest()
    defrag.warmup()
    assert [read_tags(caches, BS, b) for b in range(17)] == [{100 + b} for b in range(17)]  # type: ignore[arg-type]
    assert defrag.engine.digest() == digest
    defrag.close()
    assert [type(e).__name__ for e in events(log)] == ["CacheConfigured"]


def test_cache_utils_swap_refuses_while_blocks_are_live() -> None:
    defrag = make()
    assert defrag.cache_utils is not None
    defrag.cache_utils.swap([(2, 1)], 8)  # nothing live: allowed (the plugin's warm-up)
    defrag.update_state({"a": [1]}, [])
    with pytest.raises(ConfigError):
        defrag.cache_utils.swap([(2, 1)], 8)


def test_kvlog_path_gets_the_pid_and_never_overwrites_a_log(tmp_path: Path) -> None:
    pattern = str(tmp_path / "server-{pid}.kvlog")
    paths = []
    for _ in range(2):
        defrag = OnlineDefragmenter(environ={"KVLOG_PATH": pattern})
        defrag.initialize(make_hpu_caches(8, BS), BS)
        defrag.update_state({"a": [1]}, [])
        paths.append(defrag.engine.log_path)
        defrag.close()
    pid = os.getpid()
    assert paths == [
        str(tmp_path / f"server-{pid}.kvlog"),
        str(tmp_path / f"server-{pid}.1.kvlog"),
    ]


def test_disabled_defrag_still_records_and_never_swaps(tmp_path: Path) -> None:
    log = tmp_path / "d.kvlog"
    defrag = OnlineDefragmenter(environ={"VLLM_DEFRAG": "0", "KVLOG_PATH": str(log)})
    defrag.initialize(make_hpu_caches(64, BS), BS)
    defrag.update_state({"b": [40]}, [])
    defrag.defragment()
    assert not defrag.enabled and defrag.last_swap is None and defrag.resolve(40) == 40
    defrag.close()
    assert events(log)[1:] == [StepScheduled(step=0, allocated={"b": [40]}, finished=[])]


def test_the_runner_constructor_warmup_swap_and_cache_utils() -> None:
    """vllm-gaudi builds ``OnlineDefragmenter(kv_caches, block_size)``, warms it up, and its
    ``_swap`` calls ``cache_utils(srcs, dsts, caches, block_size)`` with -1 padding."""
    caches = make_hpu_caches(16, BS)
    defrag = OnlineDefragmenter(caches, BS, environ={}, backend="cpu")
    for block in range(17):
        write_canary(caches, BS, block, 100 + block)  # type: ignore[arg-type]
    defrag.warmup()
    assert [read_tags(caches, BS, b) for b in range(17)] == [{100 + b} for b in range(17)]  # type: ignore[arg-type]
    defrag._swap([(5, 2)], 8)  # move mode: 5's bytes now also at 2
    assert read_tags(caches, BS, 2) == {105}  # type: ignore[arg-type]
    assert defrag.cache_utils is not None
    keys = [layer[0] for layer in caches]
    defrag.cache_utils(torch.tensor([6, -1]), torch.tensor([3, -1]), keys, BS)
    assert read_tags([(k, None) for k in keys], BS, 3) == {106}  # type: ignore[arg-type]
    defrag.update_state({"a": [1]}, [])
    with pytest.raises(ConfigError):  # no bookkeeping: never while a block is live
        defrag._swap([(5, 2)], 8)


def test_expedited_loads_and_the_0_33_handler_shape() -> None:
    defrag = make(backend="fake")
    handlers = OffloadingHandlers(defrag, num_cpu_blocks=4)
    worker = handlers.worker
    defrag.update_state({"a": [5]}, [])
    assert worker.submit_load(1, [0], [6], expedited=True)  # vLLM's sync loads
    worker.wait({1})
    assert handlers.gpu_to_cpu_handler.transfer_async(2, [5], [1])  # 0.33: src, dst
    assert handlers.gpu_to_cpu_handler.transfer_async(3, ([5], [2]))  # older: (src, dst)
    worker.wait(None)
    assert sorted(r.job_id for r in worker.get_finished()) == [1, 2, 3]


def test_a_sync_load_into_its_own_requests_blocks_releases_nothing() -> None:
    """vLLM's sync loads: the request is scheduled (and its blocks allocated) in the same step
    as its load. Found under the real scheduler: treating the load's blocks as 'given away'
    released the live request."""
    defrag = make(backend="fake")
    worker = OffloadingWorker(defrag, num_cpu_blocks=4)
    defrag.update_state({"r": [21, 22, 23, 24], "s": [30]}, [])
    worker.declare("load", 1, [2, 3], [21, 22], req_id="r")
    assert defrag.req_blocks == {"r": [21, 22, 23, 24], "s": [30]}
    assert defrag.session.held_blocks == {}
    # another request's load into s's block proves s was preempted (no prefix caching)
    worker.declare("load", 2, [0], [30], req_id="q")
    assert defrag.req_blocks == {"r": [21, 22, 23, 24]}
    assert defrag.session.held_blocks == {30: f"{defrag.session.holds.prefix}2"}
    assert worker.submit_load(1, [2, 3], [21, 22]) and worker.submit_load(2, [0], [30])
    worker.wait(None)
    assert sorted(r.job_id for r in worker.get_finished()) == [1, 2]


def test_an_async_load_into_its_requests_stale_blocks_holds_them() -> None:
    """Found under the real scheduler (found-unheld-load): a request preempted without the
    runner saying so waits for an async load into blocks of its own stale table. Those
    blocks are stale (a waiting request holds nothing), so the load's hold takes them and a
    later release of the stale table cannot free them while the request still waits."""
    defrag = make(backend="fake")
    worker = OffloadingWorker(defrag, num_cpu_blocks=4)
    defrag.update_state({"r": [30, 15, 46, 48]}, [])
    worker.declare("load", 1, [0, 1, 2], [17, 46, 15], req_id="r", sync=False)
    assert defrag.req_blocks == {}  # the whole batch that held 15 and 46 is stale
    assert defrag.session.held_blocks == dict.fromkeys(
        [17, 46, 15], f"{defrag.session.holds.prefix}1"
    )
    defrag.update_state({"q": [30]}, [])
    assert defrag.req_blocks == {"q": [30]}
    assert all(defrag.used_blocks.get(defrag.resolve(b)) for b in (17, 46, 15))


def test_a_facade_log_of_whole_steps_replays_with_canaries_and_counts_its_steps(
    tmp_path: Path,
) -> None:
    """The runner's path logs one step record per step (packed): replay counts every one as a step,
    re-runs its plans on canary-filled tensors (every live block checked), and a what-if
    replays it under another threshold."""
    log = tmp_path / "steps.kvlog"
    defrag = OnlineDefragmenter(
        environ={"VLLM_DEFRAG_THRESHOLD": "2", "KVLOG_PATH": str(log), "KVLOG_SYNC": "none"},
        backend="cpu",
    )
    defrag.initialize(make_hpu_caches(64, BS), BS)
    live: dict[str, list[int]] = {}
    free = list(range(1, 64))
    for step in range(40):
        finished = [r for i, r in enumerate(sorted(live)) if (i + step) % 3 == 0][:2]
        for r in finished:
            free += live.pop(r)
        new = {f"s{step}": [free.pop(0) for _ in range(3)]} if len(free) > 8 else {}
        for r in list(live)[:4]:
            if free:
                new[r] = [free.pop(0)]
        for r, blocks in new.items():
            live.setdefault(r, []).extend(blocks)
        defrag.update_state(new, finished)
        defrag.defragment()
    defrag.close()
    kinds = {type(e).__name__ for e in events(log, packed=True)}
    assert kinds == {"CacheConfigured", "StepPacked"}  # every step checked in bulk
    result = replay(str(log), execute=True)
    assert result.ok and result.recorded is not None and result.recorded.num_steps == 40
    assert result.recorded.num_swap_plans > 0
    num_live = sum(map(len, live.values()))
    assert result.canary is not None and result.canary.ok
    assert result.canary.num_checked >= num_live > 0
    assert replay(str(log), threshold=32).ok


@pytest.mark.parametrize(
    "new_blocks",
    [
        {"f": [1.9, 2.2]},  # once allocated [1, 2]
        {"f": [True]},  # once block 1
        {"f": [3, None]},
        {"f": ["3"]},
        {"f": np.array([[1, 2]])},  # 2-D: once an untyped error
        {"f": torch.tensor([1.0, 2.0])},
    ],
)
def test_update_state_never_casts_a_block_id(new_blocks: dict[str, object]) -> None:
    """A block id is never cast with ``int()``: a float, a bool, a string, None or a 2-D
    array is refused with a typed error and nothing changes."""
    defrag = make(backend="fake")
    defrag.update_state({"a": [5]}, [])
    defrag.defragment()
    before = defrag.engine.digest()
    with pytest.raises(InvalidEvent):
        defrag.update_state(new_blocks, [])  # type: ignore[arg-type]
    assert defrag.engine.digest() == before and defrag.req_blocks == {"a": [5]}


def test_update_state_takes_integer_arrays_and_tensors() -> None:
    defrag = make(backend="fake")
    defrag.update_state({"a": np.array([3, 4], dtype=np.int32), "b": torch.tensor([7])}, [])
    defrag.defragment()
    assert defrag.req_blocks == {"a": [3, 4], "b": [7]}


@pytest.mark.parametrize("table", [[40.7], [1.9, 2], [None], ["1"], [[1, 2]]])
def test_resolve_all_never_casts_a_block_id(table: list[object]) -> None:
    """Every facade entry follows ``Engine.resolve_all``'s rules for lists: integers only,
    never cast (``resolve_all([[40.7]])`` is refused)."""
    defrag = make(backend="fake")
    defrag.update_state({"a": [5]}, [])
    defrag.defragment()
    with pytest.raises(BlockOutOfRange):
        defrag.resolve_all([table])  # type: ignore[list-item]


def test_resolve_refuses_a_float_and_passes_pads_through() -> None:
    defrag = make(backend="fake")
    defrag.update_state({"a": [5]}, [])
    defrag.defragment()
    for bad in (1.9, True, "1"):
        with pytest.raises(BlockOutOfRange):
            defrag.resolve(bad)  # type: ignore[arg-type]
    assert defrag.resolve_all([[-1, 5], [BS * 1000]]) == [[-1, defrag.resolve(5)], [BS * 1000]]


def test_a_facade_selects_the_tail_policy_and_a_byte_budget(tmp_path: Path) -> None:
    """``policy="tail"`` and a budget of four pages (128 bytes each here) by keyword: the
    plan moves the four highest used blocks into the holes from ``num_used`` up (the seed's
    rule fills from block 1), the log's ``CacheConfigured`` carries both, a replay agrees."""
    log = tmp_path / "tail.kvlog"
    defrag = make(policy="tail", max_bytes_per_step=4 * 128, log_path=log)
    config = defrag.engine.config
    assert (config.policy, config.max_bytes_per_step, config.page_size_bytes) == ("tail", 512, 128)
    defrag.update_state({"a": list(range(1, 37)), "b": list(range(40, 50))}, [])
    defrag.defragment()
    assert defrag.last_swap is None  # highest used 49 over 46 used: below the ratio 1.5
    defrag.update_state({}, ["a"])
    defrag.defragment()
    assert defrag.last_swap is not None
    assert defrag.last_swap.pairs == [(49, 10), (48, 11), (47, 12), (46, 13)]
    assert defrag.resolve_all([list(range(40, 50))]) == [[40, 41, 42, 43, 44, 45, 13, 12, 11, 10]]
    defrag.close()
    first = events(log)[0]
    assert (first.policy, first.max_bytes_per_step) == ("tail", 512)  # type: ignore[attr-defined]
    assert replay(str(log)).ok


def test_the_environment_selects_the_tail_policy_and_a_byte_budget() -> None:
    env = {"VLLM_DEFRAG_THRESHOLD": "4", "KVLOG_POLICY": "tail", "KVLOG_MAX_BYTES_PER_STEP": "512"}
    defrag = OnlineDefragmenter(environ=env)
    defrag.initialize(make_hpu_caches(64, BS), BS)
    config = defrag.session.cache_config()
    assert (config.policy, config.max_bytes_per_step, config.threshold) == ("tail", 512, 4)


@pytest.mark.parametrize(
    ("environ", "overrides", "name"),
    [
        ({}, {"policy_min_swaps": 2}, "policy_min_swaps"),  # the seed policy ignores it
        ({"KVLOG_RATIO_LIMIT": "1.2"}, {}, "KVLOG_RATIO_LIMIT"),
        ({"KVLOG_POLICY": "tail"}, {"policy": "seed", "policy_ratio_pct": 120}, "policy_ratio_pct"),
        ({"KVLOG_RATIO_LIMIT": "150"}, {"policy": "tail"}, "KVLOG_RATIO_LIMIT"),  # a percent
        ({"KVLOG_POLICY": "compact"}, {}, "KVLOG_POLICY"),
        ({"KVLOG_MAX_BYTES_PER_STEP": "lots"}, {}, "KVLOG_MAX_BYTES_PER_STEP"),
        ({}, {"max_swaps": 0}, "max_swaps"),
        ({"KVLOG_PAD_SIZES": "16,8"}, {}, "KVLOG_PAD_SIZES"),
        ({}, {"max_bytes_per_step": 100}, "max_bytes_per_step"),  # below one page of 128
    ],
)
def test_facade_policy_values_the_command_line_refuses_are_refused(
    environ: dict[str, str], overrides: dict[str, object], name: str
) -> None:
    """Refused at construction (or when the caches tell the page size), naming the keyword
    or the variable, as ``kvlog synth`` refuses the same values."""
    with pytest.raises(ConfigError) as info:
        defrag = OnlineDefragmenter(environ=environ, **overrides)  # type: ignore[arg-type]
        defrag.initialize(make_hpu_caches(64, BS), BS)
    assert info.value.name == name


# -- OffloadingWorker job ids: fresh ints, each submitted once -----------------------------
def _worker() -> tuple[OnlineDefragmenter, OffloadingWorker]:
    defrag = OnlineDefragmenter(environ={"VLLM_DEFRAG_THRESHOLD": "4"}, backend="fake")
    defrag.initialize(make_hpu_caches(64, 4), 4)
    worker = OffloadingWorker(defrag, num_cpu_blocks=8)
    defrag.update_state({"a": [1, 2, 3]}, [])
    return defrag, worker


@pytest.mark.parametrize("bad", [1, 0, -1])
def test_a_reused_or_lower_job_id_is_refused_not_dropped(bad: int) -> None:
    defrag, worker = _worker()
    assert worker.submit_store(1, [1], [0])
    before = defrag.engine.digest()
    with pytest.raises(DuplicateJob, match=f"job id {bad} is not a fresh one"):
        worker.submit_load(bad, [0], [5])
    with pytest.raises(DuplicateJob):
        worker.submit_store(bad, [2], [1])
    assert defrag.engine.digest() == before
    assert worker.submit_store(2, [2], [1])  # the counter goes on
    worker.wait(None)
    assert sorted(r.job_id for r in worker.get_finished()) == [1, 2]


@pytest.mark.parametrize("bad", [6.7, True, "3", None])
def test_a_job_id_that_is_not_an_int_is_refused(bad: object) -> None:
    defrag, worker = _worker()
    before = defrag.engine.digest()
    with pytest.raises(TransferSpecError, match="job id"):
        worker.submit_store(bad, [1], [0])  # type: ignore[arg-type]
    assert defrag.engine.digest() == before


def test_a_declared_job_is_submitted_once() -> None:
    _, worker = _worker()
    worker.declare("store", 3, [1, 2], [0, 1], req_id="a")
    assert worker.submit_store(3, [1, 2], [0, 1])
    with pytest.raises(DuplicateJob):
        worker.submit_store(3, [1, 2], [0, 1])
    worker.wait(None)
    assert [r.job_id for r in worker.get_finished()] == [3]


def _logged_worker(tmp_path: Path) -> tuple[OnlineDefragmenter, OffloadingWorker, Path]:
    path = tmp_path / "batch.kvlog"
    env = {"VLLM_DEFRAG_THRESHOLD": "4", "KVLOG_PATH": str(path), "KVLOG_SYNC": "none"}
    defrag = OnlineDefragmenter(environ=env, backend="cpu")
    defrag.initialize(make_hpu_caches(64, 4), 4)
    worker = OffloadingWorker(defrag, num_cpu_blocks=8)
    defrag.update_state({"a": [1, 2, 3], "b": [4, 5]}, [])
    defrag.defragment()
    return defrag, worker, path


def _records(path: Path) -> list[object]:
    return [r for _, r in LogReader(path).records() if type(r).__name__ != "Checkpoint"]


def test_a_batched_block_applies_its_calls_as_one_record_at_its_end(tmp_path: Path) -> None:
    defrag, worker, path = _logged_worker(tmp_path)
    with worker.batched():
        worker.declare("store", 0, [1, 2], [0, 1], req_id="a")
        with worker.batched():  # nested: the outer block applies
            worker.declare("store", 1, [4], [2], req_id="b")
        assert defrag.session.engine.view.job(1) is None  # kept, not applied yet
    assert defrag.session.engine.view.job(0) is not None
    assert defrag.session.engine.view.job(1) is not None
    defrag.close()
    (batch,) = [r for r in _records(path) if type(r).__name__ == "TransferBatch"]
    assert [(type(e).__name__, e.job_id) for e in batch.events] == [  # type: ignore[attr-defined]
        ("StoreRequested", 0),
        ("StoreRequested", 1),
    ]


def _step_records(path: Path) -> list[tuple[str, object]]:
    """The records after ``_logged_worker``'s set-up (its configuration and first step):
    a hold as ``("hold", its blocks)``, a batch (or a lone transfer event) as ``("batch",
    [(kind, job id), ...])``."""
    out: list[tuple[str, object]] = []
    for r in _records(path)[2:]:
        if isinstance(r, BlocksAllocated):
            out.append(("hold", r.block_ids))
        elif isinstance(r, (TransferBatch, StoreRequested, LoadRequested)):
            events = r.events if isinstance(r, TransferBatch) else [r]
            out.append(("batch", [(type(e).__name__[:4], e.job_id) for e in events]))
    return out


def test_a_steps_loads_are_held_before_its_declarations_which_are_one_record(
    tmp_path: Path,
) -> None:
    """vLLM's step: stores and a load in job-id order. The load's hold is applied first
    and the three declarations stay one batch (not: a batch of the store before the load,
    the hold, then the rest)."""
    defrag, worker, path = _logged_worker(tmp_path)
    with worker.batched():
        worker.declare_step(
            [
                ("store", 0, [1, 2], [0, 1], "a", None),
                ("load", 1, [5, 6], [10, 11], "c", False),
                ("store", 2, [4], [3], "b", None),
            ]
        )
    assert defrag.session.held_blocks == dict.fromkeys([10, 11], f"{defrag.session.holds.prefix}1")
    defrag.close()
    assert _step_records(path) == [
        ("hold", [10, 11]),
        ("batch", [("Stor", 0), ("Load", 1), ("Stor", 2)]),
    ]


def test_a_load_writing_a_block_another_job_of_its_step_reads_is_held_in_call_order(
    tmp_path: Path,
) -> None:
    """Where a load writes a GPU block another job of the step reads (store 2 reads free
    block 12, which load 1 is about to fill), holding first could reorder what the two do:
    the step goes as the calls one by one would (what was kept, the hold, the rest)."""
    defrag, worker, path = _logged_worker(tmp_path)
    with worker.batched():
        worker.declare_step(
            [
                ("store", 0, [1, 2], [0, 1], "a", None),
                ("load", 1, [5, 6], [12, 13], "c", False),
                ("store", 2, [12], [3], "d", None),
            ]
        )
    defrag.close()
    assert _step_records(path) == [
        ("batch", [("Stor", 0)]),
        ("hold", [12, 13]),
        ("batch", [("Load", 1), ("Stor", 2)]),
    ]


def test_a_bad_spec_in_a_step_holds_and_declares_nothing(tmp_path: Path) -> None:
    defrag, worker, _ = _logged_worker(tmp_path)
    with pytest.raises(TransferSpecError), worker.batched():
        worker.declare_step(
            [
                ("load", 0, [5, 6], [10, 11], "c", False),
                ("store", 1, [4], [[3]], "b", None),  # a nested list: not ids
            ]
        )
    assert defrag.session.held_blocks == {}
    assert defrag.session.engine.view.last_job_id == -1


def test_a_refused_batch_applies_nothing_and_forgets_its_declarations(tmp_path: Path) -> None:
    defrag, worker, _ = _logged_worker(tmp_path)
    with pytest.raises(BlockOutOfRange), worker.batched():
        worker.declare("store", 0, [1, 2], [0, 1], req_id="a")
        worker.declare("store", 1, [4], [99], req_id="b")  # CPU block 99 of 8
    view = defrag.session.engine.view
    assert view.job(0) is None and view.job(1) is None and view.last_job_id == -1
    with pytest.raises(DuplicateJob):  # 0 was never declared: a plain submit of a new id
        worker.submit_store(-1, [1], [0])
    assert worker.submit_store(0, [1, 2], [0, 1])  # a fresh job now, not a declared one
    worker.wait(None)
    assert [r.job_id for r in worker.get_finished()] == [0]


def test_an_exception_inside_a_batch_applies_what_was_kept_before_it(tmp_path: Path) -> None:
    defrag, worker, _ = _logged_worker(tmp_path)
    with pytest.raises(KeyError), worker.batched():
        worker.declare("store", 0, [1, 2], [0, 1], req_id="a")
        raise KeyError("the runner failed")
    assert defrag.session.engine.view.job(0) is not None  # as the call alone would have
    assert worker.submit_store(0, [1, 2], [0, 1])
    worker.wait(None)
    assert [r.job_id for r in worker.get_finished()] == [0]


def test_resolve_follows_every_move_and_refuses_bad_ids_once_fast() -> None:
    """The runner resolves one id at a time, hundreds a step (vllm-gaudi's decode slots and
    prefill blocks): after the first call that takes the books' resolver directly, and it
    still follows defrag's moves, passes pads through and refuses what is not an int."""
    defrag = make(num_blocks=64, backend="cpu")
    defrag.update_state({"a": list(range(1, 9)), "b": [9, 10]}, [])
    defrag.defragment()  # compact: nothing moves
    assert defrag.resolve(9) == 9  # the first call after the start: the fast path now
    defrag.update_state({}, ["a"])
    defrag.defragment()  # b's blocks move down into a's
    moved = defrag.session.engine.view.resolve(9)
    assert moved != 9 and defrag.resolve(9) == moved and defrag.resolve(10) != 10
    assert defrag.resolve(np.int64(9)) == moved  # numpy ints: the checked path, same answer
    assert defrag.resolve(-1) == -1 and defrag.resolve(64 + 5) == 64 + 5  # pads pass
    for bad in (1.9, True, "1"):
        with pytest.raises(BlockOutOfRange):
            defrag.resolve(bad)  # type: ignore[arg-type]

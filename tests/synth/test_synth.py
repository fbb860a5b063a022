"""The synthetic workload: vLLM-like pools, determinism, event order, offload, canaries."""

from __future__ import annotations

import dataclasses
import os
import typing
from collections import defaultdict

import msgspec
import pytest

from kvlog.events import (
    CONFIG_DEFAULTS,
    BlocksAllocated,
    CacheConfigured,
    Checkpoint,
    LoadRequested,
    RequestFinished,
    RequestPreempted,
    StepEnded,
    StoreRequested,
    TransferFinished,
    unbatched,
)
from kvlog.log import LogReader
from kvlog.synth import BlockPool, CpuCache, SynthConfig, run_synth

SMALL = SynthConfig(
    steps=300,
    num_gpu_blocks=256,
    prompt_len_mean=160,
    output_len_mean=48,
    arrival_rate=0.3,
    prefix_len_max_blocks=6,
)
OFFLOAD = SMALL.replace(num_cpu_blocks=96, block_size_factor=2)


def test_synth_config_takes_cache_configured_fields_and_defaults() -> None:
    hints = typing.get_type_hints(SynthConfig)
    defaults = {f.name: f.default for f in dataclasses.fields(SynthConfig)}
    for field in msgspec.structs.fields(CacheConfigured):
        if field.name == "quarantine_released":  # the vLLM connector's, not a synth knob
            assert field.name not in hints
            continue
        assert hints[field.name] == field.type, field.name
        if field.name not in ("num_gpu_blocks", "block_size", "page_size_bytes"):  # geometry
            assert defaults[field.name] == CONFIG_DEFAULTS[field.name] == field.default
    config = SynthConfig(threshold=7, policy="tail", max_bytes_per_step=1 << 20)
    event = config.cache_config()
    assert event == CacheConfigured(
        num_gpu_blocks=config.num_gpu_blocks,
        block_size=config.block_size,
        page_size_bytes=config.page_size_bytes,
        threshold=7,
        policy="tail",
        max_bytes_per_step=1 << 20,
    )
    assert config.replace(pad_sizes=[8, 16]).cache_config(page_size_bytes=4) == (
        msgspec.structs.replace(event, pad_sizes=(8, 16), page_size_bytes=4)
    )


def events(path: str) -> list[object]:
    records = (r for _, r in LogReader(path).records() if not isinstance(r, Checkpoint))
    return list(unbatched(records))  # a poll's finishes are one TransferBatch


# -- pools ---------------------------------------------------------------------------------
def test_block_pool_is_a_fifo_queue_without_the_null_block() -> None:
    pool = BlockPool(6, prefix_caching=False)
    assert pool.allocate(3) == [1, 2, 3]
    pool.free([1, 2])  # freed tail first: 2 then 1
    assert pool.num_free == 4
    assert pool.allocate(4) == [4, 5, 2, 1]
    assert pool.num_free == 0


def test_prefix_hits_leave_the_free_queue_and_eviction_drops_the_hash() -> None:
    pool = BlockPool(5, prefix_caching=True)
    a = pool.allocate(2)
    pool.cache(a[0], "h0")
    pool.cache(a[1], "h1")
    pool.free(a)
    assert pool.lookup(["h0", "h1", "h2"]) == [1, 2]
    assert pool.num_reclaimed_by([1, 2]) == 2
    pool.touch([1])
    assert pool.refs[1] == 1 and pool.num_free == 3
    assert pool.allocate(3) == [3, 4, 2]  # block 2 evicted: its hash goes
    assert pool.lookup(["h0", "h1"]) == [1]
    assert pool.num_evictions == 1


def test_cpu_cache_lru_pins_and_failed_stores() -> None:
    cache = CpuCache(2)
    first = cache.reserve(["a", "b"])
    assert first == [0, 1] and cache.reserve(["c"]) == []  # both pinned by their stores
    assert cache.lookup(["a"]) == []  # not readable before the store finishes
    cache.stored([0], success=True)
    cache.stored([1], success=False)
    assert cache.lookup(["a", "b"]) == [0] and not cache.contains("b")
    assert cache.reserve(["c"]) == [1]  # the failed block is reused first
    cache.stored([1], success=True)
    cache.pin([0])  # a load reads "a"
    assert cache.reserve(["d"]) == [1]  # "c" is evicted, "a" is pinned
    assert cache.lookup(["c"]) == [] and cache.lookup(["a"]) == [0]


# -- runs ----------------------------------------------------------------------------------
def test_same_seed_same_log_other_seed_other_log(tmp_path: str) -> None:
    paths = [os.path.join(tmp_path, f"{i}.kvlog") for i in range(3)]
    a = run_synth(SMALL, paths[0], sync="none")
    b = run_synth(SMALL, paths[1], sync="none")
    c = run_synth(SMALL.replace(seed=1), paths[2], sync="none")
    assert a.final_digest == b.final_digest and events(paths[0]) == events(paths[1])
    assert c.final_digest != a.final_digest
    assert a.num_events == len(events(paths[0]))


def test_steps_follow_the_design_order(tmp_path: str) -> None:
    path = os.path.join(tmp_path, "a.kvlog")
    result = run_synth(OFFLOAD, path, sync="none")
    order = {
        TransferFinished: 0,
        RequestFinished: 1,
        StoreRequested: 2,
        RequestPreempted: 3,
        BlocksAllocated: 3,
        LoadRequested: 3,
    }
    step_events: list[object] = []
    num_steps = 0
    for event in events(path)[1:]:
        if isinstance(event, StepEnded):
            ranks = [order[type(e)] for e in step_events]
            assert ranks == sorted(ranks), f"step {event.step}: {step_events}"
            assert event.step == num_steps
            num_steps += 1
            step_events = []
        else:
            step_events.append(event)
    assert num_steps == OFFLOAD.steps == result.num_steps


def test_offload_delays_freeing_until_the_store_finished(tmp_path: str) -> None:
    path = os.path.join(tmp_path, "a.kvlog")
    result = run_synth(OFFLOAD, path, sync="none")
    assert result.num_stores > 10 and result.num_loads > 0 and result.num_finished > 10
    owner_of_job: dict[int, str] = {}
    tables: dict[str, list[int]] = defaultdict(list)
    finished_jobs: set[int] = set()
    store_of: dict[str, int] = {}
    for event in events(path):
        if isinstance(event, BlocksAllocated):
            tables[event.req_id] += event.block_ids
        elif isinstance(event, StoreRequested):
            req = next(r for r, t in tables.items() if set(event.gpu_block_ids) <= set(t))
            owner_of_job[event.job_id] = req
            store_of[req] = event.job_id
            assert len(event.gpu_block_ids) == 2 * len(event.cpu_block_ids)
        elif isinstance(event, LoadRequested):
            factor = OFFLOAD.block_size_factor
            assert -(-len(event.gpu_block_ids) // factor) == len(event.cpu_block_ids)
        elif isinstance(event, TransferFinished):
            finished_jobs.add(event.job_id)
        elif isinstance(event, (RequestFinished, RequestPreempted)):
            if isinstance(event, RequestFinished) and event.req_id in store_of:
                assert store_of[event.req_id] in finished_jobs, f"{event.req_id} freed too early"
            tables.pop(event.req_id, None)


def test_prefix_caching_shares_blocks_and_pressure_preempts(tmp_path: str) -> None:
    path = os.path.join(tmp_path, "a.kvlog")
    config = SMALL.replace(prefix_caching=True, arrival_rate=0.6)
    result = run_synth(config, path, sync="none")
    assert result.num_prefix_hit_blocks > 0 and result.num_preemptions > 0
    live: dict[str, list[int]] = {}
    shared = 0
    preempted: set[str] = set()
    came_back = 0
    for event in events(path):
        if isinstance(event, BlocksAllocated):
            others = {b for r, t in live.items() if r != event.req_id for b in t}
            shared += len(others & set(event.block_ids))
            if event.req_id in preempted and event.req_id not in live:
                came_back += 1
            live.setdefault(event.req_id, []).extend(event.block_ids)
        elif isinstance(event, (RequestFinished, RequestPreempted)):
            live.pop(event.req_id, None)
            if isinstance(event, RequestPreempted):
                preempted.add(event.req_id)
    assert shared > 0 and came_back > 0
    assert 0 not in {b for e in events(path) if isinstance(e, BlocksAllocated) for b in e.block_ids}


def test_simulated_failures_are_logged_and_still_replay(tmp_path: str) -> None:
    from kvlog import replay

    path = os.path.join(tmp_path, "a.kvlog")
    result = run_synth(OFFLOAD.replace(transfer_failure_rate=0.3), path, sync="none")
    assert result.num_failed_transfers > 0
    assert any(isinstance(e, TransferFinished) and not e.success for e in events(path))
    assert replay(path).final_digest == result.final_digest


@pytest.mark.parametrize("backend", ["cpu", "fake"])
def test_execute_keeps_every_block_its_own_bytes(tmp_path: str, backend: str) -> None:
    path = os.path.join(tmp_path, "a.kvlog")
    config = OFFLOAD.replace(prefix_caching=backend == "fake", check_every=50, steps=200)
    result = run_synth(config, path, execute=True, backend=backend, sync="none")
    assert len(result.canary_checks) == 5  # every 50 steps and at the end
    assert sum(c.num_checked for c in result.canary_checks) > 500
    assert result.canary_ok, [c.failures for c in result.canary_checks if not c.ok]
    assert result.num_stores > 0 and result.num_swapped_blocks > 0

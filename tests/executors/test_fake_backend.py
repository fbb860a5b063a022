"""The fake asynchronous backend: deferred copies, late and out-of-order completions, seeds."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvlog.events import SwapPlan
from kvlog.executors import Executor, FakeDevice, TransferCompletion, make_executor
from tests.support.executor_helpers import config_for, load_plan, make_kv_caches, store_plan

N, BS, CPU = 16, 2, 4


def fake(seed: int = 0, **options: Any) -> Executor:
    kv_caches, layout = make_kv_caches("hpu_fp8_scales", N, BS, torch.device("cpu"), seed)
    config = config_for(N, BS, CPU, 1)
    return make_executor(kv_caches, config, backend="fake", layout=layout, seed=seed, **options)


def polls_until_done(executor: Executor) -> list[list[int]]:
    """Job ids returned by each poll() until nothing is in flight."""
    history: list[list[int]] = []
    while executor.jobs_in_flight:
        history.append([r.job_id for r in executor.poll()])
        assert len(history) < 100, "fake jobs never finish"
    return history


def test_a_store_reads_its_source_when_it_completes_not_when_submitted() -> None:
    executor = fake()
    original = executor.read_gpu_block(5)
    executor.execute(store_plan(1, [5], [0], 1))
    assert executor.read_cpu_block(0) == bytes(executor.page_size_bytes)  # nothing copied yet
    # defrag without pins: block 5 moves away and block 12 moves into it while in flight
    executor.execute(SwapPlan(step=1, pairs=[(5, 1)], padded_to=8, mode="move"))
    intruder = executor.read_gpu_block(12)
    executor.execute(SwapPlan(step=2, pairs=[(12, 5)], padded_to=8, mode="move"))
    (result,) = executor.wait([1])
    assert result.success  # the copy "worked" ...
    assert executor.read_cpu_block(0) == intruder != original  # ... on the wrong bytes


def test_a_load_lands_only_at_completion() -> None:
    executor = fake(seed=2)
    executor.write_cpu_block(3, b"\x07" * executor.page_size_bytes)
    before = executor.read_gpu_block(9)
    executor.execute(load_plan(1, [3], [9], 1))
    assert executor.read_gpu_block(9) == before and executor.jobs_in_flight == [1]
    executor.wait()
    assert executor.read_gpu_block(9) == b"\x07" * executor.page_size_bytes


def test_completions_arrive_late_after_a_seeded_number_of_polls() -> None:
    needed = set()
    for seed in range(12):
        executor = fake(seed, max_delay_polls=5)
        executor.execute(store_plan(1, [2], [0], 1))
        history = polls_until_done(executor)
        assert history[-1] == [1] and all(ids == [] for ids in history[:-1])
        needed.add(len(history))
    assert min(needed) >= 1 and len(needed) > 1, f"delays do not vary: {needed}"


def test_directions_complete_out_of_order_but_each_direction_in_order() -> None:
    overtaken = 0
    for seed in range(20):
        executor = fake(seed)
        executor.execute(store_plan(1, [2], [0], 1))
        executor.execute(store_plan(2, [3], [1], 1, after=1))
        executor.execute(load_plan(3, [2], [7], 1))
        history = polls_until_done(executor)
        finished_at = {job: i for i, ids in enumerate(history) for job in ids}
        assert finished_at[1] <= finished_at[2], f"seed {seed}: store 2 overtook store 1"
        for ids in history:
            assert ids == sorted(ids), f"seed {seed}: one poll out of submit order {ids}"
        overtaken += finished_at[3] < finished_at[1]
    assert overtaken > 0, "a later load never finished before an earlier store"


def test_a_job_waits_for_the_previous_job_of_its_direction() -> None:
    for seed in range(10):
        executor = fake(seed, max_delay_polls=6)
        executor.write_cpu_block(0, b"\x01" * executor.page_size_bytes)
        executor.write_cpu_block(1, b"\x02" * executor.page_size_bytes)
        executor.execute(load_plan(1, [0], [4], 1))
        executor.execute(load_plan(2, [1], [4], 1, after=1))  # same block, later job wins
        executor.wait([2])
        assert executor.read_gpu_block(4) == b"\x02" * executor.page_size_bytes, seed


def test_the_same_seed_gives_the_same_completions() -> None:
    def run(seed: int) -> list[list[int]]:
        executor = fake(seed)
        for job_id in range(1, 7):
            after = job_id - 2 if job_id > 2 else -1
            if job_id % 2:
                executor.execute(store_plan(job_id, [job_id], [job_id % CPU], 1, after))
            else:
                executor.execute(load_plan(job_id, [job_id % CPU], [job_id + 8], 1, after))
        return polls_until_done(executor)

    assert run(7) == run(7)
    assert len({str(run(seed)) for seed in range(6)}) > 1


def test_recycled_events_never_deadlock_a_long_queue() -> None:
    executor = fake(seed=4, max_delay_polls=3)
    results: list[TransferCompletion] = []
    for job_id in range(60):
        executor.execute(store_plan(job_id, [job_id % N], [job_id % CPU], 1, after=job_id - 1))
        if job_id % 3 == 0:
            results += executor.poll()
    results += executor.wait()
    assert [r.job_id for r in results] == list(range(60))
    assert all(r.success for r in results)


def test_a_failing_query_is_reported_not_raised() -> None:
    class BrokenQuery(FakeDevice):
        def query(self, event: Any) -> bool:
            raise RuntimeError("device lost")

    kv_caches, layout = make_kv_caches("block_major", N, BS, torch.device("cpu"))
    executor = make_executor(
        kv_caches, config_for(N, BS, CPU), backend=BrokenQuery(), layout=layout
    )
    executor.execute(store_plan(1, [1], [0], 1))
    (result,) = executor.poll()
    assert not result.success and "device lost" in result.error


def test_fake_options_are_checked() -> None:
    with pytest.raises(ValueError, match="max_delay_polls"):
        FakeDevice(max_delay_polls=0)
    with pytest.raises(ValueError, match="failure_rate"):
        FakeDevice(failure_rate=1.5)

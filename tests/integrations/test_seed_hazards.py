"""The two seed hazards, shown on the plain restatement of the seed, then absent in kvlog.

1. Offload with unresolved ids after a swap: the seed handler indexes the GPU tensors with
   the scheduler's logical ids, so once defrag has moved a block, a store reads whatever
   now sits at the old place (here: another request's KV).
2. A swap that lands on blocks a deferred store has yet to read: the seed defragmenter does
   not know about transfers, so it moves a used block into a block whose store has not run
   yet; the late copy then stores the wrong bytes.

Each scenario runs the same runner calls on two drivers: the seed restatement
(``tests/support/seed_reference.py``) and kvlog's facades (fake backend: late, out-of-order copies).
The seed run must show the corruption (asserted); the kvlog run must not.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import pytest
import torch

from kvlog.integrations import OffloadingWorker, OnlineDefragmenter
from tests.support.seed_reference import (
    SeedDefragmenter,
    SeedOffloadHandler,
    block_rows,
    cache_tensors,
    make_hpu_caches,
    row_tags,
    write_canary,
)

NUM_BLOCKS = 64
BLOCK_SIZE = 4
THRESHOLD = 4
NUM_CPU_BLOCKS = 8


class Driver(Protocol):
    """The runner's view of a defragmenter plus an offload store handler."""

    kv_caches: list[tuple[torch.Tensor, torch.Tensor | None]]

    def step(self, new_blocks: dict[str, list[int]], finished: Sequence[str]) -> None: ...
    def resolve(self, block_id: int) -> int: ...
    def store(self, job_id: int, gpu_block_ids: list[int], cpu_block_ids: list[int]) -> None: ...
    def finish(self) -> None: ...
    def cpu_tags(self, cpu_block_id: int) -> set[int]: ...


class SeedDriver:
    """The seed: ``OnlineDefragmenter`` + ``CacheSwapUtils`` + a deferred store handler."""

    def __init__(self, prefix_caching: bool) -> None:
        self.kv_caches = make_hpu_caches(NUM_BLOCKS, BLOCK_SIZE)
        self.defrag = SeedDefragmenter(threshold=THRESHOLD, prefix_caching=prefix_caching)
        self.defrag.initialize(self.kv_caches, BLOCK_SIZE)
        gpu = [block_rows(t, BLOCK_SIZE) for t in cache_tensors(self.kv_caches)]
        self.cpu = [torch.zeros((NUM_CPU_BLOCKS, g.shape[1]), dtype=torch.int8) for g in gpu]
        self.handler = SeedOffloadHandler(gpu, self.cpu, 1, gpu_to_cpu=True, deferred=True)

    def step(self, new_blocks: dict[str, list[int]], finished: Sequence[str]) -> None:
        self.defrag.update_state(new_blocks, finished)
        self.defrag.defragment()

    def resolve(self, block_id: int) -> int:
        return self.defrag.resolve(block_id)

    def store(self, job_id: int, gpu_block_ids: list[int], cpu_block_ids: list[int]) -> None:
        spec = (_Spec(gpu_block_ids), _Spec(cpu_block_ids))
        assert self.handler.transfer_async(job_id, spec)

    def finish(self) -> None:
        self.handler.get_finished()

    def cpu_tags(self, cpu_block_id: int) -> set[int]:
        tags: set[int] = set()
        for rows in self.cpu:
            tags |= row_tags(rows[cpu_block_id])
        return tags


class KvlogDriver:
    """kvlog: the defragmenter facade and the offloading worker on one Engine, fake backend."""

    def __init__(self, prefix_caching: bool, seed: int = 0) -> None:
        self.kv_caches = make_hpu_caches(NUM_BLOCKS, BLOCK_SIZE)
        self.defrag = OnlineDefragmenter(
            prefix_caching=prefix_caching,
            environ={},
            threshold=THRESHOLD,
            backend="fake",
            executor_options={"seed": seed},
        )
        self.defrag.initialize(self.kv_caches, BLOCK_SIZE)
        self.worker = OffloadingWorker(self.defrag, NUM_CPU_BLOCKS)
        self.swaps: list[list[tuple[int, int]]] = []
        self.pending_at_step: list[list[int]] = []

    def step(self, new_blocks: dict[str, list[int]], finished: Sequence[str]) -> None:
        """update_state + defragment, noting which jobs were still in flight at StepEnded."""
        self.defrag.update_state(new_blocks, finished)
        session = self.defrag.session
        real_poll = session.poll

        def poll_then_note() -> None:  # defragment() polls (jobs in flight), then steps
            real_poll()
            self.pending_at_step.append(session.engine.state.jobs_in_flight())

        session.poll = poll_then_note  # type: ignore[method-assign]
        noted = len(self.pending_at_step)
        try:
            self.defrag.defragment()
        finally:
            del session.poll
        if len(self.pending_at_step) == noted:  # no job in flight: defragment() polls not
            self.pending_at_step.append(session.engine.state.jobs_in_flight())
        if self.defrag.last_swap is not None:
            self.swaps.append([tuple(p) for p in self.defrag.last_swap.pairs])

    def resolve(self, block_id: int) -> int:
        return self.defrag.resolve(block_id)

    def store(self, job_id: int, gpu_block_ids: list[int], cpu_block_ids: list[int]) -> None:
        assert self.worker.submit_store(job_id, _Spec(gpu_block_ids), _Spec(cpu_block_ids))

    def finish(self) -> None:
        self.worker.wait(None)
        assert all(r.success for r in self.worker.get_finished())

    def cpu_tags(self, cpu_block_id: int) -> set[int]:
        executor = self.defrag.engine.executor
        return {int(w) for w in np.frombuffer(executor.read_cpu_block(cpu_block_id), np.uint64)}


class _Spec:
    """vLLM's ``BlockIDsLoadStoreSpec`` shape: an int64 array ``block_ids``."""

    def __init__(self, block_ids: list[int]) -> None:
        self.block_ids = np.array(block_ids, dtype=np.int64)


def write(driver: Driver, req_tags: dict[int, int]) -> None:
    """The model's forward: KV of each logical block lands at its resolved physical block."""
    for logical, tag in req_tags.items():
        write_canary(driver.kv_caches, BLOCK_SIZE, driver.resolve(logical), tag)


TAG_A, TAG_B, TAG_C, TAG_F = 0xA000, 0xB000, 0xC000, 0xF000


def hazard_unresolved_store(driver: Driver) -> set[int]:
    """Store request b's block after defrag moved it; returns the tags the CPU block got."""
    filler = list(range(1, 37))
    driver.step({"a": filler, "b": [40]}, [])  # 40 - 4 > 37 is false: no defrag yet
    write(driver, {b: TAG_A + i for i, b in enumerate(filler)} | {40: TAG_B})
    driver.step({}, ["a"])  # used = {40}: defrag moves b's block 40 down to 1
    driver.step({"c": filler}, [])  # the scheduler hands a's freed ids to c; no defrag
    write(driver, {b: TAG_C + i for i, b in enumerate(filler)})
    driver.store(7, [40], [0])  # b's block, by the scheduler's (logical) id
    driver.finish()
    return driver.cpu_tags(0)


def hazard_swap_onto_deferred_store(driver: Driver) -> set[int]:
    """Store a's blocks, let a finish before the copy runs; returns the first CPU block's tags."""
    filler = list(range(4, 39))
    driver.step({"a": [1, 2, 3], "f": filler, "b": [40]}, [])  # 40 - 4 > 39 is false
    write(driver, {1: TAG_A, 2: TAG_A + 1, 3: TAG_A + 2, 40: TAG_B})
    write(driver, {b: TAG_F + i for i, b in enumerate(filler)})
    driver.store(8, [1, 2, 3], [0, 1, 2])  # deferred: the copy runs late
    driver.step({}, ["a", "f"])  # used = {40}: defrag wants 40 -> 1, where a's store reads
    driver.finish()
    return driver.cpu_tags(0)


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["move", "swap"])
def test_seed_store_with_unresolved_ids_is_corrupt(prefix_caching: bool) -> None:
    driver = SeedDriver(prefix_caching)
    tags = hazard_unresolved_store(driver)
    assert driver.defrag.swaps == [[(40, 1)]]
    assert driver.resolve(40) == 1 and driver.resolve(1) == 40
    assert tags == {TAG_C}, "the seed stored request c's KV under request b's block"


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["move", "swap"])
def test_seed_swap_onto_deferred_store_is_corrupt(prefix_caching: bool) -> None:
    driver = SeedDriver(prefix_caching)
    tags = hazard_swap_onto_deferred_store(driver)
    assert driver.defrag.swaps == [[(40, 1)]]
    assert tags == {TAG_B}, "the seed's late store copied b's KV instead of a's"


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("prefix_caching", [False, True], ids=["move", "swap"])
def test_kvlog_store_resolves_logical_ids(prefix_caching: bool, seed: int) -> None:
    driver = KvlogDriver(prefix_caching, seed)
    tags = hazard_unresolved_store(driver)
    assert driver.swaps == [[(40, 1)]], "kvlog takes the seed's defrag decision"
    assert driver.resolve(40) == 1
    assert tags == {TAG_B}


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["move", "swap"])
def test_kvlog_defrag_never_lands_on_a_pending_store(prefix_caching: bool) -> None:
    """Over several fake-device seeds the store is sometimes still in flight at the step
    (then 1-3 are pinned and 40 goes to 4) and sometimes done (then 40 may go to 1)."""
    outcomes = set()
    for seed in range(6):
        driver = KvlogDriver(prefix_caching, seed)
        tags = hazard_swap_onto_deferred_store(driver)
        pending = 8 in driver.pending_at_step[1]
        outcomes.add(pending)
        assert driver.swaps == [[(40, 4 if pending else 1)]]
        assert tags == {TAG_A}, f"seed {seed}: kvlog stored the wrong bytes"
        assert [driver.cpu_tags(c) for c in (1, 2)] == [{TAG_A + 1}, {TAG_A + 2}]
    assert True in outcomes, "no seed kept the store in flight: the test lost its point"

"""kvlog's reducers against the plain seed restatement in tests/seed_model.py, pair for pair.

The same events go to ``reduce`` and to :class:`SeedDefragmenter` (plus the seed transfer
expansion, with GPU ids resolved through the seed's tables at submit time). Every
``SwapPlan`` must equal the seed's ``to_swap`` with its pad bucket and mode, every
``TransferPlan`` the seed's ``src_to_dst``, and the resolved tables and ref counts must agree.
Hypothesis drives short programs; a few long seeded workloads run thousands of steps.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
from hypothesis import given
from seed_model import SeedDefragmenter, seed_transfer_pairs
from strategies import random_program, reducer_programs

from kvlog.events import (
    BlocksAllocated,
    CacheConfigured,
    Event,
    LoadRequested,
    Plan,
    RequestFinished,
    RequestPreempted,
    StepEnded,
    StoreRequested,
    SwapPlan,
    TransferFinished,
    TransferPlan,
)
from kvlog.reducers import State, check_invariants, initial_state, reduce


@dataclass
class SeedSide:
    """The seed defragmenter plus the jobs in flight, in the seed's physical ids."""

    config: CacheConfigured
    seed: SeedDefragmenter
    jobs: dict[int, tuple[str, list[int]]] = field(default_factory=dict)

    @classmethod
    def for_config(cls, config: CacheConfigured) -> SeedSide:
        seed = SeedDefragmenter(
            threshold=config.threshold,
            pad_sizes=config.pad_sizes,
            max_swaps=config.max_swaps,
            enabled=config.defrag,
        )
        return cls(config, seed)

    def pinned(self) -> frozenset[int]:
        return frozenset(b for _, blocks in self.jobs.values() for b in blocks)

    def expected(self, event: Event) -> list[Plan]:
        """What the seed (with kvlog's pin rule) plans for ``event``; updates the seed."""
        if isinstance(event, BlocksAllocated):
            self.seed.allocate(event.req_id, event.block_ids)
        elif isinstance(event, (RequestFinished, RequestPreempted)):
            self.seed.release(event.req_id)
        elif isinstance(event, StepEnded):
            pairs = self.seed.defragment(self.pinned())
            if pairs:
                mode = "swap" if self.config.prefix_caching else "move"
                return [SwapPlan(event.step, pairs, self.seed.pad_to(len(pairs)), mode)]
        elif isinstance(event, (StoreRequested, LoadRequested)):
            return [self._transfer(event)]
        elif isinstance(event, TransferFinished):
            del self.jobs[event.job_id]
        return []

    def _transfer(self, event: StoreRequested | LoadRequested) -> TransferPlan:
        kind = "store" if isinstance(event, StoreRequested) else "load"
        gpu = [self.seed.resolve(b) for b in event.gpu_block_ids]
        pairs = seed_transfer_pairs(kind, gpu, event.cpu_block_ids, self.config.block_size_factor)
        assert pairs is not None, "the generator only makes transfers that fit"
        same_way = [j for j, (k, _) in self.jobs.items() if k == kind]
        self.jobs[event.job_id] = (kind, gpu)
        num_bytes = len(pairs) * self.config.page_size_bytes
        return TransferPlan(event.job_id, kind, pairs, num_bytes, max(same_way, default=-1))

    def assert_agrees(self, state: State) -> None:
        """Same resolved tables, same ref counts, same live requests."""
        seed = self.seed
        assert state.live_requests() == sorted(seed.req_blocks)
        for req_id, table in seed.req_blocks.items():
            assert state.request_blocks(req_id) == table
            assert [state.resolve(b) for b in table] == [seed.resolve(b) for b in table]
        refs = {int(b): int(state.refs[b]) for b in state.refs.nonzero()[0]}
        assert refs == seed.used_blocks
        assert state.num_used == len(seed.used_blocks)
        assert state.max_used == max(seed.used_blocks, default=-1)


def run_both(events: list[Event], check_every: int = 1) -> dict[str, int]:
    """Feed ``events`` to both sides, comparing every plan; a few counts for the caller."""
    config = events[0]
    assert isinstance(config, CacheConfigured)
    side = SeedSide.for_config(config)
    state = initial_state()
    counts = {"swaps": 0, "pairs": 0, "capped": 0, "transfers": 0}
    for i, event in enumerate(events):
        state, plans = reduce(state, event)
        expected = [] if isinstance(event, CacheConfigured) else side.expected(event)
        assert plans == expected, f"event {i}: {event}"
        for plan in plans:
            if isinstance(plan, SwapPlan):
                counts["swaps"] += 1
                counts["pairs"] += len(plan.pairs)
                counts["capped"] += len(plan.pairs) == config.max_swaps
            else:
                counts["transfers"] += 1
        if i % check_every == 0 or i == len(events) - 1:
            side.assert_agrees(state)
            check_invariants(state)
    return counts


@given(reducer_programs(transfers=False))
def test_defrag_decisions_equal_the_seed(events: list[Event]) -> None:
    run_both(events)


@given(reducer_programs())
def test_defrag_with_pins_and_transfers_equal_the_seed_model(events: list[Event]) -> None:
    run_both(events)


LONG_WORKLOADS = [
    # seed, config, events: thousands of steps each
    (
        1,
        CacheConfigured(
            num_gpu_blocks=512, block_size=16, num_cpu_blocks=64, block_size_factor=2, threshold=8
        ),
        12_000,
    ),
    (
        2,
        CacheConfigured(
            num_gpu_blocks=2048, block_size=128, num_cpu_blocks=256, prefix_caching=True
        ),
        12_000,
    ),
    (
        3,
        CacheConfigured(
            num_gpu_blocks=4096,
            block_size=16,
            threshold=4,
            max_swaps=16,
            pad_sizes=(4, 16),
            page_size_bytes=4096,
        ),
        15_000,
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize(("seed", "config", "num_events"), LONG_WORKLOADS)
def test_long_seeded_workloads_equal_the_seed(
    seed: int, config: CacheConfigured, num_events: int
) -> None:
    events = random_program(random.Random(seed), config, num_events, transfers=seed != 3)
    num_steps = sum(isinstance(e, StepEnded) for e in events)
    counts = run_both(events, check_every=500)
    assert num_steps >= 2000
    assert counts["swaps"] >= 100 and counts["pairs"] >= 1000, counts
    if seed == 3:
        assert counts["capped"] >= 10, counts
    else:
        assert counts["transfers"] >= 100, counts

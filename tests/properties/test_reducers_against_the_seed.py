"""kvlog's reducers against the plain seed restatement (tests/support/seed_model.py), pair
for pair.

The same events go to ``reduce`` and to :class:`SeedDefragmenter` (plus the seed transfer
expansion, or vLLM 0.33's chunk rule for specs with KV-cache groups, with GPU ids resolved
through the seed's tables when the transfer is requested). Every ``SwapPlan`` must equal the
seed's ``to_swap`` with its pad bucket and mode, every ``TransferPlan`` the seed's
``src_to_dst``, and the resolved tables and ref counts must agree.

The seed knows none of kvlog's transfer rules; :class:`SeedSide` adds them on top of the
seed, plainly: deferred jobs plan at ``TransferSubmitted``; allocating a free block a store
still reads plans the deferred readers and a ``FencePlan``; a store and a load sharing a
GPU block run in submission order (each plan fences the submitted jobs of the other
direction on its blocks); quarantined blocks (with
``quarantine_released``) join the pinned set of the next decision. Probes along the way ask
``reduce`` for what the seed side refuses (allocating a block a load writes, CPU sub-blocks
shared by a store and a load, finishing a job before it is submitted): each must raise and
change nothing. Hypothesis drives short programs; a few long seeded workloads run thousands
of steps.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
from hypothesis import event as note_event
from hypothesis import given

from kvlog import errors
from kvlog.events import (
    BlocksAllocated,
    CacheConfigured,
    Event,
    FencePlan,
    LoadRequested,
    Plan,
    RequestFinished,
    RequestPreempted,
    StepEnded,
    StoreRequested,
    SwapPlan,
    TransferFinished,
    TransferPlan,
    TransferSubmitted,
)
from kvlog.reducers import State, check_invariants, digest, initial_state, reduce
from tests.support.seed_model import SeedDefragmenter, chunk_transfer_pairs, seed_transfer_pairs
from tests.support.strategies import random_program, reducer_programs


@dataclass
class SeedJob:
    """A job in flight, in the seed's physical ids."""

    kind: str
    gpu: list[int]
    pairs: list[tuple[int, int]]
    submitted: bool

    @property
    def cpu_subs(self) -> set[int]:
        return {dst if self.kind == "store" else src for src, dst in self.pairs}


@dataclass
class SeedSide:
    """The seed defragmenter plus kvlog's transfer rules, in the seed's physical ids."""

    config: CacheConfigured
    seed: SeedDefragmenter
    jobs: dict[int, SeedJob] = field(default_factory=dict)
    quarantined: set[int] = field(default_factory=set)

    @classmethod
    def for_config(cls, config: CacheConfigured) -> SeedSide:
        seed = SeedDefragmenter(
            threshold=config.threshold,
            pad_sizes=config.pad_sizes,
            max_swaps=config.max_swaps,
            enabled=config.defrag,
        )
        return cls(config, seed)

    def pinned(self, kind: str | None = None) -> frozenset[int]:
        return frozenset(
            b for job in self.jobs.values() if kind in (None, job.kind) for b in job.gpu
        )

    def expected(self, event: Event) -> list[Plan]:
        """What the seed (with kvlog's rules) plans for ``event``; updates the seed."""
        if isinstance(event, BlocksAllocated):
            return self._allocate(event)
        if isinstance(event, (RequestFinished, RequestPreempted)):
            table = self.seed.req_blocks.get(event.req_id, [])
            physical = [self.seed.resolve(b) for b in table]
            self.seed.release(event.req_id)
            if self.config.quarantine_released:
                self.quarantined |= {p for p in physical if self.seed.ref_count(p) == 0}
        elif isinstance(event, StepEnded):
            pairs = self.seed.defragment(self.pinned() | self.quarantined)
            self.quarantined.clear()
            if pairs:
                mode = "swap" if self.config.prefix_caching else "move"
                return [SwapPlan(event.step, pairs, self.seed.pad_to(len(pairs)), mode)]
        elif isinstance(event, (StoreRequested, LoadRequested)):
            return self._transfer(event)
        elif isinstance(event, TransferSubmitted):
            job = self.jobs[event.job_id]
            return [] if job.submitted else self._plan(event.job_id)
        elif isinstance(event, TransferFinished):
            assert self.jobs[event.job_id].submitted
            del self.jobs[event.job_id]
        return []

    def _allocate(self, event: BlocksAllocated) -> list[Plan]:
        physical = [self.seed.resolve(b) for b in event.block_ids]
        loading, reading = self.pinned("load"), self.pinned("store")
        assert not loading & set(physical), "the generator never allocates a block a load writes"
        reused = {p for p in physical if self.seed.ref_count(p) == 0 and p in reading}
        self.seed.allocate(event.req_id, event.block_ids)
        if not reused:
            return []
        readers = [
            j
            for j, job in sorted(self.jobs.items())
            if job.kind == "store" and reused & set(job.gpu)
        ]
        plans = [p for j in readers if not self.jobs[j].submitted for p in self._plan(j)]
        return [*plans, FencePlan(job_ids=readers)]

    def _transfer(self, event: StoreRequested | LoadRequested) -> list[Plan]:
        kind = "store" if isinstance(event, StoreRequested) else "load"
        gpu = [self.seed.resolve(b) for b in event.gpu_block_ids]
        factor = self.config.block_size_factor
        if event.group_sizes:
            pairs = chunk_transfer_pairs(
                kind, gpu, event.cpu_block_ids, factor, event.group_sizes, event.block_indices
            )
        else:
            pairs = seed_transfer_pairs(kind, gpu, event.cpu_block_ids, factor)
        assert pairs is not None, "the generator only makes transfers that fit"
        self.jobs[event.job_id] = SeedJob(kind, gpu, pairs, submitted=False)
        return [] if getattr(event, "deferred", False) else self._plan(event.job_id)

    def _plan(self, job_id: int) -> list[Plan]:
        """The job's TransferPlan, after a FencePlan on the submitted jobs of the other
        direction that share one of its blocks (they run in submission order)."""
        job = self.jobs[job_id]
        same_way = [
            j for j, other in self.jobs.items() if other.kind == job.kind and other.submitted
        ]
        job.submitted = True
        num_bytes = len(job.pairs) * self.config.page_size_bytes
        kind = "store" if job.kind == "store" else "load"
        plan = TransferPlan(job_id, kind, job.pairs, num_bytes, max(same_way, default=-1))
        earlier = [
            j
            for j, other in sorted(self.jobs.items())
            if other.kind != job.kind and other.submitted and set(other.gpu) & set(job.gpu)
        ]
        return [FencePlan(job_ids=earlier), plan] if earlier else [plan]

    def refused(self, state: State) -> list[tuple[Event, type[Exception]]]:
        """Events kvlog's rules refuse now, each with its error (the seed would accept them
        all: it has no pins)."""
        f, seed = self.config.block_size_factor, self.seed
        job_id = state.last_job_id + 1
        out: list[tuple[Event, type[Exception]]] = []
        loading, pinned = self.pinned("load"), self.pinned()
        if loading:
            block = seed.unresolve(min(loading))
            out.append((BlocksAllocated(req_id="probe", block_ids=[block]), errors.BlockInUse))
        n = self.config.num_gpu_blocks
        readable = [b for b in range(n) if seed.resolve(b) not in loading][:f]
        writable = [b for b in range(n) if seed.resolve(b) not in pinned][:f]
        loads_read = {s for job in self.jobs.values() if job.kind == "load" for s in job.cpu_subs}
        stores_write = {s for j in self.jobs.values() if j.kind == "store" for s in j.cpu_subs}
        if loads_read and len(readable) == f:
            cpu = [min(loads_read) // f]
            store = StoreRequested(job_id=job_id, gpu_block_ids=readable, cpu_block_ids=cpu)
            out.append((store, errors.BlockInUse))
        if stores_write and len(writable) == f:
            cpu = [max(stores_write) // f]
            load = LoadRequested(job_id=job_id, cpu_block_ids=cpu, gpu_block_ids=writable)
            out.append((load, errors.BlockInUse))
        waiting = [j for j, job in self.jobs.items() if not job.submitted]
        if waiting:
            out.append((TransferFinished(job_id=waiting[0], success=True), errors.UnknownJob))
        return out

    def assert_agrees(self, state: State) -> None:
        """Same resolved tables, same ref counts, same live requests, same jobs."""
        seed = self.seed
        assert state.live_requests() == sorted(seed.req_blocks)
        for req_id, table in seed.req_blocks.items():
            assert state.request_blocks(req_id) == table
            assert [state.resolve(b) for b in table] == [seed.resolve(b) for b in table]
        refs = {int(b): int(state.refs[b]) for b in state.refs.nonzero()[0]}
        assert refs == seed.used_blocks
        assert state.num_used == len(seed.used_blocks)
        assert state.max_used == max(seed.used_blocks, default=-1)
        assert state.jobs_in_flight() == sorted(self.jobs)


def run_both(events: list[Event], check_every: int = 1, probe_every: int = 5) -> dict[str, int]:
    """Feed ``events`` to both sides, comparing every plan, and probe the refusals every
    ``probe_every`` events; a few counts for the caller."""
    config = events[0]
    assert isinstance(config, CacheConfigured)
    side = SeedSide.for_config(config)
    state = initial_state()
    counts = {"swaps": 0, "pairs": 0, "capped": 0, "transfers": 0, "fences": 0, "refused": 0}
    for i, event in enumerate(events):
        state, plans = reduce(state, event)
        expected = [] if isinstance(event, CacheConfigured) else side.expected(event)
        assert plans == expected, f"event {i}: {event}"
        for plan in plans:
            if isinstance(plan, SwapPlan):
                counts["swaps"] += 1
                counts["pairs"] += len(plan.pairs)
                counts["capped"] += len(plan.pairs) == config.max_swaps
            elif isinstance(plan, FencePlan):
                counts["fences"] += 1
            else:
                counts["transfers"] += 1
        if i % check_every == 0 or i == len(events) - 1:
            side.assert_agrees(state)
            check_invariants(state)
        probes = side.refused(state) if probe_every and i % probe_every == 0 and i else []
        if probes:
            before = digest(state)
            for bad, error in probes:
                with pytest.raises(error):
                    reduce(state, bad)
                counts["refused"] += 1
            assert digest(state) == before
    return counts


@given(reducer_programs(transfers=False))
def test_defrag_decisions_equal_the_seed(events: list[Event]) -> None:
    run_both(events)


@given(reducer_programs())
def test_defrag_with_pins_and_transfers_equal_the_seed_model(events: list[Event]) -> None:
    counts = run_both(events)
    for name in ("fences", "refused", "transfers"):
        note_event(f"{name}: {'some' if counts[name] else 'none'}")
    if any(isinstance(e, TransferSubmitted) for e in events):
        note_event("TransferSubmitted")
    if any(isinstance(e, (StoreRequested, LoadRequested)) and e.group_sizes for e in events):
        note_event("grouped transfers")


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
    counts = run_both(events, check_every=500, probe_every=40)
    assert num_steps >= 2000
    assert counts["swaps"] >= 100 and counts["pairs"] >= 1000, counts
    if seed == 3:
        assert counts["capped"] >= 10, counts
    else:
        assert counts["transfers"] >= 100, counts
        assert counts["fences"] >= 10 and counts["refused"] >= 100, counts

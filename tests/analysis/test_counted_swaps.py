"""A counted machine (``Machine.counted_swaps``: replay's tallied lanes, the sweep's
what-ifs, segment replay) counts a whole step's defrag moves instead of listing them in a
``SwapPlan``. The contract: the same state and digests as the machine that lists them, and
the same tally, step by step (pairs, bytes, padded pairs, the cost model's time)."""

from __future__ import annotations

import contextlib

from hypothesis import given, settings
from hypothesis import strategies as st

from kvlog.analysis.cost import CostModel
from kvlog.analysis.tally import RunTally
from kvlog.errors import KvlogError
from kvlog.events import CacheConfigured, Event, StepScheduled, SwapPlan
from kvlog.reducers import State, checkpoint, digest
from kvlog.runtime.machine import Machine
from tests.reducers.test_step_scheduled import NUM_BLOCKS, steps

_Step = tuple[int, int, int, int, int]


def _tallied(counted: bool) -> tuple[Machine, RunTally, list[_Step]]:
    per_step: list[_Step] = []

    def on_step(tally: RunTally, state: State, step: int) -> None:
        t = tally.plans
        per_step.append(
            (step, t.step_blocks_moved, t.step_swap_bytes, t.step_padded_pairs, t.swap_plans)
        )

    tally = RunTally(cost=CostModel(), on_step=on_step)
    machine = Machine(observers=[tally])
    machine.counted_swaps = counted
    return machine, tally, per_step


@settings(deadline=None)
@given(
    program=steps(),
    prefix_caching=st.booleans(),
    quarantine=st.booleans(),
    threshold=st.sampled_from([0, 2, 32]),
)
def test_a_counted_machine_tallies_what_a_listing_one_does(
    program: list[tuple[StepScheduled | Event, ...]],
    prefix_caching: bool,
    quarantine: bool,
    threshold: int,
) -> None:
    config = CacheConfigured(
        num_gpu_blocks=NUM_BLOCKS, block_size=4, num_cpu_blocks=64, threshold=threshold,
        pad_sizes=(2, 4, 8), max_swaps=8, prefix_caching=prefix_caching,
        quarantine_released=quarantine, page_size_bytes=1 << 20,
    )  # fmt: skip
    (listing, listed, listed_steps), (counting, counted, counted_steps) = (
        _tallied(False),
        _tallied(True),
    )
    for machine in (listing, counting):
        machine.apply_decoded(config)
    for event in (e for events in program for e in events):
        got: list[object] = []
        for machine in (listing, counting):
            with contextlib.suppress(KvlogError):
                got.append(machine.apply_decoded(event))
        if type(event) is StepScheduled and len(got) == 2 and counting.state.counted_pairs:
            assert got[1] == [] and [type(p) for p in got[0]] == [SwapPlan]
        assert checkpoint.checkpoint_digest(counting.state) == checkpoint.checkpoint_digest(
            listing.state
        )
    assert digest(counting.state) == digest(listing.state)
    assert counted_steps == listed_steps
    assert counted.plans.swap_bytes == listed.plans.swap_bytes
    assert counted.defrag_s == listed.defrag_s

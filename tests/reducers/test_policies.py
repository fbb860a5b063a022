"""Named defrag policies (kvlog/reducers/policies.py) against a brute-force statement of each
rule, fuzzed over realistic programs like the seed's rule
(tests/properties/test_reducers_against_the_seed.py).

Each program runs through ``reduce``; before every ``StepEnded`` the expected pairs are
computed from the ref counts and the pinned bitmap alone (the policy's trigger, its first
destination, ``max_swaps``, the byte budget, the tail's minimum), and the plan must hold
exactly those pairs. Replays of logs recorded under each policy reach the live digests, and
a what-if replay under a policy equals a recording under it.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvlog import Engine, replay
from kvlog.errors import InvalidEvent
from kvlog.events import (
    BlocksAllocated,
    CacheConfigured,
    Event,
    StepEnded,
    SwapPlan,
    validate_event,
)
from kvlog.reducers import State, check_invariants, initial_state, reduce
from kvlog.reducers.pairing import walk as seed_walk
from kvlog.reducers.policies import compact
from tests.support.strategies import random_program, reducer_programs

POLICY_CHOICES = st.fixed_dictionaries(
    {
        "policy": st.sampled_from(["seed", "tail"]),
        "policy_ratio_pct": st.sampled_from([100, 101, 125, 150, 200, 400]),
        "policy_min_swaps": st.integers(1, 6),
        "max_bytes_per_step": st.sampled_from([0, 0, 1, 64, 100, 256, 1000, 4096]),
    }
)


def pinned_mask(state: State) -> list[bool]:
    """The pinned bitmap (transfers and anything else the reducers pin) as bools."""
    bits = np.unpackbits(state.pinned.view(np.uint8), bitorder="little")
    return [bool(b) for b in bits[: state.num_gpu_blocks]]


def expected_pairs(state: State) -> list[tuple[int, int]]:
    """The configured policy, stated plainly from ref counts and pins."""
    c = state.config
    assert c is not None
    refs = state.refs.tolist()
    pins = pinned_mask(state)
    used = [b for b, r in enumerate(refs) if r > 0]
    if not c.defrag or not used:
        return []
    top, count = used[-1], len(used)
    if c.policy == "tail":
        fires, first = top * 100 > c.policy_ratio_pct * count, max(1, count)
    else:
        fires, first = top - c.threshold > count, 1
    limit = c.max_swaps
    pair_bytes = c.page_size_bytes * (2 if c.prefix_caching else 1)
    if c.max_bytes_per_step and pair_bytes:
        limit = min(limit, c.max_bytes_per_step // pair_bytes)
    if not fires or limit <= 0:
        return []
    sources = [b for b in reversed(used) if not pins[b]]
    holes = (b for b in itertools.count(first) if b >= len(refs) or not (refs[b] or pins[b]))
    pairs: list[tuple[int, int]] = []
    for src, dst in zip(sources, holes, strict=False):
        if len(pairs) == limit or dst > src:
            break
        pairs.append((src, dst))
    if c.policy == "tail" and len(pairs) < min(c.policy_min_swaps, limit):
        return []
    return pairs


def run_checked(events: list[Event]) -> dict[str, int]:
    """Feed ``events`` to ``reduce``, checking every defrag plan against the plain rule."""
    state = initial_state()
    counts = {"plans": 0, "pairs": 0}
    for event in events:
        want = expected_pairs(state) if isinstance(event, StepEnded) else None
        try:
            state, plans = reduce(state, event)
        except InvalidEvent:
            continue  # the generator's program may break a newer rule: skip (state untouched)
        swaps = [p for p in plans if isinstance(p, SwapPlan)]
        if want is not None:
            got = swaps[0].pairs if swaps else []
            assert got == want, f"{event}: {got} != {want}"
            counts["plans"] += bool(swaps)
            counts["pairs"] += len(got)
        check_invariants(state)
    return counts


def with_policy(events: list[Event], **fields: Any) -> list[Event]:
    config = events[0]
    assert isinstance(config, CacheConfigured)
    return [msgspec.structs.replace(config, **fields), *events[1:]]


@given(reducer_programs(transfers=False), POLICY_CHOICES)
def test_policies_equal_their_plain_rule(events: list[Event], policy: dict[str, Any]) -> None:
    run_checked(with_policy(events, **policy))


@given(reducer_programs(), POLICY_CHOICES)
def test_policies_with_pins_and_transfers_equal_their_plain_rule(
    events: list[Event], policy: dict[str, Any]
) -> None:
    run_checked(with_policy(events, **policy))


@given(reducer_programs(transfers=False))
def test_the_general_walk_from_block_1_is_the_seed_walk(events: list[Event]) -> None:
    """``compact(state, 1, max_swaps)`` pairs exactly as the seed's word walk does."""
    state = initial_state()
    for event in events:
        if isinstance(event, StepEnded) and state.config is not None and state.max_used >= 0:
            sources, destinations = seed_walk(state)
            if len(sources):
                general = compact(state, 1, state.config.max_swaps)
                assert general[0].tolist() == sources.tolist()
                assert general[1].tolist() == destinations.tolist()
        state, _ = reduce(state, event)


@pytest.mark.parametrize("policy", ["seed", "tail"])
@pytest.mark.parametrize("budget", [0, 3 * 4096])
def test_long_seeded_programs_follow_the_rule(policy: str, budget: int) -> None:
    import random

    config = CacheConfigured(
        num_gpu_blocks=700,
        block_size=16,
        num_cpu_blocks=32,
        prefix_caching=budget > 0,
        threshold=4,
        page_size_bytes=4096,
        policy=policy,
        policy_ratio_pct=120,
        max_bytes_per_step=budget,
    )
    counts = run_checked(random_program(random.Random(7), config, 4000))
    assert counts["plans"] > 5  # the rule was exercised, not only its trigger


def pool(config: CacheConfigured, used: list[int]) -> State:
    state = initial_state()
    for event in (config, BlocksAllocated(req_id="r", block_ids=used)):
        state, _ = reduce(state, event)
    return state


def tail(**fields: Any) -> CacheConfigured:
    return CacheConfigured(num_gpu_blocks=256, block_size=16, policy="tail", **fields)


def step_pairs(state: State) -> list[tuple[int, int]]:
    _, plans = reduce(state, StepEnded(step=0))
    return plans[0].pairs if plans else []  # type: ignore[union-attr]


def test_tail_fills_holes_from_num_used_up() -> None:
    # the PR's own example, restated: 4 blocks at the top move into 4..7, not 1..4
    assert step_pairs(pool(tail(), [100, 101, 102, 103])) == [
        (103, 4),
        (102, 5),
        (101, 6),
        (100, 7),
    ]


def test_tail_skips_micro_defrags_and_compact_pools() -> None:
    assert step_pairs(pool(tail(), [2, 100])) == []  # one pair < min swaps 4
    assert step_pairs(pool(tail(policy_min_swaps=1), [2, 100])) == [(100, 3)]
    assert step_pairs(pool(tail(), list(range(1, 20)))) == []  # ratio 19/19
    assert step_pairs(pool(tail(max_swaps=2), [100, 101, 102, 103])) == [(103, 4), (102, 5)]


def test_byte_budget_caps_pairs_and_counts_swaps_twice() -> None:
    move = CacheConfigured(num_gpu_blocks=64, block_size=16, threshold=0, page_size_bytes=100)
    used = [40, 41, 42, 43, 44]
    assert len(step_pairs(pool(move, used))) == 5
    assert len(step_pairs(pool(msgspec.structs.replace(move, max_bytes_per_step=250), used))) == 2
    swap = msgspec.structs.replace(move, prefix_caching=True, max_bytes_per_step=250)
    assert len(step_pairs(pool(swap, used))) == 1  # a swap pair moves 200 bytes
    assert step_pairs(pool(msgspec.structs.replace(swap, max_bytes_per_step=199), used)) == []


@pytest.mark.parametrize(
    "fields",
    [
        {"policy": "bogus"},
        {"policy": 3},
        {"policy_ratio_pct": 99},
        {"policy_ratio_pct": 1.5},
        {"policy_min_swaps": 0},
        {"max_bytes_per_step": -1},
    ],
)
def test_bad_policy_fields_are_refused(fields: dict[str, Any]) -> None:
    config = msgspec.structs.replace(CacheConfigured(num_gpu_blocks=8, block_size=16), **fields)
    with pytest.raises(InvalidEvent):
        validate_event(config)
    with pytest.raises(ValueError):
        Engine(config)


@pytest.mark.parametrize(
    "fields",
    [
        {"policy": "tail", "policy_ratio_pct": 110, "policy_min_swaps": 2},
        {"max_bytes_per_step": 3 * 2048},
        {"policy": "tail", "max_bytes_per_step": 5 * 2048, "prefix_caching": True},
    ],
)
def test_logs_recorded_under_a_policy_replay_exactly(tmp_path: str, fields: dict[str, Any]) -> None:
    import random

    base = CacheConfigured(
        num_gpu_blocks=300, block_size=16, num_cpu_blocks=16, threshold=2, page_size_bytes=2048
    )
    config = msgspec.structs.replace(base, **fields)
    events = random_program(random.Random(3), config, 1500)
    path = os.path.join(tmp_path, "p.kvlog")
    accepted: list[Event] = []
    with Engine(config, log_path=path, checkpoint_every=16) as engine:
        for event in events[1:]:
            try:
                engine.apply(event)
            except InvalidEvent:
                continue  # see run_checked
            accepted.append(event)
        live = engine.digest()
    result = replay(path)
    assert result.ok and result.final_digest == live and result.num_verified > 3
    # the same events recorded under the seed's rule, replayed as a what-if of this policy
    seed_path = os.path.join(tmp_path, "seed.kvlog")
    policy = {k: v for k, v in fields.items() if k != "prefix_caching"}
    recorded = msgspec.structs.replace(config, **{k: getattr(base, k) for k in policy})
    with Engine(recorded, log_path=seed_path) as engine:
        for event in accepted:
            engine.apply(event)
    whatif = replay(seed_path, **policy)
    assert whatif.whatif is not None and whatif.whatif.whatif.final_digest == live


def test_a_policy_is_part_of_the_digest() -> None:
    """At its default a new field leaves the digest alone (the golden logs check that); set,
    it is part of the state, so a replay under another policy never verifies by accident."""
    from kvlog.reducers import digest

    plain = pool(CacheConfigured(num_gpu_blocks=16, block_size=16), [3, 4])
    tailed = pool(CacheConfigured(num_gpu_blocks=16, block_size=16, policy="tail"), [3, 4])
    assert digest(plain) != digest(tailed)

"""Helpers of the narrative reducer tests (``test_reducer_scenarios.py``,
``test_transfer_rules.py``): a configured state, events applied with the invariants checked
after each, a refusal that must change nothing, and the events' short forms."""

from __future__ import annotations

from typing import Any

import pytest

from kvlog.events import BlocksAllocated, CacheConfigured, Event, Plan
from kvlog.reducers import State, check_invariants, digest, initial_state, reduce, snapshot

__all__ = ["alloc", "make", "rejected", "run"]


def make(**config: Any) -> State:
    """A configured state: 16 blocks of 16 tokens, threshold 0 unless said."""
    config.setdefault("num_gpu_blocks", 16)
    config.setdefault("block_size", 16)
    config.setdefault("threshold", 0)
    state, plans = reduce(initial_state(), CacheConfigured(**config))
    assert plans == []
    return state


def run(state: State, *events: Event) -> list[Plan]:
    """Apply events, checking invariants after each; all their plans."""
    plans: list[Plan] = []
    for event in events:
        _, new = reduce(state, event)
        check_invariants(state)
        plans.extend(new)
    return plans


def rejected(state: State, event: Event, error: type[Exception], match: str | None = None) -> None:
    """The event raises ``error`` and changes nothing, not even the snapshot."""
    before, blob = digest(state), snapshot(state)
    with pytest.raises(error, match=match):
        reduce(state, event)
    assert digest(state) == before and snapshot(state) == blob
    check_invariants(state)


def alloc(req_id: str, *block_ids: int) -> BlocksAllocated:
    return BlocksAllocated(req_id=req_id, block_ids=list(block_ids))

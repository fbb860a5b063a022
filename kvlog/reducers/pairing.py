"""The defrag pairing walk of the seed rule: which used blocks move into which free ones.

Rule (``defrag.py`` docstring): sources are the used blocks from ``max_used`` down,
destinations the free blocks from 1 up, both skipping pinned blocks; source ``i`` pairs
with destination ``i`` while the destination is below the source, for at most
``max_swaps`` pairs, and only when the trigger fires (``max_used - threshold > num_used``).
The walk itself is :func:`kvlog.reducers.kernels.seed_walk` (compiled): it reads the bitmaps
a word at a time, skipping empty or full 4096-block runs through their summaries, and costs
O(pairs + words its cursors pass), never O(pool).
"""

from __future__ import annotations

from kvlog.reducers import kernels
from kvlog.reducers.blockset import IdArray
from kvlog.reducers.state import State

__all__ = ["Walk", "walk"]

Walk = tuple[IdArray, IdArray]
"""Sources (descending) and their destinations (ascending), int64 arrays of equal length;
empty: no plan."""


def walk(state: State) -> Walk:
    """This step's defrag pairs under the seed rule (views of the state's scratch arrays,
    valid until the next walk); empty when the trigger does not fire or no pair exists.
    Reads the bitmaps before anything moves."""
    config = state.config
    assert config is not None, "the pairing walk needs a configured state"
    max_used = state.max_used
    sources, destinations = state.pair_sources, state.pair_destinations
    if max_used < 0 or max_used - config.threshold <= state.num_used:
        return sources[:0], destinations[:0]
    used = state.used
    count = kernels.seed_walk(
        used.words,
        used.nonempty,
        used.notfull,
        state.pinned,
        max_used,
        config.max_swaps,
        sources,
        destinations,
    )
    return sources[:count], destinations[:count]

"""Named defrag policies: which used blocks move into which free ones at ``StepEnded``.

``CacheConfigured.policy`` names the rule; every rule is a trigger, a first destination and
a cap, and every rule skips pinned blocks on both sides (as the seed's rule does in
``defrag.py``):

``"seed"`` (the default): the seed ``OnlineDefragmenter``, exactly. Fire when
    ``max_used - threshold > num_used``; sources are the used blocks from the highest down,
    destinations the free blocks from block 1 up; pair while the destination is below the
    source, for at most ``max_swaps`` pairs.

``"tail"``: tail compaction, as proposed in vllm-gaudi PR #376. Fire on the ratio
    ``max_used / num_used > policy_ratio_pct / 100`` (integer arithmetic: ``max_used * 100 >
    policy_ratio_pct * num_used``); destinations are the free blocks from ``num_used`` up
    (holes below ``num_used`` are left alone: with prefix caching they hold the hot
    low-numbered cached blocks, which the seed's rule would swap out to the tail, only for
    the next hit on them to reopen a hole there); sources and the pairing rule as for
    ``"seed"``; a plan of fewer than ``min(policy_min_swaps, cap)`` pairs is dropped (no
    "death by a thousand swaps").

``max_bytes_per_step`` (any policy, 0: no cap): a step's plan moves at most this many
bytes, counted like replay counts them (``page_size_bytes`` per pair, twice that for a
``"swap"`` plan under prefix caching); the cap in pairs is ``min(max_swaps,
max_bytes_per_step // bytes per pair)``, and a budget below one pair means no defrag. With
``page_size_bytes == 0`` the budget caps nothing.

The ``"seed"`` rule without a byte cap runs :func:`kvlog.reducers.pairing.walk` (compiled,
word at a time); the others run :func:`compact`, a walk that takes one id at a time and
starts its destinations wherever the policy says. Both return the same ``Walk`` shape, so
``State.move_blocks`` applies either. Pure: no torch, no I/O, no clock, no randomness.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from kvlog.events import CacheConfigured, pair_bytes, swap_mode
from kvlog.reducers import pairing
from kvlog.reducers.pairing import Walk
from kvlog.reducers.state import State

__all__ = ["compact", "fires", "first_destination", "pair_limit", "walk"]

_MASK64 = (1 << 64) - 1


def walk(state: State) -> Walk:
    """This step's defrag under the configured policy: ``(sources, destinations)`` as
    :func:`kvlog.reducers.pairing.walk` returns them; both empty for no plan."""
    config = state.config
    assert config is not None, "a defrag walk needs a configured state"
    if config.policy == "seed" and not config.max_bytes_per_step:
        return pairing.walk(state)
    max_used, num_used = state.max_used, state.num_used
    none = state.pair_sources[:0]
    if max_used < 0 or not fires(config, max_used, num_used):
        return none, none
    limit = pair_limit(config)
    if limit <= 0:
        return none, none
    sources, destinations = compact(state, first_destination(config, num_used), limit)
    if config.policy == "tail" and len(sources) < min(config.policy_min_swaps, limit):
        return none, none
    return sources, destinations


def fires(config: CacheConfigured, max_used: int, num_used: int) -> bool:
    """The policy's trigger for a pool whose highest used block is ``max_used``."""
    if config.policy == "tail":
        return max_used * 100 > config.policy_ratio_pct * num_used
    return max_used - config.threshold > num_used


def first_destination(config: CacheConfigured, num_used: int) -> int:
    """The lowest block a defrag may move into (never block 0)."""
    if config.policy == "tail":
        return max(1, num_used)
    return 1


def pair_limit(config: CacheConfigured) -> int:
    """The most pairs one step's plan may hold: ``max_swaps``, and the byte budget."""
    limit = config.max_swaps
    per_pair = pair_bytes(config.page_size_bytes, swap_mode(config))
    if config.max_bytes_per_step and per_pair:
        limit = min(limit, config.max_bytes_per_step // per_pair)
    return limit


def compact(state: State, first: int, limit: int) -> Walk:
    """Pair the unpinned used blocks from the highest down with the unpinned free blocks
    from ``first`` up, while the free block is below the used one, for at most ``limit``
    pairs."""
    sources: list[int] = []
    destinations: list[int] = []
    if limit > 0:
        for src, dst in zip(_sources(state), _holes(state, first), strict=False):
            if dst >= src:
                break
            sources.append(src)
            destinations.append(dst)
            if len(sources) == limit:
                break
    return np.array(sources, dtype=np.int64), np.array(destinations, dtype=np.int64)


def _sources(state: State) -> Iterator[int]:
    """Used, unpinned blocks from ``max_used`` down."""
    used, pinned = state.used, state.pinned_buffer
    words = used.word_buffer
    w = state.max_used >> 6 if state.max_used >= 0 else -1
    while w >= 0:
        bits = words[w] & ~pinned[w]
        while bits:
            top = bits.bit_length() - 1
            yield (w << 6) | top
            bits ^= 1 << top
        w = used.prev_nonempty(w - 1)


def _holes(state: State, first: int) -> Iterator[int]:
    """Free, unpinned blocks from ``first`` up (ids past the pool may follow the last
    real one: the caller stops at its sources first)."""
    used, pinned = state.used, state.pinned_buffer
    words = used.word_buffer
    start_word = first >> 6
    w = used.next_notfull(start_word)
    while w >= 0:
        bits = ~(words[w] | pinned[w]) & _MASK64
        if w == start_word:
            bits &= _MASK64 >> (first & 63) << (first & 63)
        while bits:
            low = bits & -bits
            yield (w << 6) | (low.bit_length() - 1)
            bits ^= low
        w = used.next_notfull(w + 1)

"""The anchors of the CPU tier's what-ifs: the offline optimum, and whole hit-rate curves.

:func:`belady` is the optimum under the same calls and admission rule as vLLM's manager in
``whatif.py``: the same lookups (a hit is a key held when its request asks), the same store
batches, the same store-threshold tracker, a batch refused exactly where vLLM refuses it;
only the choice of victims differs: the key whose next ask is farthest in the future (never
one of the batch being stored). :func:`lru_curve` gives LRU's hit count at every capacity
in one pass (stack distances, a Fenwick tree over last-ask times): vLLM's LRU after each
request holds its keys head on top, so the tier at capacity ``C`` holds the ``C`` most
recent keys of one recency stack, and a key hits iff its depth is below ``C``. It equals
the per-capacity replays wherever every request's keys fit in ``C`` (property test).
:func:`opt_curve` gives the optimum's hit count at every capacity in one compiled pass
(Mattson's OPT stack, ``opt_stack.py``), equal to :func:`belady` wherever no store batch is
larger than ``C`` (property test).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvlog.reducers.cpu_tier import count_offer
from kvlog.tier.trace import TierAccess
from kvlog.tier.variants import TierTally, TierVariant

__all__ = ["belady", "lru_curve", "next_asks", "opt_curve"]

NEVER = 1 << 62
"""The next ask of a key asked no more."""
LATER = NEVER + 1
"""The request asking now offers the key again in a later store batch: evicting it until
then costs no hit (that batch stores it again), so it is the first victim."""


def next_asks(accesses: Sequence[TierAccess]) -> list[list[int]]:
    """For each access, each key's next access index (``NEVER`` when none)."""
    following: dict[bytes, int] = {}
    out: list[list[int]] = [[] for _ in accesses]
    for index in range(len(accesses) - 1, -1, -1):
        keys = accesses[index].keys
        out[index] = [following.get(key, NEVER) for key in keys]
        for key in keys:
            following[key] = index
    return out


class _Farthest:
    """Resident keys by next ask, farthest first (a lazily invalidated heap)."""

    def __init__(self) -> None:
        self.next_ask: dict[bytes, int] = {}
        self.heap: list[tuple[int, bytes]] = []

    def put(self, key: bytes, ask: int) -> None:
        self.next_ask[key] = ask
        heapq.heappush(self.heap, (-ask, key))
        if len(self.heap) > 4 * len(self.next_ask) + 64:
            self.heap = [(-a, k) for k, a in self.next_ask.items()]
            heapq.heapify(self.heap)

    def evict(self, n: int, protected: set[bytes]) -> list[bytes] | None:
        chosen: dict[bytes, None] = {}
        kept: list[tuple[int, bytes]] = []
        while self.heap and len(chosen) < n:
            entry = heapq.heappop(self.heap)
            key = entry[1]
            if self.next_ask.get(key) != -entry[0] or key in chosen:
                continue
            if key in protected:
                kept.append(entry)
            else:
                chosen[key] = None
        for entry in kept:
            heapq.heappush(self.heap, entry)
        if len(chosen) < n:
            for key in chosen:
                heapq.heappush(self.heap, (-self.next_ask[key], key))
            return None
        for key in chosen:
            del self.next_ask[key]
        return list(chosen)


def belady(accesses: Sequence[TierAccess], variant: TierVariant) -> TierTally:
    """The optimum's tally for one capacity (see module docstring)."""
    asks = next_asks(accesses)
    cache, tally, unread = _Farthest(), TierTally(), set[bytes]()
    counts: OrderedDict[bytes, int] | None = OrderedDict() if variant.store_threshold >= 2 else None
    for index, access in enumerate(accesses):
        upcoming = dict(zip(access.keys, asks[index], strict=True))
        hits = [key for key in access.keys if key in cache.next_ask]
        tally.accesses += 1
        tally.blocks_asked += len(access.keys)
        tally.blocks_hit += len(hits)
        unread.difference_update(hits)
        step = variant.keys_per_step
        for position, key in enumerate(access.keys):
            if key in cache.next_ask:  # LATER: a later batch of this request stores it again
                cache.put(key, upcoming[key] if position < step else LATER)
        keys = list(access.keys)
        for start in range(0, len(keys), step):
            batch = keys[start : start + step]
            for key in batch:
                if key in cache.next_ask:
                    cache.put(key, upcoming[key])
            if counts is not None:
                count_offer(counts, batch, variant.max_tracker_size)
            to_store = [key for key in batch if key not in cache.next_ask]
            if counts is not None:
                to_store = [k for k in to_store if counts.get(k, 0) >= variant.store_threshold]
            if not to_store:
                continue
            num_to_evict = len(to_store) - (variant.num_chunks - len(cache.next_ask))
            evicted = _victims(cache, num_to_evict, set(batch))
            if evicted is None:
                tally.refused_stores += 1
                continue
            tally.evictions += len(evicted)
            tally.never_read += sum(key in unread for key in evicted)
            unread.difference_update(evicted)
            for key in to_store:
                cache.put(key, upcoming[key])
            unread.update(to_store)
            tally.blocks_stored += len(to_store)
    tally.never_read += len(unread)
    return tally


def _victims(cache: _Farthest, count: int, protected: set[bytes]) -> list[bytes] | None:
    """The keys to evict for ``count`` more chunks, or None where vLLM refuses the store."""
    if count <= 0:
        return []
    if count > len(cache.next_ask):
        return None
    return cache.evict(count, protected)


def lru_curve(accesses: Sequence[TierAccess], max_chunks: int) -> npt.NDArray[np.int64]:
    """``hits[c]``: LRU's blocks hit with ``c`` chunks, for ``c`` in ``0..max_chunks``,
    from one pass (see module docstring)."""
    total = sum(len(access.keys) for access in accesses)
    tree = [0] * (total + 1)  # Fenwick tree over ask times 1..total
    last: dict[bytes, int] = {}
    depths = np.zeros(max_chunks + 2, dtype=np.int64)
    marks, now = 0, 0
    for access in accesses:
        for key in access.keys:
            when = last.get(key)
            if when is None:
                continue
            depth = marks - _prefix(tree, when)  # keys asked after this one's last ask
            depths[min(depth, max_chunks + 1)] += 1
        for key in reversed(access.keys):  # head asked last: the head is on top
            when = last.get(key)
            if when is not None:
                _add(tree, when, -1)
                marks -= 1
            now += 1
            _add(tree, now, 1)
            marks += 1
            last[key] = now
    hits = np.zeros(max_chunks + 1, dtype=np.int64)
    hits[1:] = np.cumsum(depths[: max_chunks + 1])[:max_chunks]
    return hits


def opt_curve(
    accesses: Sequence[TierAccess], max_chunks: int, keys_per_step: int = 16
) -> npt.NDArray[np.int64]:
    """``hits[c]``: the optimum's blocks hit with ``c`` chunks (store threshold 0), for
    ``c`` in ``0..max_chunks``, from one compiled pass (``opt_stack.py``). Equal to
    :func:`belady` at every ``c`` no smaller than the largest store batch
    (``min(keys_per_step, largest request)``: there no store is refused); property test."""
    from kvlog.tier.opt_stack import opt_depths

    flat = [key for access in accesses for key in access.keys]
    starts = np.zeros(len(accesses) + 1, dtype=np.int64)
    np.cumsum([len(access.keys) for access in accesses], out=starts[1:])
    unique, ids = np.unique(np.array(flat, dtype=bytes), return_inverse=True)
    depths = np.empty(len(flat), dtype=np.int64)
    cut = max(1, max_chunks)
    opt_depths(ids.astype(np.int64), starts, len(unique), keys_per_step, cut, depths)
    counts = np.bincount(depths, minlength=cut + 2)
    hits = np.cumsum(counts)[: max_chunks + 1]
    return np.asarray(hits, dtype=np.int64)


def _prefix(tree: list[int], index: int) -> int:
    total = 0
    while index > 0:
        total += tree[index]
        index -= index & -index
    return total


def _add(tree: list[int], index: int, delta: int) -> None:
    size = len(tree)
    while index < size:
        tree[index] += delta
        index += index & -index

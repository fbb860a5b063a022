"""The CPU tier's eviction policies as vLLM 0.26's ``CachePolicy``s decide (LRU, ARC).

vLLM 0.26's tier counts blocks (``num_blocks``, each ``blocks_per_chunk`` GPU blocks) and its
policies know nothing of requests: the LRU keeps its idle keys in one recency list (a store's
completion or a load's end appends, ``touch`` moves to the end, eviction takes from the
front); ARC is 0.33's (:class:`~kvlog.reducers.tier_policies.ArcPolicy`) but never falls
back to T1 when T2 has no idle key. Same decisions as
``vllm/v1/kv_offload/cpu/policies/{lru,arc}.py`` of vLLM 0.26 on the same calls; the
differential test (``tests/test_cpu_tier_vllm.py``) runs both. Pure Python, no I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvlog.reducers.tier_policies import ArcPolicy, Chunk, TierContext, TierPolicy

__all__ = ["Arc026Policy", "Lru026Policy"]


class Lru026Policy(TierPolicy):
    """vLLM 0.26's LRU: idle keys in recency order, least recent first."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.chunks: dict[bytes, Chunk] = {}
        self.evictable: OrderedDict[bytes, None] = OrderedDict()

    def get(self, key: bytes) -> Chunk | None:
        return self.chunks.get(key)

    def insert(self, key: bytes, chunk: Chunk, context: TierContext) -> None:
        self.chunks[key] = chunk
        if chunk.ref_cnt == 0:
            self.evictable[key] = None

    def remove(self, key: bytes) -> None:
        del self.chunks[key]
        self.evictable.pop(key, None)

    def touch(self, keys: Sequence[bytes], context: TierContext) -> None:
        for key in reversed(keys):
            if key in self.evictable:
                self.evictable.move_to_end(key)

    def clear(self) -> None:
        self.evictable.clear()
        self.chunks.clear()

    def evict(self, n: int, protected: set[bytes]) -> list[tuple[bytes, Chunk]] | None:
        """The ``n`` least recent idle keys outside ``protected``; all or none."""
        if n == 0:
            return []
        picked: list[bytes] = []
        for key in self.evictable:
            if key in protected:
                continue
            picked.append(key)
            if len(picked) == n:
                break
        if len(picked) < n:
            return None
        out = []
        for key in picked:
            del self.evictable[key]
            out.append((key, self.chunks.pop(key)))
        return out

    def mark_evictable(self, key: bytes) -> None:
        self.evictable[key] = None

    def mark_non_evictable(self, key: bytes) -> None:
        del self.evictable[key]


class Arc026Policy(ArcPolicy):
    """vLLM 0.26's ARC: 0.33's, but an eviction that finds no idle key where its target
    sends it (T2 below the T1 target) fails instead of taking one from T1."""

    falls_back_to_t1 = False

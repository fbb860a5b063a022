"""The CPU tier's eviction policies, as vLLM 0.33's ``CachePolicy``s decide (LRU, ARC).

Same decisions as ``vllm/v1/kv_offload/cpu/policies/{lru,arc}.py`` on the same calls: the
LRU keeps a logical rank per key (``(request rank, -position)`` while a request runs, a
fresh global rank when it finishes) and evicts the smallest ``(rank, key)`` among the idle
keys; ARC keeps T1/T2 with ghost lists B1/B2 and an adaptive T1 target. The per-request
state vLLM keeps in a ``ReqContext`` lives in :class:`TierContext` here. Pure Python, no
I/O; the differential test (``tests/test_cpu_tier_vllm.py``) runs both on the same calls.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

__all__ = ["ArcPolicy", "Chunk", "LruPolicy", "TierContext", "TierPolicy", "order_keys"]

Rank = tuple[int, int]


class Chunk:
    """One CPU slot holding a key: ``ref_cnt`` -1 while its store runs, else the loads
    reading it (0: idle, evictable)."""

    __slots__ = ("chunk_id", "ref_cnt")

    def __init__(self, chunk_id: int) -> None:
        self.chunk_id = chunk_id
        self.ref_cnt = -1

    @property
    def is_ready(self) -> bool:
        """Stored: readable."""
        return self.ref_cnt >= 0


@dataclass(slots=True)
class TierContext:
    """What vLLM keeps in one ``ReqContext``: key positions, the manager's record of the
    request's accesses (for one cache generation) and the LRU's request rank."""

    req_id: str
    positions: dict[bytes, int] = field(default_factory=dict)
    generation: int = -1
    key_groups: dict[int, list[bytes]] = field(default_factory=dict)
    seen_keys: set[bytes] = field(default_factory=set)
    inserted_keys: set[bytes] = field(default_factory=set)
    reused_keys: set[bytes] = field(default_factory=set)
    store_miss_keys: set[bytes] = field(default_factory=set)
    counted_keys: set[bytes] = field(default_factory=set)
    """Keys this request counted toward the store threshold (vLLM 0.34: once each)."""
    finished: bool = False
    rank_generation: int = -1
    rank: int = 0


def order_keys(key_groups: Sequence[Sequence[bytes]], context: TierContext) -> list[bytes]:
    """All groups' keys head to tail (by position when every key has one)."""
    keys = [key for group in key_groups for key in group]
    positions = context.positions
    if all(key in positions for key in keys):
        keys.sort(key=positions.__getitem__)
    return keys


class TierPolicy:
    """What the manager asks of a policy (vLLM's ``CachePolicy``)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity

    def get(self, key: bytes) -> Chunk | None:
        raise NotImplementedError

    def insert(self, key: bytes, chunk: Chunk, context: TierContext) -> None:
        raise NotImplementedError

    def remove(self, key: bytes) -> None:
        raise NotImplementedError

    def touch(self, keys: Sequence[bytes], context: TierContext) -> None:
        raise NotImplementedError

    def on_store_miss(self, keys: Sequence[bytes], context: TierContext) -> None:
        self.touch(keys, context)

    def on_request_access(self, keys: Sequence[bytes], context: TierContext) -> None:
        return

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[bytes]],
        insertion_only: set[bytes],
        reused: set[bytes],
        context: TierContext,
    ) -> None:
        for keys in key_groups:
            self.touch(keys, context)

    def evict(self, n: int, protected: set[bytes]) -> list[tuple[bytes, Chunk]] | None:
        raise NotImplementedError

    def clear(self) -> None:
        raise NotImplementedError

    def mark_evictable(self, key: bytes) -> None:
        return

    def mark_non_evictable(self, key: bytes) -> None:
        return


class LruPolicy(TierPolicy):
    """vLLM's LRU: logical ranks, idle keys in a lazily invalidated min-heap."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.chunks: dict[bytes, Chunk] = {}
        self.ranks: dict[bytes, Rank] = {}
        self.evictable: set[bytes] = set()
        self.heap: list[tuple[Rank, bytes]] = []
        self.next_rank = 0
        self.generation = 0

    def _request_rank(self, context: TierContext) -> int:
        if context.rank_generation != self.generation:
            self.next_rank += 1
            context.rank_generation, context.rank = self.generation, self.next_rank
        return context.rank

    def _rebuild(self) -> None:
        self.heap = [(self.ranks[key], key) for key in self.evictable]
        heapq.heapify(self.heap)

    def _compact(self) -> None:
        if len(self.heap) >= max(64, 2 * len(self.evictable)):
            self._rebuild()

    def _refresh(self, updated: list[bytes]) -> None:
        if not updated:
            return
        if len(updated) >= max(64, len(self.evictable) // 4):
            self._rebuild()
            return
        for key in updated:
            heapq.heappush(self.heap, (self.ranks[key], key))
        self._compact()

    def _renew(self, keys: Iterable[bytes]) -> None:
        updated = []
        for key in keys:
            if key in self.chunks:
                self.next_rank += 1
                self.ranks[key] = (self.next_rank, 0)
                if key in self.evictable:
                    updated.append(key)
        self._refresh(updated)

    def get(self, key: bytes) -> Chunk | None:
        return self.chunks.get(key)

    def insert(self, key: bytes, chunk: Chunk, context: TierContext) -> None:
        self.chunks[key] = chunk
        position = context.positions.get(key)
        if position is None:
            self.next_rank += 1
            self.ranks[key] = (self.next_rank, 0)
        else:
            self.ranks[key] = (self._request_rank(context), -position)
        assert chunk.ref_cnt < 0, "a key is inserted while its store is pending"

    def remove(self, key: bytes) -> None:
        del self.chunks[key]
        self.ranks.pop(key, None)
        self.evictable.discard(key)

    def touch(self, keys: Sequence[bytes], context: TierContext) -> None:
        self._renew(reversed(keys))

    def on_request_access(self, keys: Sequence[bytes], context: TierContext) -> None:
        request_rank = self._request_rank(context)
        updated = []
        for key in keys:
            position = context.positions.get(key)
            if position is None or key not in self.chunks:
                continue
            rank = (request_rank, -position)
            if self.ranks[key] >= rank:
                continue
            self.ranks[key] = rank
            if key in self.evictable:
                updated.append(key)
        self._refresh(updated)

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[bytes]],
        insertion_only: set[bytes],
        reused: set[bytes],
        context: TierContext,
    ) -> None:
        self._renew(reversed(order_keys(key_groups, context)))

    def clear(self) -> None:
        self.chunks.clear()
        self.ranks.clear()
        self.evictable.clear()
        self.heap.clear()
        self.next_rank = 0
        self.generation += 1

    def evict(self, n: int, protected: set[bytes]) -> list[tuple[bytes, Chunk]] | None:
        """The ``n`` smallest ``(rank, key)`` idle keys outside ``protected``; all or none."""
        if n == 0:
            return []
        selected: list[tuple[Rank, bytes]] = []
        chosen: set[bytes] = set()
        deferred: list[tuple[Rank, bytes]] = []
        while self.heap and len(selected) < n:
            entry = heapq.heappop(self.heap)
            rank, key = entry
            if key not in self.evictable or self.ranks.get(key) != rank or key in chosen:
                continue
            if key in protected:
                deferred.append(entry)
                continue
            selected.append(entry)
            chosen.add(key)
        for entry in deferred if len(selected) == n else deferred + selected:
            heapq.heappush(self.heap, entry)
        if len(selected) < n:
            return None
        out = []
        for _, key in selected:
            self.evictable.remove(key)
            del self.ranks[key]
            out.append((key, self.chunks.pop(key)))
        self._compact()
        return out

    def mark_evictable(self, key: bytes) -> None:
        self.evictable.add(key)
        heapq.heappush(self.heap, (self.ranks[key], key))
        self._compact()

    def mark_non_evictable(self, key: bytes) -> None:
        self.evictable.remove(key)


class ArcPolicy(TierPolicy):
    """vLLM's ARC: T1 (seen once), T2 (reused), ghosts B1/B2, adaptive T1 target."""

    falls_back_to_t1 = True
    """An eviction that finds no idle key in T2 (sent there by the T1 target) takes one
    from T1 (vLLM 0.33 and 0.34; 0.26 fails instead)."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.target_t1_size = 0.0
        self.t1: OrderedDict[bytes, Chunk] = OrderedDict()
        self.t2: OrderedDict[bytes, Chunk] = OrderedDict()
        self.b1: OrderedDict[bytes, None] = OrderedDict()
        self.b2: OrderedDict[bytes, None] = OrderedDict()

    def get(self, key: bytes) -> Chunk | None:
        return self.t1.get(key) or self.t2.get(key)

    def insert(self, key: bytes, chunk: Chunk, context: TierContext) -> None:
        self.t1[key] = chunk
        self.b1.pop(key, None)
        self.b2.pop(key, None)

    def remove(self, key: bytes) -> None:
        if self.t1.pop(key, None) is None:
            self.t2.pop(key, None)

    def _ghost_hit(self, key: bytes) -> None:
        if key in self.b1:
            delta = max(1, len(self.b2) / len(self.b1))
            self.target_t1_size = min(self.target_t1_size + delta, self.capacity)
            self.b1.move_to_end(key)
        elif key in self.b2:
            delta = max(1, len(self.b1) / len(self.b2))
            self.target_t1_size = max(self.target_t1_size - delta, 0)
            self.b2.move_to_end(key)

    def on_store_miss(self, keys: Sequence[bytes], context: TierContext) -> None:
        for key in reversed(keys):
            self._ghost_hit(key)

    def touch(self, keys: Sequence[bytes], context: TierContext) -> None:
        for key in reversed(keys):
            if key in self.t1:
                chunk = self.t1.pop(key)
                (self.t2 if chunk.is_ready else self.t1)[key] = chunk
            elif key in self.t2:
                self.t2.move_to_end(key)
            else:
                self._ghost_hit(key)

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[bytes]],
        insertion_only: set[bytes],
        reused: set[bytes],
        context: TierContext,
    ) -> None:
        for key in reversed(order_keys(key_groups, context)):
            if key in insertion_only:
                if key in self.t1:
                    self.t1.move_to_end(key)
                elif key in self.t2:
                    self.t2.move_to_end(key)
            elif key in reused and key in self.t1:
                self.t2[key] = self.t1.pop(key)
            elif key in reused and key in self.t2:
                self.t2.move_to_end(key)

    def clear(self) -> None:
        for part in (self.t1, self.t2, self.b1, self.b2):
            part.clear()
        self.target_t1_size = 0.0

    def evict(self, n: int, protected: set[bytes]) -> list[tuple[bytes, Chunk]] | None:
        """``n`` idle keys outside ``protected``, from T1 while it is at or above its
        target, else T2 (T1 when T2 has none, where ``falls_back_to_t1``); all or none."""
        if n == 0:
            return []
        t1_size = len(self.t1)
        t1_idle = ((k, c) for k, c in self.t1.items() if c.ref_cnt == 0 and k not in protected)
        t2_idle = ((k, c) for k, c in self.t2.items() if c.ref_cnt == 0 and k not in protected)
        picked: list[tuple[bytes, Chunk, bool]] = []
        for _ in range(n):
            entry = next(t1_idle, None) if t1_size >= int(self.target_t1_size) else None
            from_t1 = entry is not None
            if entry is None:
                entry = next(t2_idle, None)
            if entry is None:
                if not self.falls_back_to_t1:
                    return None
                entry, from_t1 = next(t1_idle, None), True
                if entry is None:
                    return None
            t1_size -= from_t1
            picked.append((entry[0], entry[1], from_t1))
        out = []
        for key, chunk, from_t1 in picked:
            del (self.t1 if from_t1 else self.t2)[key]
            (self.b1 if from_t1 else self.b2)[key] = None
            out.append((key, chunk))
        for ghost in (self.b1, self.b2):
            for _ in range(len(ghost) - self.capacity):
                ghost.popitem(last=False)
        return out

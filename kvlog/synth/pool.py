"""vLLM-like block pools for the synthetic workload: the GPU pool and the CPU offload cache.

The GPU pool mirrors vLLM v1's ``BlockPool``: block 0 is the null block and never handed
out, free blocks sit in one FIFO queue (a request's blocks are freed tail first, so they
are evicted first), and with prefix caching a freed block keeps its hash until the queue
hands it out again; a hit takes it back out of the queue. The CPU cache is an LRU of CPU
blocks keyed by the content of ``block_size_factor`` GPU blocks, with pins for the blocks
that an unfinished store writes or an unfinished load reads.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

from kvlog.errors import ConfigError

__all__ = ["BlockPool", "CpuCache"]


class BlockPool:
    """GPU blocks: FIFO free queue, ref counts, prefix cache (hash -> block)."""

    def __init__(self, num_gpu_blocks: int, prefix_caching: bool) -> None:
        if type(num_gpu_blocks) is not int or num_gpu_blocks < 2:
            raise ConfigError(
                "num_gpu_blocks", num_gpu_blocks, "an int >= 2 (the null block and one more)"
            )
        self.num_gpu_blocks = num_gpu_blocks
        self.prefix_caching = prefix_caching
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_gpu_blocks))
        self.refs = [0] * num_gpu_blocks
        self._hash_of: dict[int, Hashable] = {}
        self._block_of: dict[Hashable, int] = {}
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out (cached-but-unreferenced blocks included)."""
        return len(self._free)

    def lookup(self, hashes: Sequence[Hashable]) -> list[int]:
        """Blocks of the longest cached prefix of ``hashes`` (empty without prefix caching)."""
        if not self.prefix_caching:
            return []
        hits = []
        for h in hashes:
            b = self._block_of.get(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def num_reclaimed_by(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks`` (cache hits) would leave the free queue when touched."""
        return sum(1 for b in blocks if self.refs[b] == 0)

    def touch(self, blocks: Sequence[int]) -> None:
        """Take a reference on cache-hit blocks."""
        for b in blocks:
            if self.refs[b] == 0:
                del self._free[b]
            self.refs[b] += 1

    def allocate(self, num_blocks: int) -> list[int]:
        """``num_blocks`` blocks from the head of the free queue (their hashes evicted)."""
        assert num_blocks <= len(self._free), f"allocate({num_blocks}) with {len(self._free)} free"
        out = []
        for _ in range(num_blocks):
            b, _ = self._free.popitem(last=False)
            h = self._hash_of.pop(b, None)
            if h is not None:
                del self._block_of[h]
                self.num_evictions += 1
            self.refs[b] = 1
            out.append(b)
        return out

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference on each block, tail first (vLLM's eviction order)."""
        for b in reversed(blocks):
            assert self.refs[b] > 0, f"block {b} freed more often than allocated"
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self._free[b] = None

    def cache(self, block_id: int, block_hash: Hashable) -> None:
        """Register a computed full block under its content hash (first one wins)."""
        if not self.prefix_caching or block_hash in self._block_of or block_id in self._hash_of:
            return
        self._block_of[block_hash] = block_id
        self._hash_of[block_id] = block_hash


class CpuCache:
    """CPU blocks as an LRU cache of GPU-block groups, with pins for transfers in flight."""

    def __init__(self, num_cpu_blocks: int) -> None:
        self.num_cpu_blocks = num_cpu_blocks
        self._lru: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_cpu_blocks))
        self._pins = [0] * num_cpu_blocks
        self._key_of: dict[int, Hashable] = {}
        self._block_of: dict[Hashable, int] = {}
        self._ready: set[int] = set()

    def contains(self, key: Hashable) -> bool:
        """Whether ``key`` is stored or being stored."""
        return key in self._block_of

    def lookup(self, keys: Sequence[Hashable]) -> list[int]:
        """CPU blocks of the longest prefix of ``keys`` that is fully stored."""
        hits = []
        for k in keys:
            b = self._block_of.get(k)
            if b is None or b not in self._ready:
                break
            hits.append(b)
        return hits

    def pin(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            if self._pins[b] == 0:
                self._lru.pop(b, None)
            self._pins[b] += 1

    def unpin(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            assert self._pins[b] > 0, f"CPU block {b} unpinned more often than pinned"
            self._pins[b] -= 1
            if self._pins[b] == 0:
                self._lru[b] = None  # most recently used

    def reserve(self, keys: Sequence[Hashable]) -> list[int]:
        """CPU blocks for new ``keys`` (evicting the least recently used), pinned.

        Returns fewer blocks than keys when every other block is pinned.
        """
        out = []
        for k in keys:
            if not self._lru:
                break
            b, _ = self._lru.popitem(last=False)
            old = self._key_of.pop(b, None)
            if old is not None:
                del self._block_of[old]
            self._ready.discard(b)
            self._key_of[b] = k
            self._block_of[k] = b
            self._pins[b] = 1
            out.append(b)
        return out

    def stored(self, blocks: Sequence[int], success: bool) -> None:
        """A store into ``blocks`` finished: they become readable, or are dropped."""
        for b in blocks:
            if success:
                self._ready.add(b)
            else:
                key = self._key_of.pop(b)
                del self._block_of[key]
        self.unpin(blocks)
        if not success:
            for b in blocks:  # nothing worth keeping: reuse these first
                if self._pins[b] == 0:
                    self._lru.move_to_end(b, last=False)

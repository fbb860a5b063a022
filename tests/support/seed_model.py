"""A plain restatement of the seed algorithms, written for clarity: dicts, sorted(), no tricks.

- :class:`SeedDefragmenter` is the seed ``OnlineDefragmenter`` (shared/seeds/
  defragmentation.txt) without tensors: ref counts in physical space, forward and backward
  tables, the ``max_used - threshold > num_used`` trigger, highest used into lowest free
  from block 1, at most ``max_swaps`` pairs, stop when the free id passes the used id. Its
  one addition is the optional ``pinned`` set of ``defragment``: pinned blocks are left out
  of both sequences (kvlog's composition rule; with no pins it is exactly the seed).
- :func:`expand_block_ids` and :func:`seed_transfer_pairs` restate the seed's
  ``expand_block_ids`` and the pair building of ``transfer_async`` (shared/seeds/
  offload_cpu_hpu.txt).
- :func:`chunk_transfer_pairs` restates vLLM 0.33's pair building for specs with KV-cache
  groups (``group_sizes`` / ``block_indices``), which the seed predates: each group starts
  ``block_index % factor`` sub-blocks into its own run of CPU blocks.

The tests compare kvlog's reducers to these, pair for pair. Nothing here is kvlog code.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

__all__ = [
    "SEED_PAD_SIZES",
    "SeedDefragmenter",
    "chunk_transfer_pairs",
    "expand_block_ids",
    "seed_transfer_pairs",
]

SEED_PAD_SIZES = (8, 16, 32, 64, 128, 256, 512)


class SeedDefragmenter:
    """The seed's bookkeeping and ``defragment()``; ``pad_sizes[-1]`` is the seed's cap."""

    def __init__(
        self,
        threshold: int = 32,
        pad_sizes: tuple[int, ...] = SEED_PAD_SIZES,
        max_swaps: int | None = None,
        enabled: bool = True,
    ) -> None:
        self.threshold = threshold
        self.pad_sizes = pad_sizes
        self.max_swaps = pad_sizes[-1] if max_swaps is None else max_swaps
        self.enabled = enabled
        self.used_blocks: dict[int, int] = {}  # physical block -> ref count (> 0 only)
        self.req_blocks: dict[str, list[int]] = {}  # request -> logical blocks
        self.fwd: list[int] = []  # logical -> physical
        self.bwd: list[int] = []  # physical -> logical

    # -- the seed's helpers --------------------------------------------------------------
    def extend_tables(self, block_id: int) -> None:
        while len(self.fwd) <= block_id:
            self.fwd.append(len(self.fwd))
            self.bwd.append(len(self.bwd))

    def ref_count(self, block_id: int) -> int:
        return self.used_blocks.get(block_id, 0)

    def set_ref_count(self, block_id: int, count: int) -> None:
        if count <= 0:
            self.used_blocks.pop(block_id, None)
        else:
            self.used_blocks[block_id] = count

    def resolve(self, block_id: int) -> int:
        if not self.enabled or block_id >= len(self.fwd):
            return block_id
        return self.fwd[block_id]

    def unresolve(self, block_id: int) -> int:
        if block_id >= len(self.bwd):
            return block_id
        return self.bwd[block_id]

    # -- update_state, split per request ---------------------------------------------------
    def allocate(self, req_id: str, blocks: list[int]) -> None:
        """The new-blocks half of the seed's ``update_state``."""
        if not blocks:
            return
        self.req_blocks.setdefault(req_id, []).extend(blocks)
        self.extend_tables(max(blocks))
        for b in blocks:
            physical = self.resolve(b)
            self.set_ref_count(physical, self.ref_count(physical) + 1)

    def release(self, req_id: str) -> None:
        """The finished-requests half (a request without blocks is a no-op here)."""
        for b in self.req_blocks.pop(req_id, []):
            physical = self.resolve(b)
            self.set_ref_count(physical, self.ref_count(physical) - 1)

    # -- defragment ----------------------------------------------------------------------
    def free_blocks(self, pinned: frozenset[int]) -> Iterator[int]:
        """Blocks with no refs from 1 up (the seed's generator), pinned ones left out."""
        for candidate in itertools.count(1):
            if candidate not in self.used_blocks and candidate not in pinned:
                yield candidate

    def defragment(self, pinned: frozenset[int] = frozenset()) -> list[tuple[int, int]]:
        """The seed's ``defragment()``: the pairs it swaps (empty: nothing to do)."""
        if not self.enabled or not self.used_blocks:
            return []
        max_used = max(self.used_blocks)
        num_used = len(self.used_blocks)
        if max_used - self.threshold <= num_used:
            return []
        used = [b for b in sorted(self.used_blocks, reverse=True) if b not in pinned]
        to_swap: list[tuple[int, int]] = []
        for used_block, free_block in zip(used, self.free_blocks(pinned), strict=False):
            if len(to_swap) == self.max_swaps or free_block > used_block:
                break
            to_swap.append((used_block, free_block))
        for used_block, free_block in to_swap:
            used_refs, free_refs = self.ref_count(used_block), self.ref_count(free_block)
            self.set_ref_count(used_block, free_refs)
            self.set_ref_count(free_block, used_refs)
            self.extend_tables(used_block)
            orig_used, orig_free = self.unresolve(used_block), self.unresolve(free_block)
            self.fwd[orig_used], self.bwd[free_block] = free_block, orig_used
            self.fwd[orig_free], self.bwd[used_block] = used_block, orig_free
        return to_swap

    def pad_to(self, num_pairs: int) -> int:
        """The seed's ``to_swap_pad``."""
        return next((p for p in self.pad_sizes if p >= num_pairs), self.pad_sizes[-1])


def expand_block_ids(block_ids: list[int], factor: int, skip_count: int = 0) -> list[int]:
    """The seed's ``expand_block_ids``: block ``b`` is sub-blocks ``b*factor .. b*factor +
    factor - 1``; the first ``skip_count`` sub-blocks of the first block are left out."""
    assert skip_count < factor
    out: list[int] = []
    for i, block_id in enumerate(block_ids):
        first = skip_count if i == 0 else 0
        out.extend(block_id * factor + k for k in range(first, factor))
    return out


def seed_transfer_pairs(
    kind: str, gpu_blocks: list[int], cpu_blocks: list[int], factor: int
) -> list[tuple[int, int]] | None:
    """``transfer_async``'s ``src_to_dst`` for a store (GPU->CPU) or load (CPU->GPU); None
    where the seed's size assertion would fail. ``gpu_blocks`` are the ids to index with."""
    if kind == "store":
        src, dst, src_factor, dst_factor = gpu_blocks, cpu_blocks, 1, factor
    else:
        src, dst, src_factor, dst_factor = cpu_blocks, gpu_blocks, factor, 1
    src_count = len(src) * src_factor
    dst_count = len(dst) * dst_factor
    skip = -len(dst) % src_factor
    if dst_count != src_count - skip:
        return None
    srcs = expand_block_ids(src, src_factor, skip)
    dsts = expand_block_ids(dst, dst_factor)
    return list(zip(srcs, dsts, strict=True))


def chunk_transfer_pairs(
    kind: str,
    gpu_blocks: list[int],
    cpu_blocks: list[int],
    factor: int,
    group_sizes: tuple[int, ...],
    block_indices: tuple[int, ...],
) -> list[tuple[int, int]] | None:
    """vLLM 0.33's ``src_to_dst`` for a spec with KV-cache groups; None where vLLM's size
    check would fail. Group ``g`` holds the next ``group_sizes[g]`` GPU blocks; its CPU
    side starts ``block_indices[g] % factor`` sub-blocks into the next unused CPU block and
    runs on for as many sub-blocks as the group has GPU blocks (an empty group uses none)."""
    gpu_at = cpu_at = 0
    gpu_subs: list[int] = []
    cpu_subs: list[int] = []
    for size, index in zip(group_sizes, block_indices, strict=True):
        if size == 0:
            continue
        skip = index % factor
        num_cpu = -(-(size + skip) // factor)
        if cpu_at + num_cpu > len(cpu_blocks):
            return None
        cpu_subs += expand_block_ids(cpu_blocks[cpu_at : cpu_at + num_cpu], factor, skip)[:size]
        gpu_subs += gpu_blocks[gpu_at : gpu_at + size]
        gpu_at, cpu_at = gpu_at + size, cpu_at + num_cpu
    if cpu_at != len(cpu_blocks) or gpu_at != len(gpu_blocks):
        return None
    if kind == "store":
        return list(zip(gpu_subs, cpu_subs, strict=True))
    return list(zip(cpu_subs, gpu_subs, strict=True))

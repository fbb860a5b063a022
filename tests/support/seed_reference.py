"""A plain restatement of the SEED behaviour on CPU torch tensors, for the hazard tests.

This is what the Gaudi plugin does today (``shared/seeds/defragmentation.txt`` and
``shared/seeds/offload_cpu_hpu.txt``), rewritten for clarity and for CPU tensors:

- :class:`SeedDefragmenter`: the seed ``OnlineDefragmenter`` bookkeeping (ref counts in
  physical space, forward/backward tables, the ``max_used - threshold > num_used`` trigger,
  highest used into lowest free, at most 512 pairs) and its ``CacheSwapUtils`` swap on the
  KV tensors (HPU layout: ``((num_blocks + 1) * block_size, ...)``, slot-indexed, padded
  pairs ``(-1, -1)`` landing on the trailing pad block).
- :class:`SeedOffloadHandler`: the seed ``transfer_async`` for one direction. It indexes the
  GPU tensors with the ids it is given, which are the scheduler's UNRESOLVED ids, and it
  knows nothing of the defragmenter. With ``deferred=True`` it behaves like an asynchronous
  backend whose copy runs late: the copy reads its source when the job completes (at
  ``get_finished``/``wait``), not when it is submitted.

Both hazards of the seed follow from these two facts, and the hazard tests show them here,
then show that kvlog has none on the same inputs. Nothing here is kvlog code.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "SEED_PAD_SIZES",
    "SeedDefragmenter",
    "SeedOffloadHandler",
    "block_rows",
    "cache_tensors",
    "canary_row",
    "expand_block_ids",
    "make_hpu_caches",
    "read_tags",
    "row_tags",
    "write_canary",
]

SEED_PAD_SIZES = (8, 16, 32, 64, 128, 256, 512)
"""The seed's ``to_swap_pad_thresholds``; the last one is also its ``max_swaps``."""


def block_rows(tensor: torch.Tensor, block_size: int) -> torch.Tensor:
    """An int8 view of a slot-indexed cache tensor with one row per block (pad block included).

    This is the seed's canonical form for offload: ``(num_rows, page_size_bytes)``.
    """
    num_rows = tensor.shape[0] // block_size
    return tensor.view(torch.int8).reshape(num_rows, -1)


class SeedDefragmenter:
    """The seed ``OnlineDefragmenter`` plus its ``CacheSwapUtils.swap``, on CPU tensors."""

    def __init__(self, threshold: int = 32, prefix_caching: bool = False) -> None:
        self.threshold = threshold
        self.prefix_caching = prefix_caching
        self.used_blocks: dict[int, int] = {}  # physical block -> ref count
        self.req_blocks: dict[str, list[int]] = {}  # request -> logical blocks
        self.fwd: list[int] = []  # logical -> physical
        self.bwd: list[int] = []  # physical -> logical
        self.caches: list[torch.Tensor] = []
        self.block_size = 0
        self.swaps: list[list[tuple[int, int]]] = []  # every to_swap list, for the tests

    def initialize(self, kv_caches: Sequence[tuple[torch.Tensor, ...]], block_size: int) -> None:
        """Keep the key and value tensors of every layer (a value of None is MLA)."""
        self.block_size = block_size
        self.caches = [t for layer in kv_caches for t in layer[:2] if t is not None]

    # -- bookkeeping ---------------------------------------------------------------------
    def _grow_tables(self, block_id: int) -> None:
        while len(self.fwd) <= block_id:
            self.fwd.append(len(self.fwd))
            self.bwd.append(len(self.bwd))

    def _add_ref(self, physical: int, delta: int) -> None:
        refs = self.used_blocks.get(physical, 0) + delta
        if refs <= 0:
            self.used_blocks.pop(physical, None)
        else:
            self.used_blocks[physical] = refs

    def resolve(self, block_id: int) -> int:
        return self.fwd[block_id] if block_id < len(self.fwd) else block_id

    def unresolve(self, block_id: int) -> int:
        return self.bwd[block_id]

    def resolve_all(self, block_tables: list[list[int]]) -> list[list[int]]:
        return [[self.resolve(b) for b in table] for table in block_tables]

    def update_state(self, new_blocks: dict[str, list[int]], finished_reqs: Sequence[str]) -> None:
        """The seed's order: allocations first, then the finished requests."""
        for req_id, blocks in new_blocks.items():
            if not blocks:
                continue
            self.req_blocks.setdefault(req_id, []).extend(blocks)
            self._grow_tables(max(blocks))
            for b in blocks:
                self._add_ref(self.resolve(b), +1)
        for req_id in finished_reqs:
            for b in self.req_blocks.pop(req_id):
                self._add_ref(self.resolve(b), -1)

    def _free_blocks(self) -> Iterator[int]:
        last = 1
        for used in sorted(self.used_blocks):
            yield from range(last, used)
            last = used + 1
        yield from itertools.count(last)

    def defragment(self) -> list[tuple[int, int]]:
        """Decide, update the tables, swap the tensors; return the ``(used, free)`` pairs."""
        if not self.used_blocks:
            return []
        max_used, num_used = max(self.used_blocks), len(self.used_blocks)
        if max_used - self.threshold <= num_used:
            return []
        to_swap: list[tuple[int, int]] = []
        used_desc = sorted(self.used_blocks, reverse=True)
        for used, free in zip(used_desc, self._free_blocks(), strict=False):
            if len(to_swap) == SEED_PAD_SIZES[-1] or free > used:
                break
            to_swap.append((used, free))
        for used, free in to_swap:
            used_refs, free_refs = self.used_blocks.get(used, 0), self.used_blocks.get(free, 0)
            self.used_blocks.pop(used, None)
            self.used_blocks.pop(free, None)
            self._add_ref(used, free_refs)
            self._add_ref(free, used_refs)
            orig_used, orig_free = self.unresolve(used), self.unresolve(free)
            self.fwd[orig_used], self.bwd[free] = free, orig_used
            self.fwd[orig_free], self.bwd[used] = used, orig_free
        pad = next((p for p in SEED_PAD_SIZES if p >= len(to_swap)), SEED_PAD_SIZES[-1])
        self._swap_tensors(to_swap, pad)
        self.swaps.append(to_swap)
        return to_swap

    # -- CacheSwapUtils ------------------------------------------------------------------
    def _slots(self, blocks: list[int], num_slots: int) -> torch.Tensor:
        ids = torch.tensor(blocks, dtype=torch.long)
        slots = (ids * self.block_size).unsqueeze(-1) + torch.arange(self.block_size)
        # HPU indexes -1 * block_size + k from the end: the trailing pad block.
        return slots.flatten() % num_slots

    def _swap_tensors(self, to_swap: list[tuple[int, int]], pad: int) -> None:
        srcs = [s for s, _ in to_swap] + [-1] * (pad - len(to_swap))
        dsts = [d for _, d in to_swap] + [-1] * (pad - len(to_swap))
        for cache in self.caches:
            src_slots = self._slots(srcs, cache.shape[0])
            dst_slots = self._slots(dsts, cache.shape[0])
            if cache.device.type != "cpu":  # the plugin builds its indices on the device
                src_slots, dst_slots = src_slots.to(cache.device), dst_slots.to(cache.device)
            prev_srcs = cache.index_select(0, src_slots)
            if self.prefix_caching:
                cache.index_copy_(0, src_slots, cache.index_select(0, dst_slots))
            cache.index_copy_(0, dst_slots, prev_srcs)


def expand_block_ids(block_ids: np.ndarray, factor: int, skip_count: int = 0) -> np.ndarray:
    """Sub-block ids of ``block_ids`` (``b * factor + k``), the first ``skip_count`` dropped."""
    assert skip_count < factor
    sub = (block_ids.astype(np.int64)[:, None] * factor + np.arange(factor)).ravel()
    return sub[skip_count:]


@dataclass
class _SeedJob:
    job_id: int
    src_indices: torch.Tensor
    dst_indices: torch.Tensor


class SeedOffloadHandler:
    """The seed ``SingleDirectionOffloadingHandler.transfer_async``, on CPU tensors.

    ``gpu_tensors`` are the :func:`block_rows` views of the KV tensors; ``cpu_tensors`` have
    rows of ``block_size_factor`` GPU pages. Block ids in specs are used as given.
    """

    def __init__(
        self,
        gpu_tensors: list[torch.Tensor],
        cpu_tensors: list[torch.Tensor],
        block_size_factor: int,
        gpu_to_cpu: bool,
        deferred: bool = False,
    ) -> None:
        self.gpu_to_cpu = gpu_to_cpu
        self.src_tensors = gpu_tensors if gpu_to_cpu else cpu_tensors
        self.dst_tensors = cpu_tensors if gpu_to_cpu else gpu_tensors
        self.src_factor = 1 if gpu_to_cpu else block_size_factor
        self.dst_factor = block_size_factor if gpu_to_cpu else 1
        self.factor = block_size_factor
        self.deferred = deferred
        self.pending: list[_SeedJob] = []
        self.finished: list[tuple[int, bool]] = []

    def transfer_async(self, job_id: int, spec: tuple[object, object]) -> bool:
        src_spec, dst_spec = spec
        src_blocks = np.asarray(src_spec.block_ids)  # type: ignore[attr-defined]
        dst_blocks = np.asarray(dst_spec.block_ids)  # type: ignore[attr-defined]
        skip = -dst_blocks.size % self.src_factor
        src_sub = expand_block_ids(src_blocks, self.src_factor, skip)
        dst_sub = expand_block_ids(dst_blocks, self.dst_factor)
        assert src_sub.size == dst_sub.size, "seed: sub-block counts differ"
        job = _SeedJob(job_id, torch.from_numpy(src_sub), torch.from_numpy(dst_sub))
        if self.deferred:
            self.pending.append(job)
        else:
            self._copy(job)
        return True

    def _sub_rows(self, tensor: torch.Tensor, factor: int) -> torch.Tensor:
        return tensor.reshape(tensor.shape[0] * factor, -1)

    def _copy(self, job: _SeedJob) -> None:
        for src, dst in zip(self.src_tensors, self.dst_tensors, strict=True):
            src_rows = self._sub_rows(src, self.src_factor)
            dst_rows = self._sub_rows(dst, self.dst_factor)
            dst_rows.index_put_((job.dst_indices,), src_rows.index_select(0, job.src_indices))
        self.finished.append((job.job_id, True))

    def complete_all(self) -> None:
        """The late copies run now, reading their sources as they are now."""
        for job in self.pending:
            self._copy(job)
        self.pending.clear()

    def get_finished(self) -> list[tuple[int, bool]]:
        self.complete_all()
        done, self.finished = self.finished, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        self.complete_all()


# -- fixtures shared by the integration tests: the runner's caches and canary bytes ----------


def make_hpu_caches(
    num_blocks: int,
    block_size: int,
    num_layers: int = 2,
    mla: bool = False,
    device: str | torch.device = "cpu",
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Tiny HPU-layout KV caches: per layer ``(key, value)`` of ``((num_blocks + 1) * bs, 1, 2)``.

    float32 with one head of size 2: a block is ``block_size * 8`` bytes per tensor.
    """
    shape = ((num_blocks + 1) * block_size, 1, 2)

    def zeros() -> torch.Tensor:
        return torch.zeros(shape, device=device)

    return [(zeros(), None if mla else zeros()) for _ in range(num_layers)]


KvCaches = Sequence[tuple[torch.Tensor, torch.Tensor | None]]
"""The runner's ``kv_caches``: per layer ``(key, value)``, value None for MLA."""


def cache_tensors(kv_caches: KvCaches) -> list[torch.Tensor]:
    """Every key and value tensor, layer by layer."""
    return [t for layer in kv_caches for t in layer if t is not None]


def canary_row(tag: int, num_bytes: int) -> torch.Tensor:
    """``num_bytes`` int8 holding the 64-bit ``tag`` again and again (``num_bytes % 8 == 0``)."""
    assert num_bytes % 8 == 0, "canary rows need whole 8-byte words"
    words = np.full(num_bytes // 8, tag, dtype=np.uint64)
    return torch.from_numpy(words.view(np.int8).copy())


def row_tags(row: torch.Tensor) -> set[int]:
    """The distinct 64-bit words of one int8 row: ``{tag}`` for an intact canary."""
    return {int(w) for w in row.contiguous().numpy().view(np.uint64)}


def write_canary(
    kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor | None]],
    block_size: int,
    physical: int,
    tag: int,
) -> None:
    """What the model's forward does to a block, reduced to a tag: every tensor's row of it."""
    for tensor in cache_tensors(kv_caches):
        rows = block_rows(tensor, block_size)
        rows[physical] = canary_row(tag, rows.shape[1])


def read_tags(
    kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor | None]],
    block_size: int,
    physical: int,
) -> set[int]:
    """The distinct words of one physical block over every tensor."""
    tags: set[int] = set()
    for tensor in cache_tensors(kv_caches):
        tags |= row_tags(block_rows(tensor, block_size)[physical])
    return tags

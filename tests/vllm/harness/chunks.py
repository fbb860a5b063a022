"""vLLM's chunk mapping, from vllm/v1/kv_offload/cpu/gpu_worker.py (transfer_async),
restated here independently of kvlog."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def vllm_chunk_mapping(
    gpu_spec: Any, cpu_chunk_ids: Sequence[int], blocks_per_chunk: int
) -> list[tuple[int, int, int, int]]:
    """``(gpu_block, cpu_chunk, sub_block, block_index)`` for every GPU block of a spec.

    Per KV-cache group ``g`` (``group_sizes[g]`` GPU blocks, the first one logically at
    ``block_indices[g]`` in its request): the CPU side skips ``block_indices[g] % bpc``
    sub-blocks of its first chunk, takes ``cdiv(size + skip, bpc)`` chunks (the last may be
    partial), and pairs the group's GPU blocks with the flat sub-block sequence in order.
    """
    gpu_ids = [int(b) for b in np.asarray(gpu_spec.block_ids).tolist()]
    cpu_ids = [int(c) for c in cpu_chunk_ids]
    out: list[tuple[int, int, int, int]] = []
    gpu_off = cpu_off = 0
    for size, first in zip(gpu_spec.group_sizes, gpu_spec.block_indices, strict=True):
        size, first = int(size), int(first)
        if size == 0:
            continue
        skip = first % blocks_per_chunk
        count = _cdiv(size + skip, blocks_per_chunk)
        chunks = cpu_ids[cpu_off : cpu_off + count]
        flat = [(c, j) for c in chunks for j in range(blocks_per_chunk)][skip : skip + size]
        if len(flat) != size or gpu_off + size > len(gpu_ids):
            raise AssertionError(f"spec does not fit vLLM's mapping: {gpu_spec!r} {cpu_ids}")
        for i, (c, j) in enumerate(flat):
            out.append((gpu_ids[gpu_off + i], c, j, first + i))
        gpu_off += size
        cpu_off += count
    if gpu_off != len(gpu_ids) or cpu_off != len(cpu_ids):
        raise AssertionError(f"spec leaves blocks unmapped: {gpu_spec!r} {cpu_ids}")
    return out

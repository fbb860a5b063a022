"""Shared helpers of the executor tests: cache layouts, plan builders, a numpy block model.

No tests live here. Transfer plans are built by a small local helper that follows
docs/internals.md and the seed's skip rule (it does not use kvlog.reducers).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch

from kvlog.events import CacheConfigured, SwapPlan, TransferPlan
from kvlog.executors import Executor

__all__ = [
    "BACKENDS",
    "LAYOUT_KINDS",
    "BlockModel",
    "config_for",
    "cpu_sub_blocks",
    "fill_random",
    "load_plan",
    "make_kv_caches",
    "store_plan",
]

_NO_CUDA = "no CUDA device: the cuda backend runs only where torch.cuda.is_available()"
BACKENDS = [
    pytest.param("cpu", id="cpu"),
    pytest.param("fake", id="fake"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=[
            pytest.mark.cuda,
            pytest.mark.skipif(not torch.cuda.is_available(), reason=_NO_CUDA),
        ],
    ),
]
LAYOUT_KINDS = ["hpu_fp8_scales", "block_major", "vllm", "mla_aliased", "state_cache"]


def tensor_device(backend: str) -> torch.device:
    return torch.device("cuda" if backend == "cuda" else "cpu")


def fill_random(tensor: torch.Tensor, generator: torch.Generator) -> None:
    """Random bytes in any dtype (fp8, bf16, fp32 alike), so every block differs."""
    flat = tensor.view(torch.int8).view(-1)
    noise = torch.randint(-128, 128, (flat.numel(),), generator=generator, dtype=torch.int8)
    flat.copy_(noise.to(flat.device))


def make_kv_caches(
    kind: str, num_blocks: int, block_size: int, device: torch.device, seed: int = 0
) -> tuple[list[object], str]:
    """KV caches of one layout family, filled with random bytes, and the layout to pass."""
    generator = torch.Generator().manual_seed(seed)
    n, bs = num_blocks, block_size
    layers: list[object] = []
    if kind == "hpu_fp8_scales":  # seed layout: flat slots + pad block, FP8 with scales
        for _ in range(2):
            key = torch.empty((n + 1) * bs, 2, 8, dtype=torch.float8_e4m3fn, device=device)
            value = torch.empty((n + 1) * bs, 2, 8, dtype=torch.float8_e4m3fn, device=device)
            key_scale = torch.empty((n + 1) * bs, 2, dtype=torch.float32, device=device)
            value_scale = torch.empty(n + 1, 2, dtype=torch.float32, device=device)  # per block
            layers.append((key, value, key_scale, value_scale))
        layout = "hpu"
    elif kind == "block_major":
        for _ in range(3):
            key = torch.empty(n, bs, 2, 4, dtype=torch.bfloat16, device=device)
            layers.append((key, torch.empty_like(key)))
        layout = "block_major"
    elif kind == "vllm":
        layers = [torch.empty(2, n, bs, 2, 4, dtype=torch.float16, device=device) for _ in "ab"]
        layout = "vllm"
    elif kind == "mla_aliased":  # key only; layer 1 is layer 0, layer 2 a view of its storage
        latent = torch.empty((n + 1) * bs, 12, dtype=torch.bfloat16, device=device)
        other = torch.empty((n + 1) * bs, 12, dtype=torch.bfloat16, device=device)
        view = latent.view(n + 1, bs, 12)
        layers = [(latent, None), (latent, None), (view, None), (other, None)]
        layout = "auto"
    elif kind == "state_cache":  # per-block state (never per slot) next to a block-major key
        for _ in range(2):
            key = torch.empty(n, bs, 4, dtype=torch.float32, device=device)
            state = torch.empty(n, 3, 5, dtype=torch.float32, device=device)
            layers.append((key, None, state))
        layout = "auto"
    else:
        raise AssertionError(f"unknown layout kind {kind}")
    for layer in layers:
        for tensor in layer if isinstance(layer, tuple) else (layer,):
            if tensor is not None:
                fill_random(tensor, generator)
    return layers, layout


def config_for(
    num_blocks: int, block_size: int, num_cpu_blocks: int = 0, factor: int = 1, **more: object
) -> CacheConfigured:
    return CacheConfigured(
        num_gpu_blocks=num_blocks,
        block_size=block_size,
        num_cpu_blocks=num_cpu_blocks,
        block_size_factor=factor,
        **more,  # type: ignore[arg-type]
    )


def store_plan(
    job_id: int, gpu_ids: Sequence[int], cpu_ids: Sequence[int], factor: int, after: int = -1
) -> TransferPlan:
    """GPU blocks into CPU blocks: every CPU block takes ``factor`` GPU blocks."""
    subs = [c * factor + k for c in cpu_ids for k in range(factor)]
    assert len(subs) == len(gpu_ids), "a store fills whole CPU blocks"
    return TransferPlan(job_id, "store", list(zip(gpu_ids, subs, strict=True)), 0, after)


def load_plan(
    job_id: int, cpu_ids: Sequence[int], gpu_ids: Sequence[int], factor: int, after: int = -1
) -> TransferPlan:
    """CPU blocks into GPU blocks, skipping the first sub-blocks of the first CPU block."""
    subs = [c * factor + k for c in cpu_ids for k in range(factor)]
    skip = (-len(gpu_ids)) % factor
    assert len(subs) - skip == len(gpu_ids), "load sizes do not fit block_size_factor"
    return TransferPlan(job_id, "load", list(zip(subs[skip:], gpu_ids, strict=True)), 0, after)


def cpu_sub_blocks(executor: Executor, cpu_block_id: int) -> list[bytes]:
    """The ``factor`` sub-blocks of one CPU block, each as a GPU block's bytes."""
    data = executor.read_cpu_block(cpu_block_id)
    factor = executor.config.block_size_factor
    pages = [t.page_bytes for t in executor.layout.tensors]
    subs = [bytearray() for _ in range(factor)]
    offset = 0
    for page in pages:
        for k in range(factor):
            subs[k] += data[offset : offset + page]
            offset += page
    assert offset == len(data)
    return [bytes(s) for s in subs]


class BlockModel:
    """Plain numpy model of every GPU block row and CPU sub-block, as bytes."""

    def __init__(self, executor: Executor) -> None:
        rows = executor.layout.num_block_rows
        self.gpu = np.stack([_bytes_row(executor.read_gpu_block(b)) for b in range(rows)])
        subs = [
            _bytes_row(sub)
            for c in range(executor.config.num_cpu_blocks)
            for sub in cpu_sub_blocks(executor, c)
        ]
        page = executor.page_size_bytes
        self.cpu = np.stack(subs) if subs else np.zeros((0, page), dtype=np.uint8)

    def apply_swap(self, plan: SwapPlan) -> None:
        src = np.array([s for s, _ in plan.pairs], dtype=np.int64)
        dst = np.array([d for _, d in plan.pairs], dtype=np.int64)
        old_src, old_dst = self.gpu[src].copy(), self.gpu[dst].copy()
        self.gpu[dst] = old_src
        if plan.mode == "swap":
            self.gpu[src] = old_dst

    def apply_transfer(self, plan: TransferPlan) -> None:
        for src, dst in plan.pairs:
            if plan.kind == "store":
                self.cpu[dst] = self.gpu[src]
            else:
                self.gpu[dst] = self.cpu[src]

    def check(self, executor: Executor) -> None:
        for block_id, expected in enumerate(self.gpu):
            got = _bytes_row(executor.read_gpu_block(block_id))
            assert np.array_equal(got, expected), f"GPU block {block_id} holds the wrong bytes"
        for cpu_block_id in range(executor.config.num_cpu_blocks):
            factor = executor.config.block_size_factor
            for k, sub in enumerate(cpu_sub_blocks(executor, cpu_block_id)):
                expected = self.cpu[cpu_block_id * factor + k]
                assert np.array_equal(_bytes_row(sub), expected), (
                    f"CPU block {cpu_block_id} sub-block {k} holds the wrong bytes"
                )


def _bytes_row(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=np.uint8).copy()

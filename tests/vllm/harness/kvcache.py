"""The KV cache (Gaudi layout), CPU readers and the reference worker (the plain statement
of vLLM's CPU worker that the self-tests run)."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tests.vllm.harness.chunks import vllm_chunk_mapping
from tests.vllm.harness.configs import RunConfig
from tests.vllm.harness.workload import canary


class KvCache:
    """Per layer ``(key, value)`` flat slot-major int16 tensors with one pad block at the end."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.bs = cfg.block_size
        self.heads, self.head_size = cfg.num_kv_heads, cfg.head_size
        gen = torch.Generator().manual_seed(cfg.seed)
        shape = ((cfg.num_gpu_blocks + 1) * self.bs, self.heads, self.head_size)
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        for _ in range(cfg.num_layers):
            key = torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=gen)
            value = torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=gen)
            self.layers.append((key, value))
        self.tensors = [t for layer in self.layers for t in layer]
        self.arrays = [t.numpy() for t in self.tensors]

    def clone(self) -> KvCache:
        """The same cache over copies of its tensors (a shadow's own bytes)."""
        twin = copy.copy(self)
        twin.layers = [(k.clone(), v.clone()) for k, v in self.layers]
        twin.tensors = [t for layer in twin.layers for t in layer]
        twin.arrays = [t.numpy() for t in twin.tensors]
        return twin

    def gaudi_kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor, None, None]]:
        """``self.kv_caches`` as the HPU runner binds it: (key, value, key_scales, value_scales)."""
        return [(k, v, None, None) for k, v in self.layers]

    def kv_caches_4d(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """What the HPU runner registers with the connector (``get_kv_caches_4D``)."""
        n = self.cfg.num_gpu_blocks
        return {
            f"layer.{i}": (
                k.view(-1, self.bs, self.heads, self.head_size)[:n],
                v.view(-1, self.bs, self.heads, self.head_size)[:n],
            )
            for i, (k, v) in enumerate(self.layers)
        }

    def write(self, slots: np.ndarray, hashes: np.ndarray) -> None:
        for t, arr in enumerate(self.arrays):
            arr[slots] = canary(hashes, t, self.heads, self.head_size)

    def bad_slots(self, slots: np.ndarray, hashes: np.ndarray) -> np.ndarray:
        """Mask of slots whose bytes differ from their canary in any tensor."""
        bad = np.zeros(len(slots), dtype=bool)
        for t, arr in enumerate(self.arrays):
            want = canary(hashes, t, self.heads, self.head_size)
            bad |= (arr[slots] != want).reshape(len(slots), -1).any(axis=1)
        return bad

    def block_bad(self, physical: int, hashes: np.ndarray, known: np.ndarray) -> int:
        slots = np.arange(physical * self.bs, (physical + 1) * self.bs)[known]
        return int(self.bad_slots(slots, hashes[known]).sum())


class CpuReader:
    """Reads one CPU sub-block as per-tensor int16 ``(block_size, heads, head_size)`` arrays."""

    def __init__(self, kv: KvCache, cpu_tensors: list[torch.Tensor], bpc: int) -> None:
        self.kv = kv
        self.bpc = bpc
        self.views = [
            t.view(torch.int16).reshape(t.shape[0], bpc * kv.bs, kv.heads, kv.head_size).numpy()
            for t in cpu_tensors
        ]

    @classmethod
    def of_kvlog(cls, kv: KvCache, engine: Any, bpc: int) -> CpuReader:
        """kvlog's executor keeps one CPU tensor per canonical tensor, ``bpc`` sub-blocks per
        row; map them to our key/value tensors by storage address."""
        executor = engine.executor
        by_ptr = {
            t.view.data_ptr(): cpu
            for t, cpu in zip(executor.layout.tensors, executor.cpu_tensors, strict=True)
        }
        ordered = []
        for tensor in kv.tensors:
            if tensor.data_ptr() not in by_ptr:
                raise AssertionError("kvlog's executor does not hold one of the KV tensors")
            ordered.append(by_ptr[tensor.data_ptr()])
        return cls(kv, ordered, bpc)

    def bad(self, chunk: int, sub: int, hashes: np.ndarray, known: np.ndarray) -> int:
        bs = self.kv.bs
        bad = np.zeros(bs, dtype=bool)
        for t, view in enumerate(self.views):
            got = view[chunk, sub * bs : (sub + 1) * bs]
            want = canary(hashes, t, self.kv.heads, self.kv.head_size)
            bad |= (got != want).reshape(bs, -1).any(axis=1)
        return int((bad & known).sum())


@dataclass
class _RefResult:
    job_id: int
    success: bool
    transfer_size: int | None = None
    transfer_time: float | None = None


class ReferenceWorker:
    """vLLM 0.33's ``OffloadingWorker`` semantics on plain CPU tensors, without kvlog.

    Copies at submit (with ``resolve``: through the defragmenter's ids at submit time, as the
    seed handler effectively does) and reports at ``get_finished``. A harness self-test only.
    """

    def __init__(self, kv: KvCache, bpc: int, num_chunks: int, resolve: Any = None) -> None:
        self.kv, self.bpc, self.resolve = kv, bpc, resolve
        page = kv.bs * kv.heads * kv.head_size * 2
        self.cpu = [torch.zeros((num_chunks, page * bpc), dtype=torch.int8) for _ in kv.tensors]
        self.reader = CpuReader(kv, self.cpu, bpc)
        self._done: list[_RefResult] = []

    def _phys(self, b: int) -> int:
        return int(self.resolve(b)) if self.resolve is not None else b

    def _copy(self, job_id: int, gpu_spec: Any, cpu_ids: Sequence[int], store: bool) -> bool:
        bs = self.kv.bs
        for gpu, chunk, sub, _ in vllm_chunk_mapping(gpu_spec, cpu_ids, self.bpc):
            phys = self._phys(gpu)
            for arr, view in zip(self.kv.arrays, self.reader.views, strict=True):
                if store:
                    view[chunk, sub * bs : (sub + 1) * bs] = arr[phys * bs : (phys + 1) * bs]
                else:
                    arr[phys * bs : (phys + 1) * bs] = view[chunk, sub * bs : (sub + 1) * bs]
        self._done.append(_RefResult(job_id, True))
        return True

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        return self._copy(job_id, src_spec, np.asarray(dst_spec.block_ids).tolist(), True)

    def submit_load(
        self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False
    ) -> bool:
        return self._copy(job_id, dst_spec, np.asarray(src_spec.block_ids).tolist(), False)

    def get_finished(self) -> list[_RefResult]:
        out, self._done = self._done, []
        return out

    def wait(self, job_ids: set[int]) -> None:
        pass

    def shutdown(self) -> None:
        pass

"""The one Engine that the defragmenter facade and the offloading facades share.

Sharing is what makes the combination safe: a store resolves its (logical) GPU ids through
the same forward table that defrag updates, and defrag sees the blocks that unfinished
transfers pin. The session is created by the defragmenter facade; the offloading facades
attach to it. The Engine starts lazily, at the first event after ``initialize()``, so the
offloading side can still declare its CPU pool (``attach_offload``) during start-up: the
log's ``CacheConfigured`` then carries the whole geometry.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import numpy as np
import torch

from kvlog.engine import Engine
from kvlog.errors import ConfigError, LayoutError
from kvlog.events import (
    DEFAULT_PAD_SIZES,
    BlocksAllocated,
    CacheConfigured,
    Event,
    Plan,
    RequestFinished,
)
from kvlog.executors import TransferResult, make_executor
from kvlog.executors.layouts import KVCaches, register_layout
from kvlog.integrations.config import FacadeConfig

__all__ = ["HOLD_PREFIX", "Backend", "JobKind", "KvCacheSession", "derive_num_gpu_blocks"]

HOLD_PREFIX = "kvlog-load-hold-"
"""Request ids of the placeholders that hold loaded blocks (see ``KvCacheSession.hold``)."""

Backend = Literal["auto", "cpu", "cuda", "hpu", "fake"]
JobKind = Literal["store", "load"]


def _first_tensor(kv_caches: KVCaches) -> torch.Tensor:
    layers = list(kv_caches.values()) if isinstance(kv_caches, Mapping) else list(kv_caches)
    if not layers:
        raise LayoutError("kv_caches is empty: initialize() needs at least one layer")
    layer = layers[0]
    tensor = layer if isinstance(layer, torch.Tensor) else layer[0]
    if not isinstance(tensor, torch.Tensor):
        raise LayoutError("the first layer of kv_caches holds no key tensor")
    return tensor


def derive_num_gpu_blocks(kv_caches: KVCaches, block_size: int) -> int:
    """``num_gpu_blocks`` of HPU-layout caches: first dim is ``(num_blocks + 1) * block_size``."""
    num_slots = int(_first_tensor(kv_caches).shape[0])
    if block_size < 1 or num_slots % block_size or num_slots // block_size < 2:
        raise LayoutError(
            f"key cache of {num_slots} slots is not (num_blocks + 1) * block_size "
            f"with block_size={block_size} and num_blocks >= 1"
        )
    return num_slots // block_size - 1


def _auto_backend(kv_caches: KVCaches) -> str:
    device = _first_tensor(kv_caches).device.type
    return device if device in ("cuda", "hpu") else "cpu"


def _log_path(config: FacadeConfig) -> str | None:
    """``KVLOG_PATH`` with ``{pid}`` replaced (one log per worker process); a path that
    already holds a log (a restarted server) becomes ``name.1.ext``, ``name.2.ext``, ..."""
    if config.log_path is None:
        return None
    path = config.log_path.replace("{pid}", str(os.getpid()))
    stem, ext = os.path.splitext(path)
    candidate, n = path, 0
    while os.path.exists(candidate) and os.path.getsize(candidate) > 0:
        n += 1
        candidate = f"{stem}.{n}{ext}"
    return candidate


class KvCacheSession:
    """Owns the Engine, its executor and its log; routes transfer completions to facades."""

    def __init__(
        self,
        config: FacadeConfig,
        *,
        prefix_caching: bool = False,
        backend: Backend = "auto",
        max_swaps: int = DEFAULT_PAD_SIZES[-1],
        pad_sizes: Sequence[int] = DEFAULT_PAD_SIZES,
        executor_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.config = config
        self.prefix_caching = prefix_caching
        self.backend = backend
        self.max_swaps = max_swaps
        self.pad_sizes = tuple(pad_sizes)
        self.executor_options = dict(executor_options or {})
        self.kv_caches: KVCaches | None = None
        self.block_size = 0
        self.num_cpu_blocks = 0
        self.block_size_factor = 1
        self._engine: Engine | None = None
        self._kinds: dict[int, JobKind] = {}
        self._finished: dict[JobKind, list[TransferResult]] = {"store": [], "load": []}
        self._holds: dict[int, str] = {}
        self.step = 0

    # -- start-up ------------------------------------------------------------------------
    def bind_caches(self, kv_caches: KVCaches, block_size: int) -> None:
        """Remember the runner's caches; the Engine starts on first use."""
        if self._engine is not None:
            raise ConfigError("kv_caches", "<tensors>", "initialize() before the first step")
        derive_num_gpu_blocks(kv_caches, block_size)
        self.kv_caches = kv_caches
        self.block_size = block_size

    def attach_offload(self, num_cpu_blocks: int, block_size_factor: int) -> None:
        """Declare the CPU pool; only before the first step, or again with the same values."""
        same = (num_cpu_blocks, block_size_factor) == (self.num_cpu_blocks, self.block_size_factor)
        if self._engine is not None and not same:
            raise ConfigError("num_cpu_blocks", num_cpu_blocks, "attach before the first step")
        if type(num_cpu_blocks) is not int or num_cpu_blocks < 0:
            raise ConfigError("num_cpu_blocks", num_cpu_blocks, "a non-negative int")
        if type(block_size_factor) is not int or block_size_factor < 1:
            raise ConfigError("block_size_factor", block_size_factor, "a positive int")
        self.num_cpu_blocks = num_cpu_blocks
        self.block_size_factor = block_size_factor

    @property
    def started(self) -> bool:
        return self._engine is not None

    def cache_config(self) -> CacheConfigured:
        """The log's first event, from the caches and the configuration."""
        if self.kv_caches is None:
            raise ConfigError("kv_caches", None, "initialize(kv_caches, block_size) first")
        num_gpu_blocks = derive_num_gpu_blocks(self.kv_caches, self.block_size)
        layout = register_layout(self.kv_caches, num_gpu_blocks, self.block_size, "hpu")
        return CacheConfigured(
            num_gpu_blocks=num_gpu_blocks,
            block_size=self.block_size,
            num_cpu_blocks=self.num_cpu_blocks,
            block_size_factor=self.block_size_factor,
            prefix_caching=self.prefix_caching,
            defrag=self.config.defrag,
            threshold=self.config.threshold,
            max_swaps=self.max_swaps,
            pad_sizes=self.pad_sizes,
            page_size_bytes=layout.page_size_bytes,
        )

    @property
    def engine(self) -> Engine:
        """The Engine, started now if this is its first use."""
        if self._engine is None:
            config = self.cache_config()
            assert self.kv_caches is not None, "cache_config() checked the caches"
            backend = _auto_backend(self.kv_caches) if self.backend == "auto" else self.backend
            executor = make_executor(
                self.kv_caches, config, backend=backend, layout="hpu", **self.executor_options
            )
            self._engine = Engine(
                config, log_path=_log_path(self.config), executor=executor, sync=self.config.sync
            )
        return self._engine

    # -- running -------------------------------------------------------------------------
    def apply(self, event: Event) -> list[Plan]:
        return self.engine.apply(event)

    def submitted(self, job_id: int, kind: JobKind) -> None:
        self._kinds[job_id] = kind

    def poll(self) -> None:
        """Collect finished transfers (the Engine logs them) into per-direction queues."""
        if self._engine is None:
            return
        self._route(self._engine.poll())

    def take_finished(self, kinds: Iterable[JobKind]) -> list[TransferResult]:
        self.poll()
        out: list[TransferResult] = []
        for kind in kinds:
            out.extend(self._finished[kind])
            self._finished[kind].clear()
        return out

    def wait(self, job_ids: Iterable[int] | None) -> None:
        """Block until those jobs (every job, for None) finish; results stay queued."""
        if self._engine is None:
            return
        ids = None if job_ids is None else [j for j in job_ids if j in self._kinds]
        if ids is not None and not ids:
            return
        self._route(self._engine.wait(ids))

    def _route(self, results: Iterable[TransferResult]) -> None:
        for result in results:
            kind = self._kinds.pop(result.job_id, "store")
            self._finished[kind].append(result)

    # -- blocks a load writes before the runner sees their request -----------------------
    def hold(self, job_id: int, gpu_block_ids: list[int]) -> None:
        """Give a load's destination blocks that no request holds to a placeholder request.

        vLLM allocates a request's blocks, loads into them, and reports the request to the
        runner only when it is scheduled, possibly steps after the load ended. Until then
        the blocks must count as used, or defrag would move other blocks into them.
        """
        state = self.engine.state
        physical = state.resolve_array(np.asarray(gpu_block_ids, dtype=np.int64))
        unowned = [
            b
            for b, p in zip(gpu_block_ids, physical.tolist(), strict=True)
            if state.refs[p] == 0 and b not in self._holds
        ]
        if unowned:
            hold_id = f"{HOLD_PREFIX}{job_id}"
            self.apply(BlocksAllocated(req_id=hold_id, block_ids=unowned))
            self._holds.update(dict.fromkeys(unowned, hold_id))

    def release_holds(self, block_ids: Iterable[int]) -> None:
        """Release every placeholder that holds one of ``block_ids`` (a request claims them)."""
        if not self._holds:
            return
        hold_ids = sorted({self._holds[b] for b in block_ids if b in self._holds})
        for hold_id in hold_ids:
            self.apply(RequestFinished(req_id=hold_id))
        if hold_ids:
            released = set(hold_ids)
            self._holds = {b: h for b, h in self._holds.items() if h not in released}

    @property
    def held_blocks(self) -> dict[int, str]:
        """Logical block -> the placeholder request that holds it for a load."""
        return dict(self._holds)

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()

"""vLLM's objects for a run (scheduler, connector config, requests) and kvlog's defragmenter
as the HPU runner builds it."""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Iterator
from typing import Any

import torch

from kvlog.synth.vllm_stubs import build_scheduler
from kvlog.synth.vllm_stubs import make_request as stub_request
from tests.vllm.harness.chunks import _cdiv
from tests.vllm.harness.configs import KVLOG_CONNECTOR, RunConfig
from tests.vllm.harness.kvcache import KvCache
from tests.vllm.harness.workload import Sequence_


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def page_bytes_per_block(cfg: RunConfig) -> int:
    return 2 * cfg.num_layers * cfg.block_size * cfg.num_kv_heads * cfg.head_size * 2


def build_vllm(cfg: RunConfig) -> tuple[Any, Any, Any]:
    """(vllm_config, kv_cache_config, scheduler); call inside ``_env(VLLM_USE_V2_MODEL_RUNNER)``."""
    import mmap

    from vllm.config import KVTransferConfig

    max_model_len = 1024
    bpc = cfg.blocks_per_chunk
    chunk_bytes = _cdiv(page_bytes_per_block(cfg) * bpc, mmap.PAGESIZE) * mmap.PAGESIZE
    extra: dict[str, Any] = {
        "cpu_bytes_to_use": cfg.cpu_chunks * chunk_bytes,
        "blocks_per_chunk": bpc,
    }
    extra["offload_prompt_only"] = cfg.offload_prompt_only
    if cfg.connector == "kvlog":
        extra["kvlog_backend"] = cfg.backend
    if cfg.sync_loads:
        extra["sync_load_budget_bytes"] = 1 << 20
    name, module = KVLOG_CONNECTOR if cfg.connector == "kvlog" else ("OffloadingConnector", None)
    kv_transfer = KVTransferConfig(
        kv_connector=name,
        kv_connector_module_path=module,
        kv_role="kv_both",
        kv_connector_extra_config=extra,
    )
    if cfg.connector == "none":
        kv_transfer = None
    vllm_config, kv_cache_config, scheduler = build_scheduler(
        num_gpu_blocks=cfg.num_gpu_blocks,
        block_size=cfg.block_size,
        max_model_len=max_model_len,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_num_seqs=cfg.max_num_seqs,
        prefix_caching=cfg.prefix_caching,
        layer_names=[f"layer.{i}" for i in range(cfg.num_layers)],
        num_kv_heads=cfg.num_kv_heads,
        head_size=cfg.head_size,
        dtype=torch.int16,
        kv_transfer_config=kv_transfer,
        async_scheduling=cfg.async_scheduling,
        model="kvlog-harness-stub",
    )
    v2_runner = getattr(scheduler, "use_v2_model_runner", None)  # None: 0.34, V2 only
    if v2_runner is not None and v2_runner != cfg.v2_runner:
        raise AssertionError("VLLM_USE_V2_MODEL_RUNNER did not select the runner shape")
    return vllm_config, kv_cache_config, scheduler


def make_request(seq: Sequence_, block_size: int) -> Any:
    return stub_request(seq.req_id, seq.prompt, seq.max_tokens, block_size)


def make_defragmenter(kv: KvCache, cfg: RunConfig, log_path: str | None) -> Any:
    """``OnlineDefragmenter(kv_caches, block_size, ...)`` as the HPU runner builds it, or the
    older no-argument constructor plus ``initialize()`` where the positional one is missing."""
    from kvlog.integrations import OnlineDefragmenter

    kwargs: dict[str, Any] = {
        "prefix_caching": cfg.prefix_caching,
        "threshold": cfg.threshold,
        "defrag": cfg.defrag,
        "backend": cfg.backend,
        "log_path": log_path,
        "sync": cfg.log_sync,
    }
    params = inspect.signature(OnlineDefragmenter).parameters
    if "kv_caches" in params:
        return OnlineDefragmenter(kv.gaudi_kv_caches(), cfg.block_size, **kwargs)
    defrag = OnlineDefragmenter(environ={}, **kwargs)
    defrag.initialize(kv.gaudi_kv_caches(), cfg.block_size)
    return defrag


def _internal_id(req_id: str, known: set[str]) -> bool:
    return req_id not in known

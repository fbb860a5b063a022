"""vLLM 0.33's v1 scheduler with no model, built the way vLLM's own tests build it: a stub
``ModelConfig``, the scheduler for a pool and its limits, and requests with vLLM's block
hasher. Shared by ``--scheduler vllm`` (``vllm_scheduler.py``) and the real-vLLM harness
(``tests/harness``). vLLM is not a dependency: without it ``MissingExtra`` says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvlog.errors import MissingExtra
from kvlog.util import vllm_compat

__all__ = ["VOCAB", "StubModelConfig", "build_scheduler", "make_request"]

VOCAB = 32000
"""The stub model's vocabulary size."""


class StubModelConfig:
    """What vLLM's scheduler, ``StructuredOutputManager`` and offloading connector read of a
    ``ModelConfig``."""

    def __init__(self, max_model_len: int, num_kv_heads: int, dtype: Any, model: str) -> None:
        self.max_model_len = max_model_len
        self.uses_mrope = False
        self.is_encoder_decoder = False
        self.runner_type = "generate"
        self.is_diffusion = False
        self.supports_multimodal_inputs = False
        self.is_multimodal_model = False  # vLLM 0.26 asks these two
        self.enable_return_routed_experts = False
        self.is_moe = False  # and 0.26 picks its default runner by this
        self.return_sampling_mask = False
        self.skip_tokenizer_init = True
        self.multimodal_config = None
        self.use_mla = False
        self.dtype = dtype
        self.model = model
        self._heads = num_kv_heads

    def get_vocab_size(self) -> int:
        return VOCAB

    def get_total_num_kv_heads(self) -> int:
        return self._heads


def build_scheduler(
    *,
    num_gpu_blocks: int,
    block_size: int,
    max_model_len: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    prefix_caching: bool,
    layer_names: Sequence[str] = ("layer.0",),
    num_kv_heads: int = 8,
    head_size: int = 128,
    dtype: Any = None,
    kv_transfer_config: Any = None,
    async_scheduling: bool | None = None,
    model: str = "kvlog-stub",
) -> tuple[Any, Any, Any]:
    """``(vllm_config, kv_cache_config, scheduler)``: vLLM's ``Scheduler`` (or
    ``AsyncScheduler`` when ``async_scheduling``; None leaves vLLM's setting to vLLM) on CPU
    for one full-attention KV-cache group over ``layer_names``; ``dtype`` defaults to
    bfloat16."""
    try:
        import torch
        from vllm.config import CacheConfig, DeviceConfig, SchedulerConfig, VllmConfig
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec
        from vllm.v1.structured_output import StructuredOutputManager
    except ImportError as exc:
        raise MissingExtra("vllm", "vllm", "vLLM's own scheduler") from exc
    dtype = torch.bfloat16 if dtype is None else dtype
    scheduler_config = SchedulerConfig(
        max_model_len=max_model_len,
        is_encoder_decoder=False,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        enable_chunked_prefill=True,
        async_scheduling=async_scheduling,
    )
    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching)
    vllm_config = VllmConfig(
        cache_config=cache_config,
        scheduler_config=scheduler_config,
        device_config=DeviceConfig(device="cpu"),
        kv_transfer_config=kv_transfer_config,
    )
    vllm_config.model_config = StubModelConfig(max_model_len, num_kv_heads, dtype, model)
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype
    )
    kv_cache_config = _kv_cache_config(num_gpu_blocks, list(layer_names), spec)
    cache_config.num_gpu_blocks = num_gpu_blocks
    cls = AsyncScheduler if async_scheduling else Scheduler
    scheduler = cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
        hash_block_size=block_size,
        log_stats=False,
    )
    return vllm_config, kv_cache_config, scheduler


def _kv_cache_config(num_gpu_blocks: int, layer_names: list[str], spec: Any) -> Any:
    """One KV-cache group of ``spec`` over ``layer_names``, its allocation described the way
    the installed vLLM sizes its CPU tier by (``vllm_compat.kv_cache_tensors``)."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    total_bytes = spec.page_size_bytes * len(layer_names) * num_gpu_blocks
    return KVCacheConfig(
        num_blocks=num_gpu_blocks,
        kv_cache_tensors=vllm_compat.kv_cache_tensors(KVCacheTensor, total_bytes, layer_names),
        kv_cache_groups=[KVCacheGroupSpec(layer_names, spec)],
    )


_HASHERS: dict[int, Any] = {}


def _block_hasher(block_size: int) -> Any:
    """vLLM's request block hasher (sha256) for ``block_size``, built once per size."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    if not _HASHERS:
        init_none_hash(sha256)
    if block_size not in _HASHERS:
        _HASHERS[block_size] = get_request_block_hasher(block_size, sha256)
    return _HASHERS[block_size]


def make_request(req_id: str, prompt: Sequence[int], max_tokens: int, block_size: int) -> Any:
    """A vLLM ``Request`` that samples ``max_tokens`` tokens (EOS ignored)."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(
        request_id=req_id,
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        pooling_params=None,
        block_hasher=_block_hasher(block_size),
    )

"""Drop-in facades for vLLM on Gaudi and vLLM's KV offloading interfaces.

    from kvlog.integrations import OnlineDefragmenter          # the HPU model runner's
    from kvlog.integrations import OffloadingWorker            # vLLM's CPU offloading worker
    from kvlog.integrations import OffloadingHandlers          # the older per-direction shape

The defragmenter owns one Engine (and its log, with ``KVLOG_PATH``); the offloading facades
share it, so stores and loads resolve logical ids and pin what they read or write.
Neither vLLM nor the Gaudi stack is imported: specs are duck-typed (``.block_ids``).
"""

from kvlog.integrations.config import FacadeConfig, config_from_env
from kvlog.integrations.defragmenter import CacheSwapHandle, OnlineDefragmenter
from kvlog.integrations.offload import (
    OffloadingHandler,
    OffloadingHandlers,
    OffloadingWorker,
    TransferResult,
    block_ids_of,
)
from kvlog.integrations.session import KvCacheSession, derive_num_gpu_blocks
from kvlog.util.vllm_compat import SUPPORTED_VLLM

__all__ = [
    "SUPPORTED_VLLM",
    "CacheSwapHandle",
    "FacadeConfig",
    "KvCacheSession",
    "OffloadingHandler",
    "OffloadingHandlers",
    "OffloadingWorker",
    "OnlineDefragmenter",
    "TransferResult",
    "block_ids_of",
    "config_from_env",
    "derive_num_gpu_blocks",
]

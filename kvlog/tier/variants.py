"""The CPU tier's variants: what one what-if configures (:class:`TierVariant`), what it
counts (:class:`TierTally`), and the flags no what-if can use, refused before any work
(:func:`check_tier_values`). Shared by the what-if runner, the offline optimum, the tier's
recorder and the command line."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvlog.errors import ConfigError

__all__ = ["EVICTIONS", "TierTally", "TierVariant", "check_tier_values"]

EVICTIONS: tuple[str, ...] = ("lru", "arc", "opt")


@dataclass(frozen=True)
class TierVariant:
    """One configuration of the tier to try."""

    eviction: str = "lru"
    num_chunks: int = 1024
    store_threshold: int = 0
    tokens_per_chunk: int = 512
    chunk_bytes: int = 512 * 131072
    keys_per_step: int = 16
    max_tracker_size: int = 64_000

    def __post_init__(self) -> None:
        if self.eviction not in EVICTIONS:
            raise ConfigError("eviction", self.eviction, f"one of {list(EVICTIONS)}")
        for name in ("num_chunks", "tokens_per_chunk", "keys_per_step", "max_tracker_size"):
            if getattr(self, name) < 1:
                raise ConfigError(name, getattr(self, name), "an integer >= 1")


@dataclass
class TierTally:
    """Counts of one run (blocks are chunks)."""

    accesses: int = 0
    blocks_asked: int = 0
    blocks_hit: int = 0
    blocks_stored: int = 0
    evictions: int = 0
    never_read: int = 0
    refused_stores: int = 0


def check_tier_values(
    *,
    evictions: Sequence[str],
    store_thresholds: Sequence[int],
    tokens_per_chunk: int,
    bytes_per_token: int,
    gpu_tokens: int,
    prefill_us_per_token: float = 0.0,
) -> None:
    """The CPU tier flags no what-if can use, refused (ConfigError naming the flag) before
    any work, for ``kvlog sweep --cpu-bytes`` and ``python -m kvlog.tier.synth`` alike: a
    NaN or infinite prefill price would fill the table with ``nan s``, and a negative
    store threshold or GPU token count would run as if it were 0."""
    for name in evictions:
        if name not in EVICTIONS:
            raise ConfigError("--eviction", list(evictions), f"names from {list(EVICTIONS)}")
    if tokens_per_chunk < 1 or 512 % tokens_per_chunk:
        raise ConfigError("--tokens-per-chunk", tokens_per_chunk, "a divisor of 512")
    if not 0 <= prefill_us_per_token < math.inf:  # False for NaN too
        raise ConfigError("--prefill-us-per-token", prefill_us_per_token, "a time >= 0")
    if bytes_per_token < 1:
        raise ConfigError("--bytes-per-token", bytes_per_token, "an integer >= 1")
    if any(t < 0 for t in store_thresholds):
        shown = store_thresholds[0] if len(store_thresholds) == 1 else list(store_thresholds)
        raise ConfigError("--store-threshold", shown, "ints >= 0")
    if gpu_tokens < 0:
        raise ConfigError("--gpu-tokens", gpu_tokens, "an int >= 0 (0: no preemption)")

"""Small engines the tests share."""

from __future__ import annotations

from pathlib import Path

from kvlog import Engine
from kvlog.events import BlocksAllocated, CacheConfigured, StepEnded, StoreRequested

__all__ = ["BUSY_CONFIG", "busy_engine"]

BUSY_CONFIG = CacheConfigured(num_gpu_blocks=64, block_size=16, num_cpu_blocks=8, threshold=4)


def busy_engine(path: Path | None = None) -> Engine:
    """Two requests, a store pinning block 41, one step whose defrag moves them down."""
    engine = Engine(BUSY_CONFIG, path, sync="none")
    engine.apply(BlocksAllocated("a", [40, 41, 42]))
    engine.apply(BlocksAllocated("b", [50, 60]))
    engine.apply(StoreRequested(1, [41], [3]))
    engine.apply(StepEnded(0))  # defrag moves a and b down, around the pinned block
    return engine

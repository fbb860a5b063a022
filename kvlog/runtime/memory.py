"""Whether this machine can hold a state: the bytes a pool's state and its checkpoints need,
and the memory available (MemAvailable, capped by a cgroup limit)."""

from __future__ import annotations

from kvlog.errors import StateTooLarge
from kvlog.events import CacheConfigured

__all__ = [
    "STATE_BYTES_PER_BLOCK",
    "WORK_BYTES_PER_BLOCK",
    "available_memory",
    "check_state_memory",
    "state_bytes",
]

STATE_BYTES_PER_BLOCK = 21
"""Bytes the state keeps per GPU block: five int32 arrays, two bitmaps and summaries."""
WORK_BYTES_PER_BLOCK = 24
"""Bytes per GPU block a checkpoint or a restore needs on top, while it runs."""


def state_bytes(config: CacheConfigured) -> int:
    """Bytes the state of ``config`` keeps (without request tables and jobs)."""
    return STATE_BYTES_PER_BLOCK * int(config.num_gpu_blocks)


def available_memory() -> int | None:
    """Bytes this process may still allocate: MemAvailable, capped by a cgroup limit; None
    where neither can be read."""
    found: list[int] = []
    try:
        with open("/proc/meminfo", encoding="ascii") as file:
            for line in file:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max", encoding="ascii") as limit_file:
            limit = limit_file.read().strip()
        with open("/sys/fs/cgroup/memory.current", encoding="ascii") as current_file:
            current = int(current_file.read().strip())
        if limit != "max":
            found.append(max(int(limit) - current, 0))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def check_state_memory(config: CacheConfigured, *, resident: bool = False) -> None:
    """``StateTooLarge`` when the state of ``config`` (plus the room a checkpoint needs)
    does not fit in the memory this machine has available. ``resident``: the state is
    already allocated; only the working room must fit."""
    need = WORK_BYTES_PER_BLOCK * int(config.num_gpu_blocks)
    if not resident:
        need += state_bytes(config)
    free = available_memory()
    if free is not None and need > free:
        raise StateTooLarge(
            f"{config.num_gpu_blocks:,} GPU blocks need about {need / 2**20:,.0f} MiB for the "
            f"state and its checkpoints; {free / 2**20:,.0f} MiB are available",
            config,
        )

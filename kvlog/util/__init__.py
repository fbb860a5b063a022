"""Leaves every layer may use: byte sizes and percentiles (``units``), CRC-32C (``crc32c``),
splitmix64 (``splitmix``), and numba compilation with kvlog's caching rule (``jit``).
Nothing here imports the rest of kvlog."""

from __future__ import annotations

__all__: list[str] = []

"""splitmix64, once: the well-spread 64-bit mixing kvlog uses for digests (the reducers'
kernels, which compile the same arithmetic), canary bytes and synthetic token ids.

``mix64(x)`` is splitmix64's finalizer; ``splitmix64(x)`` adds the golden-ratio increment
first (the generator's output for state ``x``); ``mix64_array`` is the finalizer over a
uint64 array, wrapping. A leaf module: every layer may import it.
"""

from __future__ import annotations

import numpy as np

__all__ = ["GOLDEN", "M1", "M2", "MASK64", "mix64", "mix64_array", "splitmix64"]

GOLDEN = 0x9E3779B97F4A7C15
M1, M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
MASK64 = (1 << 64) - 1


def mix64(x: int) -> int:
    """splitmix64's finalizer of ``x`` (an int in ``[0, 2**64)``; a bijection there)."""
    x = ((x ^ (x >> 30)) * M1) & MASK64
    x = ((x ^ (x >> 27)) * M2) & MASK64
    return x ^ (x >> 31)


def splitmix64(x: int) -> int:
    """splitmix64's output for state ``x``: the finalizer of ``x + GOLDEN``."""
    return mix64((x + GOLDEN) & MASK64)


def mix64_array(x: np.ndarray) -> np.ndarray:
    """:func:`mix64` of every element of a uint64 array (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(M1)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(M2)
        out: np.ndarray = x ^ (x >> np.uint64(31))
    return out

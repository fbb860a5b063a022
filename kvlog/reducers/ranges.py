"""Block-id range checks shared by the reducers."""

from __future__ import annotations

import numpy as np

from kvlog.errors import BlockOutOfRange
from kvlog.events import Event
from kvlog.reducers.blockset import IdArray

__all__ = ["check_block_range"]


def check_block_range(event: Event, name: str, block_ids: list[int], size: int) -> IdArray:
    """The ids as int64, or ``BlockOutOfRange`` naming the first id not below ``size``."""
    if block_ids and (max(block_ids) >= size or min(block_ids) < 0):
        bad = next(b for b in block_ids if not 0 <= b < size)
        raise BlockOutOfRange(f"{name} holds block id {bad}, outside [0, {size})", event)
    return np.fromiter(block_ids, np.int64, len(block_ids))

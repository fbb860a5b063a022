"""Block-id range checks shared by the reducers."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvlog.errors import BlockOutOfRange, InvalidEvent
from kvlog.events import Event
from kvlog.reducers.blockset import IdArray

__all__ = ["check_block_range", "check_id_dtype", "holds_pool_ids"]


def check_block_range(event: Event, name: str, block_ids: list[int], size: int) -> IdArray:
    """The ids as int64, or ``BlockOutOfRange`` naming the first id not below ``size``."""
    if block_ids and (max(block_ids) >= size or min(block_ids) < 0):
        bad = next(b for b in block_ids if not 0 <= b < size)
        raise BlockOutOfRange(f"{name} holds block id {bad}, outside [0, {size})", event)
    return np.fromiter(block_ids, np.int64, len(block_ids))


def check_id_dtype(dtype: np.dtype[Any], size: int) -> None:
    """Refuse an id array that cannot carry every block id of a ``size``-block pool: not
    integers, or too narrow (a resolved id would wrap, e.g. block 299 in int8 as 43). A few
    attribute reads: the Gaudi facade pays it on every step's ``resolve_all``."""
    if dtype.kind not in "iu":  # numpy's integer kinds (bool is "b")
        raise InvalidEvent(f"block ids must be integers, not {dtype}")
    if not holds_pool_ids(dtype, size):
        raise InvalidEvent(
            f"block ids of dtype {dtype} cannot hold the ids of a {size}-block pool "
            f"(up to {size - 1}); use int32 or int64"
        )


def holds_pool_ids(dtype: np.dtype[Any], size: int) -> bool:
    """Whether an integer ``dtype`` holds every block id of a ``size``-block pool (its
    largest value is at least ``size - 1``)."""
    signed = dtype.kind == "i"
    return (1 << (8 * dtype.itemsize - signed)) - 1 >= size - 1

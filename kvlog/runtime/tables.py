"""Block tables as the runners hand them to ``resolve_all``: rows of int64 ids, checked."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from kvlog.errors import (
    BlockOutOfRange,
)

__all__ = ["block_table_row"]

if TYPE_CHECKING:
    pass


def block_table_row(row: Any) -> np.ndarray:
    """One row of a list of block tables as int64 ids, checked: integers only (no floats,
    bools or strings cast on the way), each within int64."""
    try:
        array = np.asarray(row)
    except (TypeError, ValueError) as exc:
        raise BlockOutOfRange(f"block tables must hold int64 block ids: {exc}") from exc
    if array.size == 0:
        return array.astype(np.int64)
    if array.dtype.kind not in "iu":  # numpy's integer kinds (bool is "b")
        raise BlockOutOfRange(f"block tables must hold int64 block ids, not {array.dtype}")
    if array.dtype == np.uint64 and int(array.max()) > np.iinfo(np.int64).max:
        raise BlockOutOfRange(f"block id {int(array.max())} is outside int64")
    return array.astype(np.int64, copy=False)  # a list of ints is int64 already

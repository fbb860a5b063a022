"""Readers' view of batch records: the events a ``TransferBatch`` (a connector call's
transfer events) or a ``TierBatch`` (a scheduler step's CPU tier calls) holds, one by one.

A batch is exactly its events applied in order (``reducers/transfer_batch.py``; the tier
reducer folds a ``TierBatch``'s events one after another), so a reader that counts or
follows jobs or tier calls sees the same events in both forms of a log by unpacking batches.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from kvlog.events.types import TierBatch, TransferBatch

__all__ = ["unbatched"]

_BATCHES = (TransferBatch, TierBatch)


def unbatched(records: Iterable[Any]) -> Iterator[Any]:
    """``records`` with each batch record replaced by its events (others unchanged)."""
    for record in records:
        if type(record) in _BATCHES:
            yield from record.events
        else:
            yield record

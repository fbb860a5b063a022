"""Readers' view of ``TransferBatch`` records: the transfer events they hold, one by one.

A batch is exactly its events applied in order (``reducers/transfer_batch.py``), so a reader
that counts or follows jobs (which stores finished, which loads failed) sees the same
events in both forms of a log by unpacking batches.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from kvlog.events.types import TransferBatch

__all__ = ["unbatched"]


def unbatched(records: Iterable[Any]) -> Iterator[Any]:
    """``records`` with each ``TransferBatch`` replaced by its events (others unchanged)."""
    for record in records:
        if type(record) is TransferBatch:
            yield from record.events
        else:
            yield record

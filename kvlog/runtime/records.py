"""The events the Engine takes, as records: made plain (numpy ids from vLLM become ints) and
refused before the log when one could not be a record (``RecordRejected``), with a cheap
upper bound of the encoded size so that only huge events are encoded to be measured."""

from __future__ import annotations

import typing
from typing import TYPE_CHECKING

from kvlog.errors import (
    RecordRejected,
)
from kvlog.events import (
    Event,
    StepScheduled,
    encode,
)
from kvlog.events.validate import MAX_REQ_ID_LENGTH, normalize_event
from kvlog.log import (
    MAX_RECORD_BYTES,
)

__all__ = ["check_record_size", "plain_event", "size_bound"]

if TYPE_CHECKING:
    pass

_EVENT_TYPES = frozenset(typing.get_args(Event))


def plain_event(event: Event) -> Event:
    """An event that failed its check, with numpy ids made plain (vLLM hands int32 arrays);
    itself when nothing changed. A non-event is ``RecordRejected``."""
    if type(event) not in _EVENT_TYPES:
        raise RecordRejected(f"not an event: {type(event).__name__}")
    plain: Event = normalize_event(event)
    return plain


def check_record_size(event: Event) -> None:
    """Raise ``RecordRejected`` for a (valid) event too large for a log record."""
    if size_bound(event) > MAX_RECORD_BYTES and len(encode(event)) > MAX_RECORD_BYTES:
        raise RecordRejected(
            f"{type(event).__name__} encodes to more than {MAX_RECORD_BYTES} bytes"
        )


def size_bound(event: Event) -> int:
    """An upper bound of the event's encoded size (for valid field values)."""
    if type(event) is StepScheduled:  # ids are at most 4 bytes a character, ints 9
        num_ids = sum(map(len, event.allocated.values()))
        num_requests = len(event.allocated) + len(event.finished)
        num_requests += len(event.preempted) + len(event.resumed)
        return 128 + 9 * num_ids + num_requests * (32 + 4 * MAX_REQ_ID_LENGTH)
    total = 64
    for name in event.__struct_fields__:
        value = getattr(event, name)
        if isinstance(value, dict):  # StepScheduled.allocated
            total += 16 + sum(32 + 4 * len(k) + 9 * len(v) for k, v in value.items())
        elif isinstance(value, (list, tuple)):
            total += 16 + sum(16 + 4 * len(v) if isinstance(v, str) else 9 for v in value)
        elif isinstance(value, str):
            total += 16 + 4 * len(value)
        elif isinstance(value, bytes):  # StepPacked's packed ids
            total += 16 + len(value)
        else:
            total += 16 + 9
    return total

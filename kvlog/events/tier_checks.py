"""Stateless validation of the CPU tier's events (``TIER_EVENTS``).

Shapes only: lists of key bytes, parallel position and chunk lists, a known lookup answer.
Whether a key is resident or a chunk free is the tier reducer's business
(``reducers/cpu_tier.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvlog.errors import InvalidEvent
from kvlog.events.types import (
    MAX_TIER_BATCH,
    TIER_EVICTIONS,
    TIER_LOOKUP_RESULTS,
    TIER_RULES,
    TierBatch,
    TierConfigured,
    TierLoadCompleted,
    TierLoadPrepared,
    TierLookedUp,
    TierRequestFinished,
    TierRequestStarted,
    TierReset,
    TierStoreCompleted,
    TierStorePrepared,
    TierTouched,
)

__all__ = ["MAX_KEY_BYTES", "MAX_TIER_CHUNKS", "TIER_VALIDATORS"]

MAX_KEY_BYTES = 1024
"""Longest offload key (vLLM's are a 32-byte hash and a 4-byte group)."""
MAX_TIER_CHUNKS = 1 << 31
"""Most chunks a tier may have."""
_MAX_INT = 2**63 - 1


def _int(event: Any, name: str, value: object, lo: int, hi: int = _MAX_INT) -> None:
    if type(value) is not int or not lo <= value <= hi:
        raise InvalidEvent(f"{name} must be an int in [{lo}, {hi}], got {value!r}", event)


def _ints(event: Any, name: str, values: list[Any], lo: int, hi: int) -> None:
    """``_int`` of each of ``values``, inline (a call per value costs as much as its check)."""
    for value in values:
        if type(value) is not int or not lo <= value <= hi:
            _int(event, name, value, lo, hi)


def _keys(event: Any, name: str, keys: object) -> None:
    if type(keys) is not list:
        raise InvalidEvent(f"{name} must be a list of key bytes", event)
    for key in keys:
        if type(key) is not bytes or not 0 < len(key) <= MAX_KEY_BYTES:
            raise InvalidEvent(f"{name} holds {key!r}, not 1-{MAX_KEY_BYTES} key bytes", event)


def _context(event: Any) -> None:
    req_id = event.req_id
    if type(req_id) is not str or not 0 < len(req_id) <= 4096:
        raise InvalidEvent("req_id must be a non-empty str of at most 4096", event)
    if not req_id.isascii():  # ASCII always encodes
        try:
            req_id.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidEvent(f"req_id is not valid UTF-8 text: {exc.reason}", event) from exc
    _int(event, "context", event.context, 0)


def _positioned(event: Any) -> None:
    _context(event)
    _keys(event, "position_keys", event.position_keys)
    positions = event.positions
    if type(positions) is not list or len(positions) != len(event.position_keys):
        raise InvalidEvent("positions must be a list of ints, one per position key", event)
    _ints(event, "position", positions, 0, _MAX_INT)


def _chunk_ids(event: Any, chunk_ids: object, count: int) -> None:
    if type(chunk_ids) is not list or len(chunk_ids) != count:
        raise InvalidEvent(f"chunk_ids must be a list of {count} chunk ids", event)
    _ints(event, "chunk id", chunk_ids, 0, MAX_TIER_CHUNKS - 1)


def _configured(e: TierConfigured) -> None:
    _int(e, "num_chunks", e.num_chunks, 0, MAX_TIER_CHUNKS)
    if e.eviction not in TIER_EVICTIONS:
        raise InvalidEvent(f"eviction must be one of {list(TIER_EVICTIONS)}", e)
    _int(e, "store_threshold", e.store_threshold, 0, 1 << 20)
    _int(e, "max_tracker_size", e.max_tracker_size, 1, 1 << 32)
    _int(e, "blocks_per_chunk", e.blocks_per_chunk, 1, 1 << 16)
    _int(e, "tokens_per_chunk", e.tokens_per_chunk, 0, 1 << 32)
    _int(e, "chunk_bytes", e.chunk_bytes, 0, 1 << 40)
    if e.rule not in TIER_RULES:
        raise InvalidEvent(f"rule must be one of {list(TIER_RULES)}", e)


def _looked_up(e: TierLookedUp) -> None:
    _positioned(e)
    key = e.key
    if type(key) is not bytes or not 0 < len(key) <= MAX_KEY_BYTES:  # most of a step's calls
        _keys(e, "key", [key])  # names it
    if e.result not in TIER_LOOKUP_RESULTS:
        raise InvalidEvent(f"result must be one of {list(TIER_LOOKUP_RESULTS)}", e)


def _keyed(e: Any) -> None:
    _positioned(e)
    _keys(e, "keys", e.keys)


def _load_prepared(e: TierLoadPrepared) -> None:
    _keyed(e)
    _chunk_ids(e, e.chunk_ids, len(e.keys))


def _load_completed(e: TierLoadCompleted) -> None:
    _context(e)
    _keys(e, "keys", e.keys)


def _store_prepared(e: TierStorePrepared) -> None:
    _keyed(e)
    if type(e.accepted) is not bool:
        raise InvalidEvent("accepted must be a bool", e)
    _keys(e, "keys_to_store", e.keys_to_store)
    _keys(e, "evicted_keys", e.evicted_keys)
    _chunk_ids(e, e.chunk_ids, len(e.keys_to_store))
    if not e.accepted and (e.keys_to_store or e.evicted_keys):
        raise InvalidEvent("a refused store stores and evicts nothing", e)


def _store_completed(e: TierStoreCompleted) -> None:
    _context(e)
    _keys(e, "keys", e.keys)
    if type(e.success) is not bool:
        raise InvalidEvent("success must be a bool", e)


def _reset(e: TierReset) -> None:
    _int(e, "generation", e.generation, 0)


TIER_VALIDATORS: dict[type, Callable[[Any], None]] = {
    TierConfigured: _configured,
    TierRequestStarted: _positioned,
    TierLookedUp: _looked_up,
    TierTouched: _keyed,
    TierLoadPrepared: _load_prepared,
    TierLoadCompleted: _load_completed,
    TierStorePrepared: _store_prepared,
    TierStoreCompleted: _store_completed,
    TierRequestFinished: _positioned,
    TierReset: _reset,
}
"""Each tier event type's stateless checks."""


def _batch(e: TierBatch) -> None:
    """Every event of the batch checked on its own; none a batch; at most MAX_TIER_BATCH."""
    events = e.events
    if type(events) is not list or not 0 < len(events) <= MAX_TIER_BATCH:
        raise InvalidEvent(f"events must be a list of 1 to {MAX_TIER_BATCH} tier events", e)
    for event in events:
        check = TIER_VALIDATORS.get(type(event))
        if check is None:
            raise InvalidEvent(f"a TierBatch holds tier events, not {type(event).__name__}", e)
        check(event)


TIER_VALIDATORS[TierBatch] = _batch

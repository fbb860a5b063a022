"""Why each CPU tier lookup missed: a pure fold over the tier's calls and their answers.

The scheduler side of ``KvlogOffloadingConnector`` records every call it makes of vLLM's CPU
offloading manager with the manager's answer (``kvlog.tier.record``); the what-ifs of
``kvlog sweep --cpu-bytes`` produce the same calls with the tier reducer's answers. One
:class:`TierExplainer` folds either stream, so the live counters an operator scrapes and the
offline figures of a replay or a sweep are the same code on the same events.

Every lookup is a hit or a miss with one reason (``MISS_REASONS``), so ``lookups == hits +
sum(misses)`` always holds:

- ``in_flight``: the tier holds the chunk but its store has not finished (vLLM's
  ``HIT_PENDING``: present, not readable yet; the request waits);
- ``first``: the key was never asked, offered or stored before (within the last
  ``history`` keys the explainer remembers): the first miss of a prefix chain, which no
  tier could have served;
- ``never_stored``: asked or offered before, never stored (no offer reached the tier);
- ``threshold``: offered, and refused by the store threshold (offered too few times);
- ``no_room``: offered, and the whole store refused for lack of evictable chunks;
- ``evicted``: stored, then evicted for room;
- ``failed``: stored, and the store failed;
- ``reset``: stored, and dropped by a cache reset.

Stores never read: a stored chunk that leaves the tier (eviction, failure, reset) before any
load read it counts once in ``never_read``; ``unread`` is how many resident chunks no load
has read yet. Memory is bounded: the resident keys (at most the tier's chunks) and the
``history`` most recently seen keys. Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from kvlog.events import (
    TierBatch,
    TierConfigured,
    TierEvent,
    TierLoadPrepared,
    TierLookedUp,
    TierReset,
    TierStoreCompleted,
    TierStorePrepared,
)

__all__ = [
    "MAX_HISTORY",
    "MIN_HISTORY",
    "MISS_REASONS",
    "TierExplainer",
    "TierFigures",
    "history_size",
]

MISS_REASONS: tuple[str, ...] = (
    "in_flight",
    "first",
    "never_stored",
    "threshold",
    "no_room",
    "evicted",
    "failed",
    "reset",
)
MIN_HISTORY = 1 << 16
MAX_HISTORY = 1 << 19
"""Bounds of the keys remembered for ``first`` versus the other reasons (4 times the
tier's chunks, within these bounds)."""

_SEEN, _STORED = "never_stored", "stored"


def history_size(num_chunks: int) -> int:
    """How many keys an explainer of a tier of ``num_chunks`` remembers."""
    return min(MAX_HISTORY, max(MIN_HISTORY, 4 * num_chunks))


@dataclass
class TierFigures:
    """Counts since the tier's first call (chunks are the tier's blocks)."""

    lookups: int = 0
    hits: int = 0
    misses: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MISS_REASONS, 0))
    chunks_stored: int = 0
    chunks_loaded: int = 0
    chunks_evicted: int = 0
    stores_refused: int = 0
    never_read: int = 0
    unread: int = 0
    resident: int = 0
    num_chunks: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    def as_dict(self) -> dict[str, object]:
        """Plain values (a row, a JSON line)."""
        return {
            "lookups": self.lookups,
            "hits": self.hits,
            "hit_rate": round(self.hit_rate, 6),
            "misses": dict(self.misses),
            "chunks_stored": self.chunks_stored,
            "chunks_loaded": self.chunks_loaded,
            "chunks_evicted": self.chunks_evicted,
            "stores_refused": self.stores_refused,
            "never_read": self.never_read,
            "unread": self.unread,
            "resident": self.resident,
            "num_chunks": self.num_chunks,
        }


class TierExplainer:
    """Folds tier events (answers filled in, as a log holds them) into :class:`TierFigures`."""

    __slots__ = ("_history", "_limit", "_resident", "_unread", "figures")

    def __init__(self) -> None:
        self.figures = TierFigures()
        self._resident: set[bytes] = set()
        self._unread: set[bytes] = set()
        self._history: OrderedDict[bytes, str] = OrderedDict()
        self._limit = MIN_HISTORY

    def feed(self, event: object) -> None:
        """Fold one event (a ``TierBatch`` event by event; other events are ignored)."""
        kind = type(event)
        if kind is TierBatch:
            looked_up = self._looked_up
            for inner in event.events:  # type: ignore[attr-defined]
                if type(inner) is TierLookedUp:  # most of a step's calls
                    looked_up(inner)
                else:
                    self._other(type(inner), inner)
        elif kind is TierLookedUp:
            self._looked_up(event)  # type: ignore[arg-type]
        else:
            self._other(kind, event)

    def _other(self, kind: type, event: object) -> None:
        if kind is TierStorePrepared:
            self._store_prepared(event)  # type: ignore[arg-type]
        elif kind is TierStoreCompleted:
            self._store_completed(event)  # type: ignore[arg-type]
        elif kind is TierLoadPrepared:
            self._load_prepared(event)  # type: ignore[arg-type]
        elif kind is TierReset:
            self._leave(list(self._resident), "reset")
        elif kind is TierConfigured:
            self._configured(event)  # type: ignore[arg-type]

    def feed_all(self, events: list[TierEvent]) -> TierFigures:
        for event in events:
            self.feed(event)
        return self.figures

    # -- the calls ---------------------------------------------------------------------
    def _configured(self, event: TierConfigured) -> None:
        self._limit = history_size(event.num_chunks)
        self.figures.num_chunks = event.num_chunks
        if self._resident:  # a new tier: what the old one held is gone
            self._leave(list(self._resident), "reset")

    def _remember(self, key: bytes, what: str) -> None:
        history = self._history
        if key in history:
            history.move_to_end(key)
        elif len(history) >= self._limit:
            history.popitem(last=False)
        history[key] = what

    def _looked_up(self, event: TierLookedUp) -> None:
        figures = self.figures
        figures.lookups += 1
        result = event.result
        if result == "hit":
            figures.hits += 1
            return
        key = event.key
        known = self._history.get(key)
        if result == "hit_pending":
            reason = "in_flight"
        else:
            reason = "first" if known is None else "evicted" if known == _STORED else known
        figures.misses[reason] += 1
        if known is None:
            self._remember(key, _SEEN)

    def _store_prepared(self, event: TierStorePrepared) -> None:
        figures = self.figures
        if not event.accepted:
            figures.stores_refused += 1
            for key in event.keys:
                if key not in self._resident:
                    self._remember(key, "no_room")
            return
        self._leave(event.evicted_keys, "evicted")
        figures.chunks_evicted += len(event.evicted_keys)
        stored = set(event.keys_to_store)
        for key in event.keys_to_store:
            self._resident.add(key)
            self._unread.add(key)
            self._remember(key, _STORED)
        figures.chunks_stored += len(stored)
        for key in event.keys:
            if key not in stored and key not in self._resident:
                self._remember(key, "threshold")
        self._count_resident()

    def _store_completed(self, event: TierStoreCompleted) -> None:
        if not event.success:
            self._leave([k for k in event.keys if k in self._resident], "failed")

    def _load_prepared(self, event: TierLoadPrepared) -> None:
        self.figures.chunks_loaded += len(event.keys)
        self._unread.difference_update(event.keys)
        self.figures.unread = len(self._unread)

    def _leave(self, keys: list[bytes], why: str) -> None:
        """Chunks that left the tier: a reason for their next miss, unread ones counted."""
        for key in keys:
            self._resident.discard(key)
            if key in self._unread:
                self._unread.discard(key)
                self.figures.never_read += 1
            self._remember(key, why)
        self._count_resident()

    def _count_resident(self) -> None:
        self.figures.resident = len(self._resident)
        self.figures.unread = len(self._unread)

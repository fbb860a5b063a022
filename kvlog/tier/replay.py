"""``replay_tier``: refold a log's CPU tier events and compare every answer it recorded.

The recorder wrote what vLLM's manager answered (lookup results, the chunks of a load, the
keys a store chose, their chunks and the keys evicted for them); the tier reducer
(``reducers/cpu_tier.py``) answers the same calls from the same inputs. Equal answers on
every call mean the reducer holds the tier's state exactly, so what-ifs start from truth.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator

import msgspec

from kvlog.events import (
    TIER_EVENTS,
    Event,
    Record,
    TierEvent,
    TierLoadPrepared,
    TierLookedUp,
    TierStorePrepared,
    unbatched,
)
from kvlog.log import read_log
from kvlog.reducers.cpu_tier import TierAnswer, TierState, reduce_tier
from kvlog.reducers.tier_misses import TierExplainer, TierFigures

__all__ = ["TierMismatch", "TierReplay", "explain_tier", "replay_tier", "tier_events"]


class TierMismatch(msgspec.Struct, frozen=True):
    """The first call whose recorded answer differs from the reducer's."""

    index: int
    event: str
    recorded: str
    replayed: str


class TierReplay(msgspec.Struct):
    """Calls refolded, answers compared (lookups among them), the first mismatch."""

    calls: int = 0
    compared: int = 0
    lookups: int = 0
    lookup_hits: int = 0
    stores_prepared: int = 0
    loads_prepared: int = 0
    mismatch: TierMismatch | None = None

    @property
    def exact(self) -> bool:
        """Every recorded answer equal to the reducer's (and at least one compared)."""
        return self.mismatch is None and self.compared > 0


def tier_events(source: str | os.PathLike[str] | Iterable[Event | Record]) -> Iterator[TierEvent]:
    """The tier events of a log file (or of events in memory), in log order (a
    ``TierBatch``'s events one by one)."""
    records: Iterable[object]
    if isinstance(source, (str, os.PathLike)):
        records = (record for _, record in read_log(source))
    else:
        records = source
    for record in unbatched(records):
        if type(record) in TIER_EVENTS:
            yield record


def _recorded(event: TierEvent) -> TierAnswer | None:
    """What the log says the manager answered, where the event carries an answer."""
    if type(event) is TierLookedUp:
        return TierAnswer(result=event.result)
    if type(event) is TierLoadPrepared:
        return TierAnswer(chunk_ids=event.chunk_ids)
    if type(event) is TierStorePrepared:
        return TierAnswer(
            accepted=event.accepted,
            keys_to_store=event.keys_to_store,
            chunk_ids=event.chunk_ids,
            evicted_keys=event.evicted_keys,
        )
    return None


def _comparable(answer: TierAnswer) -> TierAnswer:
    return msgspec.structs.replace(answer, changes=[])


def replay_tier(source: str | os.PathLike[str] | Iterable[Event | Record]) -> TierReplay:
    """Refold every tier event; stop at the first answer that differs (see module doc)."""
    out = TierReplay()
    state: TierState | None = None
    for index, event in enumerate(tier_events(source)):
        state, answer = reduce_tier(state, event)
        out.calls += 1
        recorded = _recorded(event)
        if recorded is None:
            continue
        out.compared += 1
        out.lookups += type(event) is TierLookedUp
        out.lookup_hits += answer.result == "hit"
        out.stores_prepared += type(event) is TierStorePrepared
        out.loads_prepared += type(event) is TierLoadPrepared
        if _comparable(answer) != recorded:
            out.mismatch = TierMismatch(
                index, type(event).__name__, repr(recorded), repr(_comparable(answer))
            )
            break
    return out


def explain_tier(source: str | os.PathLike[str] | Iterable[Event | Record]) -> TierFigures:
    """Every lookup of a tier log explained (``reducers/tier_misses.py``: the code the
    connector's live metrics use): hits, misses by reason, stores never read."""
    explainer = TierExplainer()
    for event in tier_events(source):
        explainer.feed(event)
    return explainer.figures

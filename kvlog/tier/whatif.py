"""What-ifs of the CPU tier: one variant (capacity, eviction, store threshold, chunk size)
over a list of accesses (``trace.py``), with the figures an operator sizes the tier by.

``lru`` and ``arc`` run the tier reducer (vLLM 0.33's manager, ``reducers/cpu_tier.py``)
the way the connector's scheduler side drives it for one request: ``on_new_request``, a
lookup of every key, ``prepare_load`` / ``complete_load`` of the hits, ``prepare_store``
of the keys in batches of ``keys_per_step`` (one step's chunked prefill) and their
``complete_store``, ``on_request_finished``. ``opt`` is the offline optimum under the same
admission rule (``optimum.py``). A hit is a chunk the tier holds, ready, when the request
asks (vLLM stops at its first miss; with prefix-chained keys the two rarely differ).

Per variant: hit rate (blocks and tokens served from the tier instead of recomputed), bytes
stored and loaded, evictions, stores never read before they left the tier (or the end), and
the prefill time the hits save (``prefill_s_per_token``) next to the host-link time the
loads and stores take (``kvlog/cost.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec

from kvlog.analysis.cost import CostModel
from kvlog.events import (
    TierConfigured,
    TierEvent,
    TierLoadCompleted,
    TierLoadPrepared,
    TierLookedUp,
    TierRequestFinished,
    TierRequestStarted,
    TierStoreCompleted,
    TierStorePrepared,
)
from kvlog.reducers.cpu_tier import TierAnswer, TierState, reduce_tier
from kvlog.reducers.tier_misses import MISS_REASONS, TierExplainer
from kvlog.tier.trace import TierAccess
from kvlog.tier.variants import EVICTIONS, TierTally, TierVariant

__all__ = [
    "EVICTIONS",
    "Recorder",
    "TierResult",
    "TierTally",
    "TierVariant",
    "replay_policy",
    "run_variant",
    "tier_config",
]

DEFAULT_PREFILL_S_PER_TOKEN = 1e-4
"""Prefill time one token costs (100 us: an 8B model near 10k tokens/s); settable."""


@dataclass(frozen=True)
class TierResult:
    """A variant's figures (see module docstring)."""

    variant: TierVariant
    tally: TierTally
    prefill_s_per_token: float
    cost: CostModel
    misses: dict[str, int] | None = None
    """Misses by reason (``reducers/tier_misses.py``, the code the live metrics use);
    None for ``opt``, which makes no manager calls."""

    @property
    def hit_rate(self) -> float:
        return self.tally.blocks_hit / max(1, self.tally.blocks_asked)

    @property
    def tokens_hit(self) -> int:
        return self.tally.blocks_hit * self.variant.tokens_per_chunk

    @property
    def bytes_loaded(self) -> int:
        return self.tally.blocks_hit * self.variant.chunk_bytes

    @property
    def bytes_stored(self) -> int:
        return self.tally.blocks_stored * self.variant.chunk_bytes

    @property
    def prefill_saved_s(self) -> float:
        return self.tokens_hit * self.prefill_s_per_token

    @property
    def load_s(self) -> float:
        return self.cost.transfer_s(0, self.bytes_loaded)

    @property
    def store_s(self) -> float:
        return self.cost.transfer_s(self.bytes_stored, 0)

    def row(self) -> dict[str, object]:
        """One CSV row."""
        v, t = self.variant, self.tally
        return {
            "eviction": v.eviction,
            "cpu_bytes": v.num_chunks * v.chunk_bytes,
            "num_chunks": v.num_chunks,
            "store_threshold": v.store_threshold,
            "tokens_per_chunk": v.tokens_per_chunk,
            "hit_rate": round(self.hit_rate, 6),
            "blocks_asked": t.blocks_asked,
            "blocks_hit": t.blocks_hit,
            "tokens_hit": self.tokens_hit,
            "bytes_stored": self.bytes_stored,
            "bytes_loaded": self.bytes_loaded,
            "evictions": t.evictions,
            "never_read": t.never_read,
            "refused_stores": t.refused_stores,
            **{f"miss_{r}": ("" if self.misses is None else self.misses[r]) for r in MISS_REASONS},
            "prefill_saved_s": round(self.prefill_saved_s, 6),
            "load_s": round(self.load_s, 6),
            "store_s": round(self.store_s, 6),
        }


def run_variant(
    accesses: Sequence[TierAccess],
    variant: TierVariant,
    prefill_s_per_token: float = DEFAULT_PREFILL_S_PER_TOKEN,
    cost: CostModel | None = None,
    record: Recorder | None = None,
) -> TierResult:
    """Run one variant over the accesses (``opt`` through ``optimum.belady``); ``record``
    takes each manager call as a log would hold it (``lru``/``arc``). The misses are
    explained by a ``TierExplainer`` fed the same calls (the live metrics' code)."""
    if variant.eviction == "opt":
        from kvlog.tier.optimum import belady

        tally = belady(accesses, variant)
        return TierResult(variant, tally, prefill_s_per_token, cost or CostModel())
    explainer = TierExplainer()

    def explain(event: TierEvent) -> None:
        explainer.feed(event)
        if record is not None:
            record(event)

    tally = replay_policy(accesses, variant, explain)
    misses = dict(explainer.figures.misses)
    return TierResult(variant, tally, prefill_s_per_token, cost or CostModel(), misses)


Recorder = Callable[[TierEvent], object]
"""Takes each call of a run as a log would hold it (the answer filled in)."""


def tier_config(variant: TierVariant) -> TierConfigured:
    """The ``TierConfigured`` of a variant (``lru`` or ``arc``)."""
    return TierConfigured(
        num_chunks=variant.num_chunks,
        eviction=variant.eviction,
        store_threshold=variant.store_threshold,
        max_tracker_size=variant.max_tracker_size,
        tokens_per_chunk=variant.tokens_per_chunk,
        chunk_bytes=variant.chunk_bytes,
    )


def replay_policy(
    accesses: Sequence[TierAccess], variant: TierVariant, record: Recorder | None = None
) -> TierTally:
    """Drive the tier reducer (``lru`` or ``arc``) over the accesses as the connector's
    scheduler side would, handing each call to ``record`` with its answer."""
    config = tier_config(variant)
    state, _ = reduce_tier(None, config)
    if record is not None:
        record(config)
    tally, unread = TierTally(), set[bytes]()
    for number, access in enumerate(accesses):
        _one_access(state, number, access, variant, tally, unread, record)
    tally.never_read += len(unread)
    return tally


def _call(state: TierState, event: TierEvent, record: Recorder | None) -> TierAnswer:
    """One manager call; recorded with the answer as the recorder would write it."""
    answer = reduce_tier(state, event)[1]
    if record is not None:
        if type(event) is TierLookedUp:
            event = msgspec.structs.replace(event, result=answer.result)
        elif type(event) is TierLoadPrepared:
            event = msgspec.structs.replace(event, chunk_ids=answer.chunk_ids)
        elif type(event) is TierStorePrepared:
            event = msgspec.structs.replace(
                event,
                accepted=answer.accepted,
                keys_to_store=answer.keys_to_store,
                chunk_ids=answer.chunk_ids,
                evicted_keys=answer.evicted_keys,
            )
        record(event)
    return answer


def _one_access(
    state: TierState,
    number: int,
    access: TierAccess,
    variant: TierVariant,
    tally: TierTally,
    unread: set[bytes],
    record: Recorder | None,
) -> None:
    """One request's calls, as the connector's scheduler side makes them."""
    keys, req_id, step = list(access.keys), access.req_id, variant.keys_per_step
    positions = [(i + 1) * variant.tokens_per_chunk for i in range(len(keys))]
    _call(state, TierRequestStarted(req_id, number, keys, positions), record)
    hits = [
        key
        for key in keys
        if _call(state, TierLookedUp(req_id, number, key, "miss"), record).result == "hit"
    ]
    tally.accesses += 1
    tally.blocks_asked += len(keys)
    tally.blocks_hit += len(hits)
    unread.difference_update(hits)
    if hits:
        _call(state, TierLoadPrepared(req_id, number, hits, []), record)
        _call(state, TierLoadCompleted(req_id, number, hits), record)
    for start in range(0, len(keys), step):
        batch = keys[start : start + step]
        offer = TierStorePrepared(req_id, number, batch, True, [], [], [])
        answer = _call(state, offer, record)
        if not answer.accepted:
            tally.refused_stores += 1
            continue
        tally.blocks_stored += len(answer.keys_to_store)
        tally.evictions += len(answer.evicted_keys)
        tally.never_read += sum(key in unread for key in answer.evicted_keys)
        unread.difference_update(answer.evicted_keys)
        unread.update(answer.keys_to_store)
        if answer.keys_to_store:
            _call(state, TierStoreCompleted(req_id, number, answer.keys_to_store), record)
    _call(state, TierRequestFinished(req_id, number), record)

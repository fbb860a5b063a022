"""The CPU tier as a reducer: vLLM's ``CPUOffloadingManager``, call for call.

:class:`TierState` holds what the manager holds (the policy, the chunk pool, the
store-threshold tracker, the cache generation, one :class:`TierContext` per ``ReqContext``);
:func:`reduce` applies one tier event (``events.TIER_EVENTS``) to it and returns the
manager's answer as a :class:`TierAnswer` (the lookup result, the keys stored, their
chunks, the evicted keys, and the ``OffloadingEvent``s the manager queued). Checks come
first: a call vLLM's manager would assert on (loading a key it does not hold, completing a
load never prepared) raises ``InvalidEvent`` and changes nothing.

The manager is the one of the vLLM release that recorded the log (``TierConfigured.rule``,
``events.TIER_RULES``): ``vllm-0.33`` (logs from before the field too); ``vllm-0.34``, where a
key counts toward the store threshold once per request and there is no ``touch``;
``vllm-0.26``, a tier of blocks whose threshold counts lookups, whose policies
(:mod:`kvlog.reducers.tier_policies_v026`) know nothing of requests, and whose failed stores
queue no event.

``reduce`` reproduces the answers; comparing them with the answers a log recorded is
:func:`kvlog.tier.replay.replay_tier`'s job. Pure: no torch, no I/O, no clock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvlog.errors import InvalidEvent, NotConfigured
from kvlog.events import (
    TierConfigured,
    TierEvent,
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
from kvlog.reducers.tier_policies import ArcPolicy, Chunk, LruPolicy, TierContext, TierPolicy
from kvlog.reducers.tier_policies_v026 import Arc026Policy, Lru026Policy

__all__ = [
    "TierAnswer",
    "TierChange",
    "TierState",
    "count_lookup",
    "count_offer",
    "initial_tier_state",
    "reduce_tier",
]


class TierChange(msgspec.Struct, frozen=True):
    """One ``OffloadingEvent`` of the manager: keys stored (``removed`` False) or dropped
    (``metadata_only``: a failed store's keys, never announced as stored)."""

    keys: list[bytes]
    removed: bool
    metadata_only: bool = False


class TierAnswer(msgspec.Struct, frozen=True):
    """The manager's return value for one call (what applies to the call's kind)."""

    result: str = ""
    accepted: bool = True
    keys_to_store: list[bytes] = []
    chunk_ids: list[int] = []
    evicted_keys: list[bytes] = []
    changes: list[TierChange] = []


_NO_ANSWER = TierAnswer()


@dataclass(slots=True)
class TierState:
    """Everything the manager keeps (see module docstring)."""

    config: TierConfigured
    policy: TierPolicy
    num_allocated: int = 0
    free_list: list[int] = field(default_factory=list)
    num_evictable: int = 0
    num_write_pending: int = 0
    counts: OrderedDict[bytes, int] | None = None
    generation: int = 0
    contexts: dict[int, TierContext] = field(default_factory=dict)

    @property
    def rule(self) -> str:
        """The vLLM release whose manager this tier follows."""
        return self.config.rule

    @property
    def num_free(self) -> int:
        """Chunks free now (never used, or released)."""
        return len(self.free_list) + self.config.num_chunks - self.num_allocated


_POLICIES: dict[str, dict[str, type[TierPolicy]]] = {
    "vllm-0.33": {"lru": LruPolicy, "arc": ArcPolicy},
    "vllm-0.34": {"lru": LruPolicy, "arc": ArcPolicy},
    "vllm-0.26": {"lru": Lru026Policy, "arc": Arc026Policy},
}


def initial_tier_state(config: TierConfigured) -> TierState:
    """An empty tier as ``CPUOffloadingManager(num_chunks, eviction, ...)`` starts."""
    policies = _POLICIES.get(config.rule)
    if policies is None:
        raise InvalidEvent(f"unknown manager rule {config.rule!r}", config)
    policy_type = policies.get(config.eviction)
    if policy_type is None:
        raise InvalidEvent(f"unknown eviction policy {config.eviction!r}", config)
    counts: OrderedDict[bytes, int] | None = OrderedDict() if config.store_threshold >= 2 else None
    return TierState(config=config, policy=policy_type(config.num_chunks), counts=counts)


# -- contexts ------------------------------------------------------------------------------
def _context(state: TierState, event: Any) -> TierContext:
    """The event's context, with the positions it carries applied; a fresh access record
    where the context is new to this cache generation (vLLM: ``_get_request_cache_access``)."""
    number: int = event.context
    context = state.contexts.get(number)
    if context is None:
        context = state.contexts[number] = TierContext(req_id=event.req_id)
    for key, position in zip(
        getattr(event, "position_keys", ()), getattr(event, "positions", ()), strict=True
    ):
        context.positions[key] = position
    if context.generation != state.generation:
        context.generation = state.generation
        for part in (context.key_groups, context.seen_keys, context.inserted_keys):
            part.clear()
        context.reused_keys.clear()
        context.store_miss_keys.clear()
        context.counted_keys.clear()
        context.finished = False
    return context


def _record_access(
    state: TierState,
    context: TierContext,
    keys: Sequence[bytes],
    reused: Sequence[bytes] = (),
) -> None:
    new_keys = []
    for key in keys:
        if key in context.seen_keys:
            continue
        assert not context.finished, "new keys observed after the request finished"
        group = int.from_bytes(key[-4:], "big")
        context.key_groups.setdefault(group, []).append(key)
        context.seen_keys.add(key)
        new_keys.append(key)
    if new_keys:
        state.policy.on_request_access(new_keys, context)
    context.reused_keys.update(key for key in reused if key not in context.inserted_keys)


def count_offer(
    counts: OrderedDict[bytes, int],
    keys: Sequence[bytes],
    limit: int,
    counted: AbstractSet[bytes] = frozenset(),
) -> None:
    """vLLM's admission tracker: count each offered key (most recent last), ageing the
    least recently offered keys out past ``limit`` but never one of this offer's own.
    Keys in ``counted`` (vLLM 0.34: counted by this request before) stay tracked but do
    not count again."""
    protected = set()
    for key in keys:
        if key in counts:
            counts.move_to_end(key)
            if key not in counted:
                counts[key] += 1
            protected.add(key)
    unprotected = len(counts) - len(protected)
    for key in keys:
        if key in counts:
            continue
        if len(counts) >= limit:
            if unprotected == 0:
                continue
            counts.popitem(last=False)
            unprotected -= 1
        counts[key] = 1


def count_lookup(counts: OrderedDict[bytes, int], key: bytes, limit: int) -> None:
    """vLLM 0.26's admission tracker: each lookup counts its key (most recent last); a new
    key past ``limit`` ages the least recently looked-up key out."""
    if key in counts:
        counts.move_to_end(key)
        counts[key] += 1
        return
    if len(counts) >= limit:
        counts.popitem(last=False)
    counts[key] = 1


# -- the calls -----------------------------------------------------------------------------
def _started(state: TierState, event: TierRequestStarted) -> TierAnswer:
    _context(state, event)
    return _NO_ANSWER


def _looked_up(state: TierState, event: TierLookedUp) -> TierAnswer:
    _context(state, event)
    if state.counts is not None and state.rule == "vllm-0.26":
        count_lookup(state.counts, event.key, state.config.max_tracker_size)
    chunk = state.policy.get(event.key)
    result = "miss" if chunk is None else "hit" if chunk.is_ready else "hit_pending"
    return TierAnswer(result=result)


def _touched(state: TierState, event: TierTouched) -> TierAnswer:
    if state.rule == "vllm-0.34":
        raise InvalidEvent("vLLM 0.34's manager has no touch", event)
    state.policy.touch(event.keys, _context(state, event))
    return _NO_ANSWER


def _check_load(state: TierState, event: TierLoadPrepared) -> list[Chunk]:
    chunks = []
    for key in event.keys:
        chunk = state.policy.get(key)
        if chunk is None or not chunk.is_ready:
            raise InvalidEvent(f"prepare_load of key {key.hex()} the tier does not hold", event)
        chunks.append(chunk)
    return chunks


def _load_prepared(state: TierState, event: TierLoadPrepared) -> TierAnswer:
    chunks = _check_load(state, event)
    context = _context(state, event)
    for key, chunk in zip(event.keys, chunks, strict=True):
        if chunk.ref_cnt == 0:
            state.policy.mark_non_evictable(key)
            state.num_evictable -= 1
        chunk.ref_cnt += 1
    if state.rule != "vllm-0.26":
        _record_access(state, context, event.keys, reused=event.keys)
    return TierAnswer(chunk_ids=[chunk.chunk_id for chunk in chunks])


def _load_completed(state: TierState, event: TierLoadCompleted) -> TierAnswer:
    chunks = [state.policy.get(key) for key in event.keys]
    if any(chunk is None or chunk.ref_cnt <= 0 for chunk in chunks):
        raise InvalidEvent("complete_load of a key with no load prepared", event)
    for key, chunk in zip(event.keys, chunks, strict=True):
        assert chunk is not None
        chunk.ref_cnt -= 1
        if chunk.ref_cnt == 0:
            state.num_evictable += 1
            state.policy.mark_evictable(key)
    return _NO_ANSWER


def _store_completed(state: TierState, event: TierStoreCompleted) -> TierAnswer:
    done: list[bytes] = []
    for key in event.keys:
        chunk = state.policy.get(key)
        if chunk is None or chunk.is_ready:
            continue
        state.num_write_pending -= 1
        if event.success:
            chunk.ref_cnt = 0
            state.num_evictable += 1
            state.policy.mark_evictable(key)
        else:
            state.policy.remove(key)
            state.free_list.append(chunk.chunk_id)
        done.append(key)
    if not done or (not event.success and state.rule == "vllm-0.26"):
        return _NO_ANSWER  # 0.26 queues no event for a failed store
    change = TierChange(done, removed=not event.success, metadata_only=not event.success)
    return TierAnswer(changes=[change])


def _finished(state: TierState, event: TierRequestFinished) -> TierAnswer:
    context = state.contexts.pop(event.context, None)
    if state.rule == "vllm-0.26":
        return _NO_ANSWER  # 0.26's policies know nothing of requests
    if context is None or context.generation != state.generation or context.finished:
        return _NO_ANSWER  # vLLM: no access record of this generation, nothing to apply
    for key, position in zip(event.position_keys, event.positions, strict=True):
        context.positions[key] = position
    context.finished = True
    key_groups = []
    for group in sorted(context.key_groups):
        keys = context.key_groups[group]
        if all(key in context.positions for key in keys):
            keys = sorted(keys, key=context.positions.__getitem__)
        key_groups.append(tuple(keys))
    state.policy.on_request_finished(
        key_groups, context.inserted_keys - context.reused_keys, context.reused_keys, context
    )
    return _NO_ANSWER


def _reset(state: TierState, event: TierReset) -> TierAnswer:
    state.policy.clear()
    state.generation += 1
    state.num_evictable = state.num_write_pending = state.num_allocated = 0
    state.free_list.clear()
    return _NO_ANSWER


def _partition(
    state: TierState, keys: list[bytes], context: TierContext
) -> tuple[list[bytes], list[bytes]]:
    """The offer's new keys (admitted by the store threshold) and its ready resident keys."""
    per_request = state.rule == "vllm-0.34"
    if state.counts is not None:
        counted = context.counted_keys if per_request else frozenset()
        count_offer(state.counts, keys, state.config.max_tracker_size, counted)
    to_store, ready = [], []
    for key in keys:
        chunk = state.policy.get(key)
        if chunk is None:
            to_store.append(key)
        elif chunk.is_ready:
            ready.append(key)
    counts = state.counts
    if counts is not None:
        threshold = state.config.store_threshold
        to_store = [key for key in to_store if counts.get(key, 0) >= threshold]
        if per_request:
            context.counted_keys.update(keys)
    return to_store, ready


def _allocate(state: TierState, count: int) -> list[Chunk]:
    """Fresh chunk ids first, then the most recently released ones."""
    num_fresh = min(count, state.config.num_chunks - state.num_allocated)
    assert len(state.free_list) >= count - num_fresh, "the pool has the chunks it counted"
    chunks = [Chunk(state.num_allocated + i) for i in range(num_fresh)]
    state.num_allocated += num_fresh
    chunks += [Chunk(state.free_list.pop()) for _ in range(count - num_fresh)]
    return chunks


def _store_prepared(state: TierState, event: TierStorePrepared) -> TierAnswer:
    keys = list(event.keys)
    context = _context(state, event)
    if state.rule == "vllm-0.26":
        return _store_prepared_026(state, keys, context)
    to_store, ready = _partition(state, keys, context)
    misses = [key for key in to_store if key not in context.store_miss_keys]
    if misses:
        state.policy.on_store_miss(misses, context)
        context.store_miss_keys.update(misses)
    recorded = set(to_store).union(ready)
    _record_access(state, context, [key for key in keys if key in recorded], reused=ready)
    return _store(state, to_store, set(keys), context)


def _store_prepared_026(state: TierState, keys: list[bytes], context: TierContext) -> TierAnswer:
    """vLLM 0.26's ``prepare_store``: the threshold (counted at lookup) filters the offer,
    then the keys not resident are stored; only the admitted keys are kept from eviction."""
    counts = state.counts
    if counts is not None:
        threshold = state.config.store_threshold
        keys = [key for key in keys if counts.get(key, 0) >= threshold]
    to_store = [key for key in keys if state.policy.get(key) is None]
    return _store(state, to_store, set(keys), context)


def _store(
    state: TierState, to_store: list[bytes], protected: set[bytes], context: TierContext
) -> TierAnswer:
    """Evict what ``to_store`` needs (never a ``protected`` key), then allocate and insert:
    the manager's answer, or a refusal (nothing changed) when too few keys are idle."""
    if not to_store:
        return TierAnswer()
    num_to_evict = len(to_store) - state.num_free
    evicted: list[bytes] = []
    changes: list[TierChange] = []
    if num_to_evict > 0:
        if num_to_evict > state.num_evictable:
            return TierAnswer(accepted=False)
        chosen = state.policy.evict(num_to_evict, protected)
        if chosen is None:
            return TierAnswer(accepted=False)
        state.num_evictable -= len(chosen)
        assert state.num_evictable >= 0, "evicted more idle chunks than counted"
        for key, chunk in chosen:
            state.free_list.append(chunk.chunk_id)
            evicted.append(key)
        changes.append(TierChange(evicted, removed=True))
    chunks = _allocate(state, len(to_store))
    for key, chunk in zip(to_store, chunks, strict=True):
        state.policy.insert(key, chunk, context)
    state.num_write_pending += len(to_store)
    context.inserted_keys.update(to_store)
    return TierAnswer(
        keys_to_store=to_store,
        chunk_ids=[chunk.chunk_id for chunk in chunks],
        evicted_keys=evicted,
        changes=changes,
    )


_CALLS = {
    TierRequestStarted: _started,
    TierLookedUp: _looked_up,
    TierTouched: _touched,
    TierLoadPrepared: _load_prepared,
    TierLoadCompleted: _load_completed,
    TierStorePrepared: _store_prepared,
    TierStoreCompleted: _store_completed,
    TierRequestFinished: _finished,
    TierReset: _reset,
}


def reduce_tier(state: TierState | None, event: TierEvent) -> tuple[TierState, TierAnswer]:
    """Apply one tier event: the state (changed in place; a new one for ``TierConfigured``)
    and the manager's answer. Raises ``NotConfigured`` before the first ``TierConfigured``
    and ``InvalidEvent`` for a call the manager could not take (nothing changed)."""
    if type(event) is TierConfigured:
        return initial_tier_state(event), _NO_ANSWER
    if state is None:
        raise NotConfigured("a CPU tier's first event must be TierConfigured", event)
    call = _CALLS.get(type(event))
    if call is None:
        raise InvalidEvent(f"not a CPU tier event: {type(event).__name__}", None)
    return state, call(state, event)  # type: ignore[operator]

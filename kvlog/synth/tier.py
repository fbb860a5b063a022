"""The CPU tier of a trace run: vLLM's ``CPUOffloadingManager`` as the serving loop asks it.

:class:`TierManager` answers the calls the connector's scheduler side makes of vLLM 0.33's
manager (``lookup``, ``prepare_load``/``complete_load``, ``prepare_store``/``complete_store``,
``on_new_request``/``on_request_finished``, ``touch``, ``reset_cache``) with the tier
reducer (``reducers/cpu_tier.py``, which reproduces the manager call for call), through the
same attributes vLLM gives its manager and its ``ReqContext`` (:class:`TierRequest`). So a
synthetic run wraps it in the recorder the connector uses (``kvlog.tier.record``) and its
log holds the tier's calls as a real run's scheduler log does.

Keys are 8 bytes of a stable hash of a CPU block's content key and 4 bytes of KV-cache
group (0), as vLLM's ``make_offload_key`` builds them.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Collection, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvlog.events import (
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
from kvlog.reducers.cpu_tier import TierAnswer, reduce_tier

__all__ = [
    "LookupAnswer",
    "LoadSpec",
    "StoreAnswer",
    "TierManager",
    "TierRequest",
    "TraceTier",
    "tier_key",
]


def tier_key(content: Hashable) -> bytes:
    """The offload key of a CPU block whose content key is ``content`` (a tuple of the
    GPU blocks' keys): 8 bytes of BLAKE2b over its ``repr`` (stable across processes,
    unlike ``hash``) and group 0."""
    digest = hashlib.blake2b(repr(content).encode(), digest_size=8).digest()
    return digest + bytes(4)


@dataclass(eq=False)
class TierRequest:
    """The ``ReqContext`` of one request: its id, the key positions known so far (token
    position of each key's end), and the state others keep in it by type."""

    req_id: str
    _offload_key_positions: dict[bytes, int] = field(default_factory=dict)
    _states: dict[type, Any] = field(default_factory=dict)

    def get_state(self, kind: type) -> Any:
        return self._states.get(kind)

    def set_state(self, state: object) -> None:
        self._states[type(state)] = state


@dataclass(frozen=True)
class LookupAnswer:
    """``LookupResult``: its ``name`` in capitals, as vLLM's enum has it."""

    name: str


@dataclass(frozen=True)
class LoadSpec:
    """A ``LoadStoreSpec``: the chunks (CPU blocks) of the keys."""

    block_ids: list[int]


@dataclass(frozen=True)
class StoreAnswer:
    """``PrepareStoreOutput``: the keys to store, their chunks, the keys evicted."""

    keys_to_store: list[bytes]
    store_spec: LoadSpec
    evicted_keys: list[bytes]


@dataclass
class _Mark:
    """Kept in a :class:`TierRequest` by the manager: its number, positions passed on."""

    number: int
    passed: int = 0


class TierManager:
    """A ``CPUOffloadingManager`` answered by the tier reducer (see module docstring)."""

    def __init__(self, config: TierConfigured) -> None:
        self.config = config
        self.state, _ = reduce_tier(None, config)
        self._numbers = itertools.count()
        self._num_chunks = config.num_chunks
        self.store_threshold = config.store_threshold
        self.max_tracker_size = config.max_tracker_size

    @property
    def _policy(self) -> object:
        return self.state.policy

    def flush(self) -> None:
        """Nothing kept (a recorder around it flushes its batch here)."""

    def _mark(self, ctx: TierRequest) -> _Mark:
        mark = ctx.get_state(_Mark)
        if mark is None:
            mark = _Mark(next(self._numbers))
            ctx.set_state(mark)
        assert isinstance(mark, _Mark), "the state kept by type is the manager's own"
        return mark

    def _context(self, ctx: TierRequest) -> tuple[str, int, list[bytes], list[int]]:
        """The request's id and number, and the key positions set since the last call that
        passed positions on (as the recorder passes them: the two stay in step)."""
        mark = self._mark(ctx)
        new = list(itertools.islice(ctx._offload_key_positions.items(), mark.passed, None))
        mark.passed = len(ctx._offload_key_positions)
        return ctx.req_id, mark.number, [k for k, _ in new], [p for _, p in new]

    def _number(self, ctx: TierRequest) -> tuple[str, int]:
        """Id and number, positions left for the next call that passes them."""
        return ctx.req_id, self._mark(ctx).number

    def _call(self, event: Any) -> TierAnswer:
        return reduce_tier(self.state, event)[1]

    def on_new_request(self, ctx: TierRequest) -> None:
        self._call(TierRequestStarted(*self._context(ctx)))

    def lookup(self, key: bytes, ctx: TierRequest) -> LookupAnswer:
        req_id, number, keys, positions = self._context(ctx)
        answer = self._call(TierLookedUp(req_id, number, key, "miss", keys, positions))
        return LookupAnswer(answer.result.upper())

    def touch(self, keys: Collection[bytes], ctx: TierRequest) -> None:
        req_id, number, pkeys, positions = self._context(ctx)
        self._call(TierTouched(req_id, number, list(keys), pkeys, positions))

    def prepare_load(self, keys: Collection[bytes], ctx: TierRequest) -> LoadSpec:
        req_id, number, pkeys, positions = self._context(ctx)
        event = TierLoadPrepared(req_id, number, list(keys), [], pkeys, positions)
        return LoadSpec(list(self._call(event).chunk_ids))

    def complete_load(self, keys: Collection[bytes], ctx: TierRequest) -> None:
        req_id, number = self._number(ctx)
        self._call(TierLoadCompleted(req_id, number, list(keys)))

    def prepare_store(self, keys: Collection[bytes], ctx: TierRequest) -> StoreAnswer | None:
        req_id, number, pkeys, positions = self._context(ctx)
        offer = TierStorePrepared(req_id, number, list(keys), True, [], [], [], pkeys, positions)
        answer = self._call(offer)
        if not answer.accepted:
            return None
        return StoreAnswer(
            list(answer.keys_to_store), LoadSpec(list(answer.chunk_ids)), list(answer.evicted_keys)
        )

    def complete_store(
        self, keys: Collection[bytes], ctx: TierRequest, success: bool = True
    ) -> None:
        req_id, number = self._number(ctx)
        self._call(TierStoreCompleted(req_id, number, list(keys), success))

    def on_request_finished(self, ctx: TierRequest) -> None:
        self._call(TierRequestFinished(*self._context(ctx)))

    def reset_cache(self) -> None:
        self._call(TierReset())


class TraceTier:
    """The serving loop's side of the tier: the calls the connector's scheduler makes for
    each request, on ``manager`` (a :class:`TierManager`, or a recorder around one).

    ``factor`` GPU blocks of ``block_size`` tokens make one CPU block (a chunk); a store
    offers at most ``keys_per_store`` keys at a time (one step's prefill, as vLLM offers
    the blocks a step computed), each offer taken or refused whole."""

    def __init__(self, manager: Any, factor: int, block_size: int, keys_per_store: int) -> None:
        self.manager = manager
        self.factor = factor
        self.block_size = block_size
        self.keys_per_store = max(1, keys_per_store)
        self._requests: dict[str, TierRequest] = {}
        self._loading: dict[str, list[bytes]] = {}
        self._storing: dict[str, list[bytes]] = {}

    def flush(self) -> None:
        """The end of a scheduler step: a recorder hands the step's calls to the log."""
        self.manager.flush()

    def _request(self, req_id: str) -> TierRequest:
        ctx = self._requests.get(req_id)
        if ctx is None:
            ctx = self._requests[req_id] = TierRequest(req_id)
            self.manager.on_new_request(ctx)
        return ctx

    def _keys(self, ctx: TierRequest, contents: Sequence[Hashable], first: int) -> list[bytes]:
        """Keys of CPU blocks ``first, first + 1, ...`` by content; their positions (the
        token after each chunk) go into the context."""
        keys = [tier_key(c) for c in contents]
        chunk_tokens = self.factor * self.block_size
        positions = ctx._offload_key_positions
        for i, key in enumerate(keys):
            positions.setdefault(key, (first + i + 1) * chunk_tokens)
        return keys

    def hits(self, req_id: str, contents: Sequence[Hashable], first: int) -> list[bytes]:
        """Look up CPU blocks ``first, ...`` (their content keys) in order; the keys of the
        leading ones the tier holds ready (a miss or a store in flight ends the run)."""
        ctx = self._request(req_id)
        out = []
        for key in self._keys(ctx, contents, first):
            if self.manager.lookup(key, ctx).name.lower() != "hit":
                break
            out.append(key)
        return out

    def load(self, req_id: str, keys: list[bytes]) -> list[int]:
        """Pin ``keys`` for a load; their CPU blocks."""
        spec = self.manager.prepare_load(keys, self._request(req_id))
        self._loading[req_id] = keys
        return [int(c) for c in spec.block_ids]

    def loaded(self, req_id: str) -> None:
        self.manager.complete_load(self._loading.pop(req_id), self._request(req_id))

    def store(self, req_id: str, contents: Sequence[Hashable]) -> tuple[list[int], list[int]]:
        """Offer CPU blocks ``0 .. len(contents) - 1`` of a request, in batches; the index
        of each block taken and its CPU block (those already held or refused left out)."""
        ctx = self._request(req_id)
        keys = self._keys(ctx, contents, 0)
        index = {key: i for i, key in enumerate(keys)}
        groups: list[int] = []
        chunks: list[int] = []
        stored: list[bytes] = []
        for start in range(0, len(keys), self.keys_per_store):
            answer = self.manager.prepare_store(keys[start : start + self.keys_per_store], ctx)
            if answer is None:
                continue
            stored += answer.keys_to_store
            groups += [index[key] for key in answer.keys_to_store]
            chunks += [int(c) for c in answer.store_spec.block_ids]
        if stored:
            self._storing[req_id] = stored
        return groups, chunks

    def stored(self, req_id: str, success: bool) -> None:
        keys = self._storing.pop(req_id)
        self.manager.complete_store(keys, self._request(req_id), success)

    def finished(self, req_id: str) -> None:
        """The request left: the manager is told, its context dropped."""
        ctx = self._requests.pop(req_id, None)
        if ctx is not None:
            self.manager.on_request_finished(ctx)

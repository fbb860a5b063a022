"""``TierRecorder``: vLLM's offloading manager with every call recorded as a tier event.

The connector's scheduler role wraps its ``CPUOffloadingManager`` in one (config only: no
edit to vLLM). Each call is forwarded unchanged and its arguments and answer are handed to
``sink`` as a tier event (``events.TIER_EVENTS``); a sink that fails detaches the recorder
(the manager keeps serving, the ``kvlog`` logger says so). No vLLM import, and no vLLM
name beyond the manager's public calls: the manager's configuration and the request
contexts are read through :mod:`kvlog.util.vllm_compat` (``contexts``: a
:class:`ContextAccess`, by default its ``ContextMarks``, which knows each release's
``ReqContext``).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Collection, Mapping
from typing import Any, Protocol

from kvlog.events import (
    MAX_TIER_BATCH,
    Event,
    TierBatch,
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
from kvlog.util import vllm_compat

__all__ = ["ContextAccess", "TierRecorder", "tier_config_of"]

_log = logging.getLogger("kvlog")


class _ContextMark:
    """Kept in a ``ReqContext`` (by type, beside the manager's own state): the context's
    number in the log and how many of its key positions were recorded already."""

    __slots__ = ("number", "recorded")

    def __init__(self, number: int) -> None:
        self.number = number
        self.recorded = 0


def tier_config_of(manager: Any, blocks_per_chunk: int = 1, chunk_bytes: int = 0) -> TierConfigured:
    """The ``TierConfigured`` of a vLLM ``CPUOffloadingManager`` (its rule included)."""
    fields = vllm_compat.tier_fields(manager)
    return TierConfigured(**fields, blocks_per_chunk=blocks_per_chunk, chunk_bytes=chunk_bytes)


class ContextAccess(Protocol):
    """How the recorder keeps its mark on a request context and reads its key positions."""

    def get(self, context: Any, kind: type) -> Any:
        """The mark of type ``kind`` kept on ``context`` (None: none yet)."""

    def set(self, context: Any, mark: Any) -> None:
        """Keep ``mark`` on ``context`` for as long as the context lives."""

    def positions(self, context: Any) -> Mapping[bytes, int]:
        """Key -> end-token position, in the order the scheduler set them."""


class TierRecorder:
    """Forwards every manager call and records it (see module docstring).

    ``batched``: the calls' events are kept and handed to ``sink`` by ``flush`` as one
    ``TierBatch`` (one event alone as itself), at most ``MAX_TIER_BATCH`` at a time; the
    scheduler side flushes once per scheduler step, so its log costs one append a step.
    A crash loses the calls of the step not yet flushed, never a flushed one."""

    def __init__(
        self,
        manager: Any,
        sink: Callable[[Event], object],
        config: TierConfigured,
        *,
        contexts: ContextAccess | None = None,
        batched: bool = False,
    ) -> None:
        self.manager = manager
        self.contexts: ContextAccess = vllm_compat.ContextMarks() if contexts is None else contexts
        self.sink: Callable[[Event], object] | None = sink
        self._numbers = itertools.count()
        self._batch: list[TierEvent] | None = [] if batched else None
        self._hand_over(config)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.manager, name)

    def flush(self) -> None:
        """Hand the kept events to the sink (batched; nothing kept: nothing to do)."""
        batch = self._batch
        if not batch:
            return
        events = batch.copy()
        batch.clear()
        self._hand_over(events[0] if len(events) == 1 else TierBatch(events=events))

    def _emit(self, event: TierEvent) -> None:
        batch = self._batch
        if batch is None:
            self._hand_over(event)
            return
        if self.sink is not None:
            batch.append(event)
            if len(batch) >= MAX_TIER_BATCH:
                self.flush()

    def _hand_over(self, event: Event) -> None:
        sink = self.sink
        if sink is None:
            return
        try:
            sink(event)
        except Exception as exc:  # the recorder never takes serving down
            self.sink = None
            if self._batch is not None:
                self._batch.clear()
            _log.error("kvlog: the CPU tier recorder detached: %r", exc)

    def _mark(
        self, req_context: Any, positions_too: bool = True
    ) -> tuple[str, int, list[bytes], list[int]]:
        """The context's request id, number and (``positions_too``) the key positions set
        since its last event that carried positions."""
        contexts = self.contexts
        mark = contexts.get(req_context, _ContextMark)
        if mark is None:
            mark = _ContextMark(next(self._numbers))
            contexts.set(req_context, mark)
        if not positions_too:
            return str(req_context.req_id), mark.number, [], []
        positions = contexts.positions(req_context)
        new = list(itertools.islice(positions.items(), mark.recorded, None))
        mark.recorded = len(positions)
        return str(req_context.req_id), mark.number, [k for k, _ in new], [p for _, p in new]

    def on_new_request(self, req_context: Any) -> Any:
        out = self.manager.on_new_request(req_context)
        req_id, number, keys, positions = self._mark(req_context)
        self._emit(TierRequestStarted(req_id, number, keys, positions))
        return out

    def lookup(self, key: bytes, req_context: Any) -> Any:
        out = self.manager.lookup(key, req_context)
        req_id, number, keys, positions = self._mark(req_context)
        self._emit(TierLookedUp(req_id, number, bytes(key), out.name.lower(), keys, positions))
        return out

    def touch(self, keys: Collection[bytes], req_context: Any) -> None:
        keys = list(keys)
        self.manager.touch(keys, req_context)
        req_id, number, pkeys, positions = self._mark(req_context)
        self._emit(TierTouched(req_id, number, [bytes(k) for k in keys], pkeys, positions))

    def prepare_load(self, keys: Collection[bytes], req_context: Any) -> Any:
        keys = list(keys)
        req_id, number, pkeys, positions = self._mark(req_context)
        out = self.manager.prepare_load(keys, req_context)
        chunk_ids = [int(c) for c in out.block_ids]
        event = TierLoadPrepared(
            req_id, number, [bytes(k) for k in keys], chunk_ids, pkeys, positions
        )
        self._emit(event)
        return out

    def complete_load(self, keys: Collection[bytes], req_context: Any) -> None:
        keys = list(keys)
        self.manager.complete_load(keys, req_context)
        req_id, number, _, _ = self._mark(req_context, positions_too=False)
        self._emit(TierLoadCompleted(req_id, number, [bytes(k) for k in keys]))

    def prepare_store(self, keys: Collection[bytes], req_context: Any) -> Any:
        keys = list(keys)
        req_id, number, pkeys, positions = self._mark(req_context)
        out = self.manager.prepare_store(keys, req_context)
        stored = [] if out is None else [bytes(k) for k in out.keys_to_store]
        chunk_ids = [] if out is None else [int(c) for c in out.store_spec.block_ids]
        evicted = [] if out is None else [bytes(k) for k in out.evicted_keys]
        self._emit(
            TierStorePrepared(
                req_id,
                number,
                [bytes(k) for k in keys],
                out is not None,
                stored,
                chunk_ids,
                evicted,
                pkeys,
                positions,
            )
        )
        return out

    def complete_store(
        self, keys: Collection[bytes], req_context: Any, success: bool = True
    ) -> None:
        keys = list(keys)
        self.manager.complete_store(keys, req_context, success)
        req_id, number, _, _ = self._mark(req_context, positions_too=False)
        self._emit(TierStoreCompleted(req_id, number, [bytes(k) for k in keys], bool(success)))

    def on_request_finished(self, req_context: Any) -> None:
        req_id, number, pkeys, positions = self._mark(req_context)
        self.manager.on_request_finished(req_context)
        self._emit(TierRequestFinished(req_id, number, pkeys, positions))

    def reset_cache(self) -> None:
        self.manager.reset_cache()
        self._emit(TierReset())

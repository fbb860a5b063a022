"""A CPU tier's workload as accesses: each is one request asking for its chunks' keys.

What-ifs, the optimum and the hit-rate curves (``whatif.py``, ``optimum.py``) all read the
same list of :class:`TierAccess`, built from a log's tier events
(:func:`accesses_from_log`: one access per request context, its keys in prefix order) or
from a public trace (:func:`accesses_from_trace`): Mooncake ``hash_ids`` are the keys of
512-token prefix blocks shared across requests (a chunk of ``tokens_per_chunk`` tokens
dividing 512 is ``(hash_id, k)``); Azure has no prefix data, so its keys are the request's
own. Preemption makes a request ask again: a simple serving model admits requests in arrival
order into ``gpu_tokens`` of KV, preempts the newest running one when they do not fit and
resumes it (one more access to its prompt's keys) when another finishes.
"""

from __future__ import annotations

import heapq
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvlog.events import (
    Event,
    Record,
    TierLoadPrepared,
    TierLookedUp,
    TierRequestStarted,
    TierStorePrepared,
    TierTouched,
)
from kvlog.synth.traces import HASH_BLOCK_TOKENS, TraceRequest

__all__ = ["TierAccess", "accesses_from_log", "accesses_from_trace", "chunk_key"]


@dataclass(frozen=True, slots=True)
class TierAccess:
    """One request (or one resumption of it) asking for ``keys``, head to tail."""

    req_id: str
    keys: tuple[bytes, ...]


def chunk_key(block: int, part: int = 0, group: int = 0) -> bytes:
    """An offload key as vLLM builds one (block hash + 4-byte group): 8 bytes of block id,
    2 of part, then the group."""
    return (
        block.to_bytes(8, "big", signed=True) + part.to_bytes(2, "big") + group.to_bytes(4, "big")
    )


def accesses_from_log(
    source: str | os.PathLike[str] | Iterable[Event | Record],
) -> list[TierAccess]:
    """One access per request context of a log, ordered by the context's first ask (lookup,
    load, store or touch), its keys in first-asked order sorted by position where known."""
    from kvlog.tier.replay import tier_events  # the log reader, only when a log is read

    keys: dict[int, dict[bytes, None]] = {}
    names: dict[int, str] = {}
    positions: dict[int, dict[bytes, int]] = {}
    for event in tier_events(source):
        if type(event) is TierRequestStarted:  # a request that asks for nothing counts too
            keys.setdefault(event.context, {})
            names.setdefault(event.context, event.req_id)
            positions.setdefault(event.context, {})
        if type(event) not in (TierLookedUp, TierLoadPrepared, TierStorePrepared, TierTouched):
            continue
        number = event.context  # type: ignore[union-attr]
        names.setdefault(number, event.req_id)  # type: ignore[union-attr]
        seen = keys.setdefault(number, {})
        where = positions.setdefault(number, {})
        where.update(zip(event.position_keys, event.positions, strict=True))  # type: ignore[union-attr]
        asked = [event.key] if type(event) is TierLookedUp else event.keys  # type: ignore[union-attr]
        seen.update(dict.fromkeys(asked))
    out = []
    for number, seen in keys.items():
        ordered = list(seen)
        where = positions[number]
        if all(key in where for key in ordered):
            ordered.sort(key=where.__getitem__)
        out.append(TierAccess(names[number], tuple(ordered)))
    return out


def _prompt_keys(request: TraceRequest, serial: int, tokens_per_chunk: int) -> tuple[bytes, ...]:
    """Keys of the request's full prompt chunks (a partial last chunk is never stored)."""
    num_chunks = request.input_len // tokens_per_chunk
    if not request.hash_ids:
        return tuple(chunk_key(-1 - serial, i) for i in range(num_chunks))
    per_hash = HASH_BLOCK_TOKENS // tokens_per_chunk
    return tuple(
        chunk_key(request.hash_ids[i // per_hash], i % per_hash) for i in range(num_chunks)
    )


def accesses_from_trace(
    requests: Sequence[TraceRequest],
    tokens_per_chunk: int = 512,
    gpu_tokens: int = 0,
    decode_s_per_token: float = 0.02,
) -> list[TierAccess]:
    """The accesses of a public trace (see module docstring); ``gpu_tokens`` 0: no
    preemption. ``tokens_per_chunk`` must divide 512 where the trace has ``hash_ids``."""
    assert HASH_BLOCK_TOKENS % tokens_per_chunk == 0, "a chunk divides a 512-token hash block"
    keys = [_prompt_keys(r, i, tokens_per_chunk) for i, r in enumerate(requests)]
    out: list[TierAccess] = []
    running: list[tuple[float, int]] = []  # (end_s, serial), a heap
    admitted: dict[int, int] = {}  # serial -> tokens held
    waiting: list[int] = []
    for serial, request in enumerate(requests):
        _retire(
            running,
            admitted,
            waiting,
            request.arrival_s,
            gpu_tokens,
            keys,
            out,
            requests,
            decode_s_per_token,
        )
        size = request.input_len + request.output_len
        admitted[serial] = size
        heapq.heappush(
            running, (request.arrival_s + request.output_len * decode_s_per_token, serial)
        )
        out.append(TierAccess(f"r{serial}", keys[serial]))
        while gpu_tokens and sum(admitted.values()) > gpu_tokens and len(admitted) > 1:
            newest = max(admitted)
            del admitted[newest]
            running = [(end, s) for end, s in running if s != newest]
            heapq.heapify(running)
            waiting.append(newest)
    return out


def _retire(
    running: list[tuple[float, int]],
    admitted: dict[int, int],
    waiting: list[int],
    now_s: float,
    gpu_tokens: int,
    keys: Sequence[tuple[bytes, ...]],
    out: list[TierAccess],
    requests: Sequence[TraceRequest],
    decode_s: float,
) -> None:
    """Finish the requests done by ``now_s``; resume waiting ones (FIFO) that fit again."""
    while running and running[0][0] <= now_s:
        end_s, serial = heapq.heappop(running)
        admitted.pop(serial, None)
        while waiting:
            size = requests[waiting[0]].input_len + requests[waiting[0]].output_len
            if sum(admitted.values()) + size > gpu_tokens:
                break
            resumed = waiting.pop(0)
            admitted[resumed] = size
            heapq.heappush(running, (end_s + requests[resumed].output_len * decode_s, resumed))
            out.append(TierAccess(f"r{resumed}", keys[resumed]))

"""Stateless validation of event field values that msgspec types cannot express.

``validate_event`` checks one event on its own (exact types, signs, bounds, orderings,
strings that encode); the reducers check it against the state (ranges, ownership, job
ids). Both raise an ``InvalidEvent`` subclass before anything changes. ``normalize_event``
turns numpy integers and 1-D integer arrays (vLLM hands block ids as int32 arrays) into
plain ints and lists, so that what is logged is plain msgpack.
"""

from __future__ import annotations

import itertools
import typing
from collections.abc import Callable
from typing import Any, NoReturn

import msgspec
import numpy as np
import numpy.typing as npt

from kvlog.errors import BlockOutOfRange, DuplicateBlock, InvalidEvent
from kvlog.events.int_lists import int_lists
from kvlog.events.tier_checks import TIER_VALIDATORS
from kvlog.events.types import (
    DEFRAG_POLICIES,
    MAX_TRANSFER_BATCH,
    BlocksAllocated,
    BlocksReleased,
    CacheConfigured,
    Event,
    LoadRequested,
    RequestFinished,
    RequestPreempted,
    StepEnded,
    StepPacked,
    StepScheduled,
    StoreRequested,
    TransferBatch,
    TransferFinished,
    TransferSubmitted,
    packed_counts,
)

__all__ = [
    "DECODED_VALIDATORS",
    "MAX_BLOCKS",
    "VALIDATORS",
    "MAX_GPU_BLOCKS",
    "MAX_ID",
    "normalize_event",
    "scheduled_ids",
    "validate_block_ids",
    "validate_event",
]

MAX_ID = 2**63 - 1
"""Largest job id or step (msgpack int64)."""
MAX_BLOCKS = 2**31 - 1
"""Largest block id of any kind (CPU ids included): ids are stored as int32."""
MAX_GPU_BLOCKS = 1 << 25
"""Largest GPU pool (33,554,432 blocks). The state costs about 20.3 bytes per GPU block
(five int32 arrays and two bitmaps: 680 MiB at the bound) and a checkpoint as much again
while it is written; the Engine also refuses a pool this machine cannot hold
(``StateTooLarge``). Large snapshots are split across log records, so every pool up to
the bound checkpoints."""
MAX_REQ_ID_LENGTH = 4096
_EVENT_TYPES = frozenset(typing.get_args(Event))


def _int(event: Event, name: str, value: object, lo: int, hi: int = MAX_ID) -> None:
    if type(value) is not int:
        raise InvalidEvent(f"{name} must be an int, got {type(value).__name__}", event)
    if not lo <= value <= hi:
        raise InvalidEvent(f"{name}={value} is outside [{lo}, {hi}]", event)


def _refuse_id(event: Event, name: str, b: object) -> NoReturn:
    if type(b) is not int:
        raise InvalidEvent(f"{name} holds {b!r}, not an int", event)
    if b < 0:
        raise BlockOutOfRange(f"{name} holds negative block id {b}", event)
    raise BlockOutOfRange(f"{name} holds block id {b}, above {MAX_BLOCKS}", event)


def validate_block_ids(event: Event, name: str, block_ids: object) -> None:
    """Block ids must be a list of distinct non-negative ints (upper bound is stateful).
    One plain pass: for the few ids of a transfer or an allocation it beats building sets
    of their types (measured), and it names the first bad id as it meets it."""
    if not isinstance(block_ids, (list, tuple)):
        raise InvalidEvent(f"{name} must be a list of ints", event)
    for b in block_ids:
        if type(b) is not int or not 0 <= b <= MAX_BLOCKS:
            _refuse_id(event, name, b)
    if len(block_ids) > 1 and len(set(block_ids)) != len(block_ids):
        seen: set[int] = set()
        dup = next(b for b in block_ids if b in seen or seen.add(b))  # type: ignore[func-returns-value]
        raise DuplicateBlock(f"{name} holds block id {dup} twice", event)


def _req_id(event: Event, req_id: object) -> None:
    if type(req_id) is not str or not 0 < len(req_id) <= MAX_REQ_ID_LENGTH:
        raise InvalidEvent(f"req_id must be a non-empty str of at most {MAX_REQ_ID_LENGTH}", event)
    if not req_id.isascii():
        _encodable(event, "req_id", req_id)


def _encodable(event: Event, name: str, text: str) -> None:
    """A str the log can hold: UTF-8 encodable (no lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidEvent(f"{name} is not valid UTF-8 text: {exc.reason}", event) from exc


def _validate_config(e: CacheConfigured) -> None:
    _int(e, "num_gpu_blocks", e.num_gpu_blocks, 1, MAX_GPU_BLOCKS)
    _int(e, "block_size", e.block_size, 1, MAX_BLOCKS)
    _int(e, "num_cpu_blocks", e.num_cpu_blocks, 0, MAX_BLOCKS)
    _int(e, "block_size_factor", e.block_size_factor, 1, 1 << 16)
    _int(e, "threshold", e.threshold, 0, MAX_BLOCKS)
    _int(e, "page_size_bytes", e.page_size_bytes, 0, 1 << 40)
    for name in ("prefix_caching", "defrag", "quarantine_released"):
        if type(getattr(e, name)) is not bool:
            raise InvalidEvent(f"{name} must be a bool", e)
    pads = e.pad_sizes
    if not isinstance(pads, (list, tuple)) or not pads:
        raise InvalidEvent("pad_sizes must be a non-empty sequence of ints", e)
    for p in pads:
        _int(e, "pad_sizes entry", p, 1, 1 << 20)
    if any(a >= b for a, b in itertools.pairwise(pads)):
        raise InvalidEvent(f"pad_sizes must be strictly ascending, got {list(pads)}", e)
    _int(e, "max_swaps", e.max_swaps, 1, pads[-1])
    if e.num_cpu_blocks * e.block_size_factor > MAX_BLOCKS:
        raise InvalidEvent("num_cpu_blocks * block_size_factor exceeds the id space", e)
    _validate_policy(e)


def _validate_policy(e: CacheConfigured) -> None:
    """The named defrag policy and its parameters (``reducers/policies.py``)."""
    if type(e.policy) is not str or e.policy not in DEFRAG_POLICIES:
        raise InvalidEvent(f"policy must be one of {list(DEFRAG_POLICIES)}, got {e.policy!r}", e)
    _int(e, "policy_ratio_pct", e.policy_ratio_pct, 100, 1 << 20)
    _int(e, "policy_min_swaps", e.policy_min_swaps, 1, 1 << 20)
    _int(e, "max_bytes_per_step", e.max_bytes_per_step, 0, 1 << 50)


def _validate_transfer(e: StoreRequested | LoadRequested) -> None:
    _int(e, "job_id", e.job_id, 0)
    validate_block_ids(e, "gpu_block_ids", e.gpu_block_ids)
    validate_block_ids(e, "cpu_block_ids", e.cpu_block_ids)
    if not e.gpu_block_ids or not e.cpu_block_ids:
        raise InvalidEvent("a transfer needs at least one GPU and one CPU block", e)
    _validate_groups(e)
    if type(e.deferred) is not bool:
        raise InvalidEvent("deferred must be a bool", e)


def _validate_groups(e: StoreRequested | LoadRequested) -> None:
    """vLLM's spec shape: one size and one first-block index per KV-cache group, sizes
    summing to the GPU blocks; both empty for the seed's rule."""
    sizes, indices = e.group_sizes, e.block_indices
    if not isinstance(sizes, (list, tuple)) or not isinstance(indices, (list, tuple)):
        raise InvalidEvent("group_sizes and block_indices must be sequences of ints", e)
    if len(sizes) != len(indices):
        raise InvalidEvent(
            f"{len(sizes)} group_sizes but {len(indices)} block_indices: one of each per "
            "KV-cache group",
            e,
        )
    for size in sizes:
        _int(e, "group_sizes entry", size, 0, MAX_BLOCKS)
    for index in indices:
        _int(e, "block_indices entry", index, 0, MAX_BLOCKS)
    if sizes and sum(sizes) != len(e.gpu_block_ids):
        raise InvalidEvent(
            f"group_sizes sum to {sum(sizes)} but there are {len(e.gpu_block_ids)} GPU blocks",
            e,
        )


def _validate_blocks_event(event: Any) -> None:
    _req_id(event, event.req_id)
    validate_block_ids(event, "block_ids", event.block_ids)


def _validate_request_event(event: Any) -> None:
    _req_id(event, event.req_id)


def _validate_step(event: Any) -> None:
    _int(event, "step", event.step, 0)


def _validate_job_id(event: Any) -> None:
    _int(event, "job_id", event.job_id, 0)


def _validate_finished(event: Any) -> None:
    _int(event, "job_id", event.job_id, 0)
    if type(event.success) is not bool:
        raise InvalidEvent("success must be a bool", event)


def _validate_step_scheduled(event: StepScheduled) -> None:
    """A whole step: its number, each request id, and that every block id is an int (not
    a bool; an ``IntEnum`` member counts as its value: ``kvlog.events.int_lists``). What
    the pool bounds anyway (negative ids, ids out of range, an id given twice) the step's
    check refuses in its one compiled pass over the step's blocks (``reducers/step.py``),
    with the same errors as ``validate_block_ids``."""
    scheduled_ids(event)


def scheduled_ids(event: StepScheduled) -> npt.NDArray[np.int64] | None:
    """``StepScheduled``'s validation (raises as it does), returning what its pass over
    the block ids read: all of them, concatenated, as int64, for the step's check to take
    instead of reading them again (``reducers.check``); None where an id is an int past
    int64 (the check refuses it by range)."""
    _int(event, "step", event.step, 0)
    allocated = event.allocated
    if type(allocated) is not dict:
        raise InvalidEvent("allocated must be a dict of request id -> block ids", event)
    for req_id, block_ids in allocated.items():
        if type(req_id) is not str or not 0 < len(req_id) <= MAX_REQ_ID_LENGTH:
            _req_id(event, req_id)
        elif not req_id.isascii():
            _encodable(event, "req_id", req_id)
        if type(block_ids) is not list:
            raise InvalidEvent(f"allocated[{req_id!r}] must be a list of ints", event)
    lists = list(allocated.values())
    ids = int_lists(lists, sum(map(len, lists)))  # ints only (bools are not), fast
    if ids is None:
        types = list(map(type, itertools.chain.from_iterable(lists)))
        if types.count(int) != len(types):  # exact ints only (one C-level pass, no set)
            for req_id, block_ids in allocated.items():
                validate_block_ids(event, f"allocated[{req_id!r}]", block_ids)  # names it
    _validate_request_ids(event, ("finished", "preempted", "resumed"))
    return ids


def _validate_request_ids(event: Event, names: tuple[str, ...]) -> None:
    """Each of the lists ``names`` of ``event`` is a list of valid request ids."""
    for name in names:
        req_ids = getattr(event, name)
        if type(req_ids) is not list:
            raise InvalidEvent(f"{name} must be a list of request ids", event)
        for req_id in req_ids:
            if type(req_id) is not str or not 0 < len(req_id) <= MAX_REQ_ID_LENGTH:
                _req_id(event, req_id)
            elif not req_id.isascii():
                _encodable(event, "req_id", req_id)


def _validate_step_packed(event: StepPacked) -> None:
    """``StepScheduled``'s checks in the packed form: its number and request ids, then
    the shape of the packing (one int32 count per request, none negative, the ids as
    many as they add up to, no request twice). What the pool bounds (negative ids, ids
    out of range, an id given twice) the step's check refuses, as for ``StepScheduled``."""
    _int(event, "step", event.step, 0)
    _validate_request_ids(event, ("req_ids", "finished", "preempted", "resumed"))
    counts, block_ids, width = event.counts, event.block_ids, event.id_bytes
    if type(counts) is not bytes or type(block_ids) is not bytes:
        raise InvalidEvent("counts and block_ids must be bytes (little-endian int32)", event)
    if type(width) is not int or width not in (2, 4):
        raise InvalidEvent(f"id_bytes must be 2 or 4, got {width!r}", event)
    if len(counts) != 4 * len(event.req_ids):
        raise InvalidEvent(
            f"counts holds {len(counts)} bytes for {len(event.req_ids)} requests: one "
            "little-endian int32 each",
            event,
        )
    sizes = packed_counts(event)
    if sizes and min(sizes) < 0:
        raise InvalidEvent("counts holds a negative count", event)
    if len(block_ids) != width * sum(sizes):
        raise InvalidEvent(
            f"block_ids holds {len(block_ids)} bytes where counts add up to {sum(sizes)} "
            f"ids of {width} bytes",
            event,
        )
    if len(set(event.req_ids)) != len(event.req_ids):
        seen: set[str] = set()
        dup = next(r for r in event.req_ids if r in seen or seen.add(r))  # type: ignore[func-returns-value]
        raise InvalidEvent(f"req_ids holds {dup!r} twice", event)


VALIDATORS: dict[type, Callable[[Any], None]] = {  # each event type's stateless checks
    CacheConfigured: _validate_config,
    BlocksAllocated: _validate_blocks_event,
    BlocksReleased: _validate_blocks_event,
    RequestFinished: _validate_request_event,
    RequestPreempted: _validate_request_event,
    StepEnded: _validate_step,
    StoreRequested: _validate_transfer,
    LoadRequested: _validate_transfer,
    TransferSubmitted: _validate_job_id,
    TransferFinished: _validate_finished,
    StepScheduled: _validate_step_scheduled,
    StepPacked: _validate_step_packed,
}
VALIDATORS.update(TIER_VALIDATORS)  # the CPU tier's events (events/tier_checks.py)


def _validate_transfer_batch(e: TransferBatch) -> None:
    """1 to MAX_TRANSFER_BATCH transfer events, none a batch. Each event is validated on its
    own in order with its check against the state (``reducers/transfer_batch.py``), so that
    a batch is refused with the error of its first refused event."""
    events = e.events
    if type(events) is not list or not 0 < len(events) <= MAX_TRANSFER_BATCH:
        raise InvalidEvent(f"events must be a list of 1 to {MAX_TRANSFER_BATCH} events", e)
    for event in events:
        if type(event) not in _TRANSFER_TYPES:
            raise InvalidEvent(f"a TransferBatch holds transfer events, not {event!r}", e)


_TRANSFER_TYPES = (StoreRequested, LoadRequested, TransferSubmitted, TransferFinished)
VALIDATORS[TransferBatch] = _validate_transfer_batch
assert set(VALIDATORS) == _EVENT_TYPES, "every event type has exactly one validator"


def _validate_decoded_step(event: StepScheduled) -> None:
    """``_validate_step_scheduled`` for a step the log's typed decoder produced
    (``kvlog.events.codec``): msgspec has already made every type it checks exact (a str
    id that is valid UTF-8, lists of ints that are not bools), so only the values are
    left: the step's range and each request id's length, over the step's lists at C
    level. Anything off runs the full check, which names it with the same error."""
    if not 0 <= event.step <= MAX_ID:
        _validate_step_scheduled(event)
    for req_ids in (event.allocated, event.finished, event.preempted, event.resumed):
        if req_ids and not 0 < min(map(len, req_ids)) <= max(map(len, req_ids)) <= (
            MAX_REQ_ID_LENGTH
        ):
            _validate_step_scheduled(event)


def _validate_decoded_packed(event: StepPacked) -> None:
    """``_validate_step_packed`` for a step the log's typed decoder produced: the types
    are exact (lists of str, bytes), so only the values are left; anything off runs the
    full check, which names it."""
    req_ids = event.req_ids
    if not 0 <= event.step <= MAX_ID or len(event.counts) != 4 * len(req_ids):
        _validate_step_packed(event)
    for names in (req_ids, event.finished, event.preempted, event.resumed):
        if names and (
            "" in names
            or (
                len("".join(names)) > MAX_REQ_ID_LENGTH and max(map(len, names)) > MAX_REQ_ID_LENGTH
            )
        ):
            _validate_step_packed(event)
    sizes = packed_counts(event)
    width = event.id_bytes
    if (
        (sizes and min(sizes) < 0)
        or width not in (2, 4)
        or len(event.block_ids) != width * sum(sizes)
    ):
        _validate_step_packed(event)
    if len(set(req_ids)) != len(req_ids):
        _validate_step_packed(event)


DECODED_VALIDATORS: dict[type, Callable[[Any], None]] = {
    **VALIDATORS,
    StepScheduled: _validate_decoded_step,
    StepPacked: _validate_decoded_packed,
}
"""``VALIDATORS`` for events that came out of the log's typed decoder (replay): the same
verdicts and errors on every event the decoder can produce, at a fraction of the cost
for a ``StepScheduled`` (its hundreds of block ids are not type-checked again)."""


def validate_event(event: object) -> None:
    """Raise ``InvalidEvent`` if ``event`` is not a well-formed event on its own."""
    validator = VALIDATORS.get(type(event))  # exact types: a subclass would not decode
    if validator is None:
        raise InvalidEvent(f"not a kvlog event: {type(event).__name__}", None)
    validator(event)


def normalize_event(event: Any) -> Any:
    """``event`` with numpy integers as ints and 1-D integer numpy arrays (or lists and
    tuples holding numpy integers) as lists of ints; ``event`` itself when nothing needs
    converting or it is not a kvlog event. Anything else is left for validation to refuse."""
    if type(event) not in _EVENT_TYPES:
        return event
    changes = {}
    for name in event.__struct_fields__:
        value = getattr(event, name)
        plain = _plain(value)
        if plain is not value:
            changes[name] = plain
    return msgspec.structs.replace(event, **changes) if changes else event


def _plain(value: Any) -> Any:
    if type(value) is dict:  # StepScheduled.allocated: request id -> block ids
        plain = {key: _plain(v) for key, v in value.items()}
        return plain if any(plain[k] is not v for k, v in value.items()) else value
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, np.ndarray):
        if value.ndim == 1 and np.issubdtype(value.dtype, np.integer):
            return value.tolist()
        return value
    if isinstance(value, (list, tuple)) and any(isinstance(v, np.integer) for v in value):
        out = [int(v) if isinstance(v, np.integer) else v for v in value]
        return out if isinstance(value, list) else tuple(out)
    return value

"""Canonical encoding of a State: ``digest``, ``snapshot`` and ``restore``.

The encoding is msgpack (msgspec) of plain types in a fixed order: the configuration as a
dict, the per-block arrays as explicit little-endian int32 bytes, the request tables sorted
by request id and the jobs sorted by job id. It never uses ``hash()`` or pickle, so the
digest is the same across processes, platforms and Python versions. Derived data (bitmaps,
``num_used``, ``max_used``) is left out and rebuilt on restore; ``last_swap`` is debug data
kept in snapshots only. The digest hashes the encoding piece by piece (the arrays straight
from the state's buffers), so it never holds a copy of the arrays.

A snapshot (format 2) is ``SNAPSHOT_MAGIC | crc32c u32 | body``, the body msgpack of
``[digest, zlib(canonical without the arrays), arrays, last_swap]``; each array is stored
as ``[codec, bytes...]``: fwd and bwd as their difference from the identity, then as the
positions and values of its nonzero entries when at most 1/16 are nonzero, zlib when at
most half are, raw otherwise. ``restore`` checks the CRC, rebuilds, checks
every invariant with typed errors (``kvlog.reducers.consistency``, no asserts) and that the
rebuilt state has the recorded digest. Format 1 snapshots (msgpack ``[magic, canonical,
last_swap]``, no checksum), as in older logs, still restore, with the same checks.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from typing import Any

import msgspec
import numpy as np

from kvlog.errors import CorruptLogError
from kvlog.events import (
    CONFIG_DEFAULTS,
    DECODE_ERRORS,
    CacheConfigured,
    SwapPlan,
    decode_plan,
    encode,
)
from kvlog.reducers import checkpoint
from kvlog.reducers.blockset import BlockSet, pack_words
from kvlog.reducers.consistency import check_consistent
from kvlog.reducers.jobs import Job
from kvlog.reducers.state import State
from kvlog.reducers.transfers import seed_sub_blocks
from kvlog.util import crc32c as _crc32c

__all__ = [
    "FORMAT_VERSION",
    "SNAPSHOT_MAGIC",
    "digest",
    "digest_and_snapshot",
    "restore",
    "snapshot",
]

FORMAT_VERSION = 1
_MAGIC = "kvlog.reducers.State"
_ARRAYS = ("refs", "fwd", "bwd", "store_pins", "load_pins")
_ARRAYS_AT = 4  # index of the arrays in the canonical list
_MAPPINGS = frozenset({"fwd", "bwd"})  # stored as their difference from the identity
SNAPSHOT_MAGIC = b"\x89KVSNAP\x02"
"""First bytes of a format-2 snapshot (a format-1 one starts with a msgpack array)."""
_RAW, _ZLIB, _SPARSE = 0, 1, 2


_SCHEMA1_CONFIG = frozenset(CacheConfigured.__struct_fields__[:10])


def _config(config: CacheConfigured | None) -> dict[str, Any] | None:
    """The configuration as a dict; fields grown after schema 1 are left out while at their
    default, so every earlier log keeps its digests."""
    if config is None:
        return None
    out: dict[str, Any] = msgspec.to_builtins(config)
    for name in CacheConfigured.__struct_fields__:
        if name not in _SCHEMA1_CONFIG and getattr(config, name) == CONFIG_DEFAULTS[name]:
            del out[name]
    return out


def _seed_subs(job: Job, factor: int) -> np.ndarray:
    """A job's CPU sub-blocks under the seed's rule (all that schema-1 logs knew)."""
    return seed_sub_blocks(job.kind, job.gpu_block_ids.size, job.cpu_block_ids, factor)


def _job(job: Job, factor: int) -> list[Any]:
    """A job as ``[id, kind, gpu, cpu]``, plus ``[cpu sub-blocks, submitted]`` when those
    differ from what the seed's rule and an immediate submit give."""
    out: list[Any] = [job.job_id, job.kind, job.gpu_block_ids.tolist(), job.cpu_block_ids.tolist()]
    assert job.pairs is not None, "every job keeps its pairs"
    subs = job.pairs[1] if job.kind == "store" else job.pairs[0]
    seed = _seed_subs(job, factor)
    if not job.submitted or subs.size != seed.size or not np.array_equal(subs, seed):
        out += [subs.tolist(), job.submitted]
    return out


def _canonical(state: State) -> list[Any]:
    arrays = [_le_bytes(getattr(state, name)) for name in _ARRAYS]
    tables = [[req_id, state.tables[req_id]] for req_id in sorted(state.tables)]
    factor = state.config.block_size_factor if state.config is not None else 1
    jobs = [
        _job(j, factor)
        for j in sorted(
            [*state.store_jobs.values(), *state.load_jobs.values()], key=lambda j: j.job_id
        )
    ]
    out: list[Any] = [FORMAT_VERSION, _config(state.config), state.step, state.last_job_id]
    out.append(arrays)
    out += [tables, jobs]
    if state.quarantined:
        out.append(sorted(state.quarantined))
    return out


def _le_bytes(array: np.ndarray) -> memoryview:
    """The bytes of an int32 array as little-endian int32, without a copy where native."""
    return np.ascontiguousarray(array, dtype="<i4").data.cast("B")


def _array_header(count: int) -> bytes:
    if count < 16:
        return bytes([0x90 | count])
    return (
        b"\xdc" + struct.pack(">H", count)
        if count < 1 << 16
        else b"\xdd" + struct.pack(">I", count)
    )


def _bin_header(size: int) -> bytes:
    if size < 1 << 8:
        return b"\xc4" + struct.pack(">B", size)
    return (
        b"\xc5" + struct.pack(">H", size) if size < 1 << 16 else b"\xc6" + struct.pack(">I", size)
    )


def _hash(canonical: list[Any]) -> str:
    """sha256 of ``msgpack.encode(canonical)``, fed piece by piece (no copy of the arrays)."""
    sha = hashlib.sha256(_array_header(len(canonical)))
    for index, item in enumerate(canonical):
        if index != _ARRAYS_AT:
            sha.update(msgspec.msgpack.encode(item))
            continue
        sha.update(_array_header(len(item)))
        for array in item:
            sha.update(_bin_header(len(array)))
            sha.update(array)
    return sha.hexdigest()


def digest(state: State) -> str:
    """Hex sha256 of the canonical encoding."""
    return _hash(_canonical(state))


def snapshot(state: State) -> bytes:
    """The whole state as bytes; ``restore`` gives it back with the same digest."""
    return digest_and_snapshot(state)[1]


def digest_and_snapshot(state: State) -> tuple[str, bytes]:
    """``digest(state)`` and ``snapshot(state)``, from one canonical encoding."""
    canonical = _canonical(state)
    hexdigest = _hash(canonical)
    arrays = [_pack_array(name, state) for name in _ARRAYS]
    rest = list(canonical)
    rest[_ARRAYS_AT] = None
    last_swap = encode(state.last_swap) if state.last_swap is not None else b""
    body = msgspec.msgpack.encode(
        [hexdigest, zlib.compress(msgspec.msgpack.encode(rest), 1), arrays, last_swap]
    )
    crc = struct.pack("<I", _crc32c.crc32c(body))
    return hexdigest, SNAPSHOT_MAGIC + crc + body


def _pack_array(name: str, state: State) -> list[Any]:
    """``[codec, bytes...]`` of one per-block array (see the module docstring)."""
    array = getattr(state, name)
    if name in _MAPPINGS:
        array = array - np.arange(array.size, dtype=np.int32)
    nonzero = np.flatnonzero(array)
    if nonzero.size * 16 <= array.size:  # sparse: positions and values
        return [_SPARSE, _le_bytes(nonzero.astype(np.int32)), _le_bytes(array[nonzero])]
    if nonzero.size * 2 <= array.size:
        return [_ZLIB, zlib.compress(_le_bytes(array), 1)]
    return [_RAW, _le_bytes(array)]


def _unpack_array(name: str, packed: list[Any], size: int) -> np.ndarray:
    """One per-block array back from ``[codec, bytes...]``."""
    codec, data, *more = packed
    if codec == _SPARSE:
        array = np.zeros(size, dtype=np.int32)
        positions, values = np.frombuffer(data, "<i4"), np.frombuffer(more[0], "<i4")
        inside = int(positions.min(initial=0)) >= 0 and int(positions.max(initial=0)) < size
        if positions.size != values.size or not (inside or positions.size == 0):
            raise ValueError(f"{name}: bad sparse positions")
        array[positions] = values
    elif codec in (_RAW, _ZLIB):
        raw = zlib.decompress(data) if codec == _ZLIB else data
        if len(raw) != 4 * size:
            raise ValueError(f"{name}: {len(raw)} bytes for {size} blocks")
        array = np.frombuffer(raw, "<i4")
    else:
        raise ValueError(f"{name}: unknown codec {codec!r}")
    return array + np.arange(size, dtype=np.int32) if name in _MAPPINGS else array


_NOT_A_SNAPSHOT: tuple[type[Exception], ...] = (
    *DECODE_ERRORS,
    *(ValueError, TypeError, KeyError, IndexError, OverflowError, zlib.error),
)


def restore(blob: bytes) -> State:
    """A State from ``snapshot`` bytes; ``CorruptLogError`` if they are not one (a checksum
    or digest that does not match, or a state that breaks an invariant)."""
    try:
        if bytes(blob[: len(SNAPSHOT_MAGIC)]) == SNAPSHOT_MAGIC:
            return _restore_v2(blob)
        magic, canonical, last_swap = msgspec.msgpack.decode(blob)
        if magic != _MAGIC or canonical[0] != FORMAT_VERSION:
            raise ValueError(f"not a version {FORMAT_VERSION} state snapshot")
        return _finish(_rebuild(canonical), last_swap)
    except CorruptLogError:
        raise
    except _NOT_A_SNAPSHOT as error:
        raise CorruptLogError(f"bad state snapshot: {error}") from error


def _restore_v2(blob: bytes) -> State:
    start = len(SNAPSHOT_MAGIC) + 4
    (crc,) = struct.unpack_from("<I", blob, len(SNAPSHOT_MAGIC))
    with memoryview(blob)[start:] as body:
        if _crc32c.crc32c(body) != crc:
            raise CorruptLogError("bad state snapshot: checksum mismatch")
        hexdigest, packed_rest, arrays, last_swap = msgspec.msgpack.decode(body)
    canonical = msgspec.msgpack.decode(zlib.decompress(packed_rest))
    config = canonical[1]
    size = int(config["num_gpu_blocks"]) if config is not None else 0
    canonical[_ARRAYS_AT] = (  # unpacked one at a time, as _rebuild copies them in
        _unpack_array(name, packed, size) for name, packed in zip(_ARRAYS, arrays, strict=True)
    )
    state = _finish(_rebuild(canonical), last_swap)
    if digest(state) != hexdigest:
        raise CorruptLogError("bad state snapshot: the rebuilt state has another digest")
    return state


def _finish(state: State, last_swap: bytes) -> State:
    """Attach ``last_swap`` and check the rebuilt state (typed errors, no asserts)."""
    if last_swap:
        plan = decode_plan(last_swap)
        if not isinstance(plan, SwapPlan):
            raise ValueError(f"last_swap is a {type(plan).__name__}, not a SwapPlan")
        state.last_swap = plan
    check_consistent(state)
    return state


def _rebuild(canonical: list[Any]) -> State:
    _, config, step, last_job_id, arrays, tables, jobs, *rest = canonical
    state = State()
    if config is not None:
        state.configure(_checked_config(config))
    for name, raw in zip(_ARRAYS, arrays, strict=True):
        array = raw if isinstance(raw, np.ndarray) else np.frombuffer(raw, dtype="<i4")
        if array.size != state.num_gpu_blocks:
            raise ValueError(f"{name} holds {array.size} blocks, not {state.num_gpu_blocks}")
        getattr(state, name)[:] = array  # into the buffer the State's loops index
    state.step, state.last_job_id = int(step), int(last_job_id)
    state.load_tables({str(req_id): [int(b) for b in table] for req_id, table in tables})
    factor = state.config.block_size_factor if state.config is not None else 1
    for job_id, kind, gpu, cpu, *extra in jobs:
        job = Job(int(job_id), kind, np.asarray(gpu, np.int64), np.asarray(cpu, np.int64))
        subs = np.asarray(extra[0], np.int64) if extra else _seed_subs(job, factor)
        job.submitted = bool(extra[1]) if extra else True
        job.pairs = (job.gpu_block_ids, subs) if kind == "store" else (subs, job.gpu_block_ids)
        (state.store_jobs if kind == "store" else state.load_jobs)[job.job_id] = job
    state.used = BlockSet.from_mask(state.refs > 0)
    state.quarantined = {int(b) for b in rest[0]} if rest else set()
    pinned = (state.store_pins | state.load_pins) > 0
    if state.quarantined:
        pinned[np.fromiter(state.quarantined, np.int64, len(state.quarantined))] = True
    state.pinned[:] = pack_words(pinned)
    state._max_used = state.used.highest_at_most(state.num_gpu_blocks - 1)
    checkpoint.reseat(state)
    return state


def _checked_config(config: Any) -> CacheConfigured:
    """The snapshot's configuration, valid (so its pool size is bounded) before any
    allocation."""
    from kvlog.events import validate_event

    checked = msgspec.convert(config, CacheConfigured)
    validate_event(checked)  # InvalidEvent is a ValueError: reported as a bad snapshot
    return checked

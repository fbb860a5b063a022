"""Canonical encoding of a State: ``digest``, ``snapshot`` and ``restore``.

The encoding is msgpack (msgspec) of plain types in a fixed order: the configuration as a
dict, the per-block arrays as explicit little-endian int32 bytes, the request tables sorted
by request id and the jobs sorted by job id. It never uses ``hash()`` or pickle, so the
digest is the same across processes, platforms and Python versions. Derived data (bitmaps,
``num_used``, ``max_used``) is left out and rebuilt on restore; ``last_swap`` is debug data
kept in snapshots only.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec
import numpy as np

from kvlog.errors import CorruptLogError
from kvlog.events import CacheConfigured, SwapPlan, decode_plan, encode
from kvlog.reducers.blockset import BlockSet, pack_words
from kvlog.reducers.invariants import check_invariants
from kvlog.reducers.state import Job, State

__all__ = ["FORMAT_VERSION", "digest", "restore", "snapshot"]

FORMAT_VERSION = 1
_MAGIC = "kvlog.reducers.State"
_ARRAYS = ("refs", "fwd", "bwd", "store_pins", "load_pins")


_SCHEMA1_CONFIG = frozenset(CacheConfigured.__struct_fields__[:10])
_CONFIG_DEFAULTS = dict(
    zip(
        CacheConfigured.__struct_fields__[-len(CacheConfigured.__struct_defaults__) :],
        CacheConfigured.__struct_defaults__,
        strict=True,
    )
)


def _config(config: CacheConfigured | None) -> dict[str, Any] | None:
    """The configuration as a dict; fields grown after schema 1 are left out while at their
    default, so every earlier log keeps its digests."""
    if config is None:
        return None
    out: dict[str, Any] = msgspec.to_builtins(config)
    for name in CacheConfigured.__struct_fields__:
        if name not in _SCHEMA1_CONFIG and getattr(config, name) == _CONFIG_DEFAULTS[name]:
            del out[name]
    return out


def _seed_subs(job: Job, factor: int) -> np.ndarray:
    """A job's CPU sub-blocks under the seed's rule (all that schema-1 logs knew)."""
    subs = (job.cpu_block_ids[:, None] * factor + np.arange(factor)).ravel()
    skip = 0 if job.kind == "store" else (-job.gpu_block_ids.size) % factor
    return subs[skip:]


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
    arrays = [getattr(state, name).astype("<i4").tobytes() for name in _ARRAYS]
    tables = [[req_id, state.tables[req_id]] for req_id in sorted(state.tables)]
    factor = state.config.block_size_factor if state.config is not None else 1
    jobs = [
        _job(j, factor)
        for j in sorted(
            [*state.store_jobs.values(), *state.load_jobs.values()], key=lambda j: j.job_id
        )
    ]
    out = [FORMAT_VERSION, _config(state.config), state.step, state.last_job_id, arrays]
    out += [tables, jobs]
    if state.quarantined:
        out.append(sorted(state.quarantined))
    return out


def digest(state: State) -> str:
    """Hex sha256 of the canonical encoding."""
    return hashlib.sha256(msgspec.msgpack.encode(_canonical(state))).hexdigest()


def snapshot(state: State) -> bytes:
    """The whole state as bytes; ``restore`` gives it back with the same digest."""
    last_swap = encode(state.last_swap) if state.last_swap is not None else b""
    return msgspec.msgpack.encode([_MAGIC, _canonical(state), last_swap])


def restore(blob: bytes) -> State:
    """A State from ``snapshot`` bytes; ``CorruptLogError`` if they are not one."""
    try:
        magic, canonical, last_swap = msgspec.msgpack.decode(blob)
        if magic != _MAGIC or canonical[0] != FORMAT_VERSION:
            raise ValueError(f"not a version {FORMAT_VERSION} state snapshot")
        state = _rebuild(canonical)
        if last_swap:
            plan = decode_plan(last_swap)
            assert isinstance(plan, SwapPlan), "last_swap must be a SwapPlan"
            state.last_swap = plan
        check_invariants(state)
    except (ValueError, TypeError, KeyError, IndexError, AssertionError) as error:
        raise CorruptLogError(f"bad state snapshot: {error}") from error
    return state


def _rebuild(canonical: list[Any]) -> State:
    _, config, step, last_job_id, arrays, tables, jobs, *rest = canonical
    state = State()
    if config is not None:
        state.configure(msgspec.convert(config, CacheConfigured))
    for name, raw in zip(_ARRAYS, arrays, strict=True):
        array = np.frombuffer(raw, dtype="<i4").astype(np.int32)
        if array.size != state.num_gpu_blocks:
            raise ValueError(f"{name} holds {array.size} blocks, not {state.num_gpu_blocks}")
        getattr(state, name)[:] = array  # into the buffer the State's loops index
    state.step, state.last_job_id = int(step), int(last_job_id)
    state.tables = {str(req_id): [int(b) for b in table] for req_id, table in tables}
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
    return state

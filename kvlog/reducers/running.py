"""The running digest (``"v2:"``): the state's digest kept up to date with every change.

The canonical digest (``digest.py``, version 1) hashes the whole state, O(num_gpu_blocks)
per call, which made every checkpoint cost as much as the pool. This one is a sum, modulo
2**64, of a 64-bit mix of every item of the state that is not derived from the others, kept
in three running sums that every primitive of ``State`` updates with what it changes:

- the mapping: one term per logical block whose physical block is not itself
  (``fwd[L] != L``); the identity contributes nothing, so a fresh pool costs nothing;
- the tables: one term per ``(request, position, block)``, hashed as the block is
  appended and kept per request as well (a row of uint64 arrays, see ``RunningDigest``),
  so a request that finishes subtracts its sum in O(1);
- the jobs: one term per unfinished job (a hash of its id, kind, GPU, CPU and sub-block
  ids), and one more once its plan is submitted.

Ref counts, pins and the inverse mapping are functions of these (``check_invariants``
asserts so) and need no terms. A checkpoint's digest is then ``"v2:"`` and the sha256 of
``[2, config, step, last_job_id, the three sums, the quarantined blocks]``: O(1) in the
pool. It is deterministic across processes and platforms (no Python ``hash``: request ids
are keyed with blake2b). ``recompute`` rebuilds the sums from scratch (after a restore, and
in ``check_invariants`` to check the running ones).
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from kvlog.reducers import kernels
from kvlog.reducers.arena import TableArena
from kvlog.reducers.buffers import uint64_buffer
from kvlog.reducers.kernels import FWD_KEY, GOLDEN
from kvlog.reducers.request_keys import SCRATCH_WORDS, keys_into
from kvlog.util.splitmix import mix64, mix64_array

if TYPE_CHECKING:
    from kvlog.reducers.jobs import Job

__all__ = [
    "DIGEST_V2_PREFIX",
    "MASK",
    "RunningDigest",
    "Tables",
    "fwd_terms",
    "job_term",
    "mix",
    "request_key",
    "submitted_term",
    "table_sums",
    "table_terms",
]

DIGEST_V2_PREFIX = "v2:"
"""How a checkpoint names the running digest (a version-1 digest is 64 bare hex digits)."""
MASK = (1 << 64) - 1
_SUBMITTED_KEY = 0x13198A2E03707344
_LOOP_LIMIT = 16
"""Up to this many table entries, ``table_terms`` hashes them in a Python loop."""
_FIRST_ROWS = 64
"""Request rows a fresh ``RunningDigest`` holds before it first doubles them."""
_BULK_KEYS = 8
"""From this many new requests on, ``add_requests`` hashes their keys compiled
(``request_keys.keys_into``: ~150 ns a key against ~390 for hashlib's calls, after a
fixed ~1.5 us)."""


mix = mix64
"""splitmix64's finalizer on a Python int below 2**64 (:mod:`kvlog.util.splitmix`)."""
_mix_array = mix64_array


def _sum(terms: np.ndarray) -> int:
    return int(terms.sum(dtype=np.uint64)) if terms.size else 0


_KEY_HASH = hashlib.blake2b(digest_size=8)
"""An empty 8-byte blake2b: each key hashes a copy (a quarter cheaper than a new one)."""


def request_key(req_id: str) -> int:
    """A request's 64-bit key (blake2b of its UTF-8 id: the same in every process)."""
    hasher = _KEY_HASH.copy()
    hasher.update(req_id.encode("utf-8", "surrogatepass"))
    return int.from_bytes(hasher.digest(), "little")


def table_terms(key: int, start: int, block_ids: list[int] | np.ndarray) -> int:
    """Sum of the terms of ``block_ids`` (a list, or an integer array) at positions
    ``start, start + 1, ...``."""
    if not isinstance(block_ids, list):
        return int(kernels.table_terms(np.uint64(key), start, block_ids))
    if len(block_ids) == 1:  # a decode step's growth
        return mix((key + ((start << 32) | block_ids[0]) * GOLDEN) & MASK)
    if len(block_ids) <= _LOOP_LIMIT:
        total = 0
        for offset, b in enumerate(block_ids):
            total += mix((key + (((start + offset) << 32) | b) * GOLDEN) & MASK)
        return total & MASK
    ids = np.fromiter(block_ids, np.int64, len(block_ids))
    return int(kernels.table_terms(np.uint64(key), start, ids))


def table_sums(keys: list[int], starts: list[int], tails: list[list[int]]) -> list[int]:
    """``table_terms(keys[i], starts[i], tails[i])`` for every i (each tail non-empty), in
    one numpy pass."""
    if not tails:
        return []
    if len(tails) == 1:
        return [table_terms(keys[0], starts[0], tails[0])]
    counts = np.fromiter(map(len, tails), np.int64, len(tails))
    offsets = np.zeros(len(tails), dtype=np.int64)
    np.cumsum(counts[:-1], out=offsets[1:])
    flat = np.array(list(itertools.chain.from_iterable(tails)), dtype=np.uint64)
    positions = np.arange(flat.size, dtype=np.int64) - np.repeat(offsets, counts)
    positions += np.repeat(np.asarray(starts, dtype=np.int64), counts)
    entry_keys = np.repeat(np.asarray(keys, dtype=np.uint64), counts)
    items = (positions.astype(np.uint64) << np.uint64(32)) | flat
    terms = _mix_array(entry_keys + items * np.uint64(GOLDEN))
    return [int(x) for x in np.add.reduceat(terms, offsets, dtype=np.uint64)]


def fwd_terms(logical: np.ndarray | list[int], physical: np.ndarray | list[int]) -> int:
    """Sum of the mapping terms of ``fwd[logical[i]] == physical[i]`` (0 where equal)."""
    if isinstance(logical, list) and len(logical) <= 16:
        total = 0
        for low, high in zip(logical, physical, strict=True):
            if low != high:
                total += mix((FWD_KEY + ((low << 32) | high) * GOLDEN) & MASK)
        return total & MASK
    low_ids = np.asarray(logical, dtype=np.uint64)
    high_ids = np.asarray(physical, dtype=np.uint64)
    moved = low_ids != high_ids
    items = (low_ids[moved] << np.uint64(32)) | high_ids[moved]
    return _sum(_mix_array(np.uint64(FWD_KEY) + items * np.uint64(GOLDEN)))


def job_term(job: Job) -> int:
    """A job's term: blake2b of its id, kind, GPU, CPU and sub-block ids."""
    assert job.pairs is not None, "every job keeps its pairs"
    subs = job.pairs[1] if job.kind == "store" else job.pairs[0]
    body = msgspec.msgpack.encode(
        [
            job.job_id,
            job.kind,
            job.gpu_block_ids.tolist(),
            job.cpu_block_ids.tolist(),
            subs.tolist(),
        ]
    )
    return int.from_bytes(hashlib.blake2b(body, digest_size=8).digest(), "little")


def submitted_term(job_id: int) -> int:
    """The term a job adds once its plan is submitted."""
    return mix((_SUBMITTED_KEY + job_id * GOLDEN) & MASK)


class RunningDigest:
    """The three sums of one State, always up to date. The primitives of ``State`` report
    each change as it happens and it is hashed then, at a cost proportional to the change
    (a block appended to a table: one mix; a defrag move: its pairs, summed by
    ``kernels.move``; a job: one blake2b), never to the pool or to the time since the last
    checkpoint.

    Per live request it keeps a row: the request's id is interned to a dense slot
    (``slots``), whose key and table sum sit in two uint64 arrays (``keys`` / ``sums``,
    views of ``array.array`` buffers, grown by doubling) and whose table in the row of the
    same number of ``arena`` (``arena.py``). A scheduler step then reaches a request's table and
    sums with one dict lookup, and the compiled step kernel updates the sums in place."""

    __slots__ = (
        "arena",
        "free_slots",
        "fwd",
        "jobs",
        "keys",
        "keys_buffer",
        "num_rows",
        "scratch",
        "slots",
        "sums",
        "sums_buffer",
        "tables",
    )

    def __init__(self) -> None:
        self.fwd = 0
        self.tables = 0
        self.jobs = 0
        self.slots: dict[str, int] = {}
        """Live request -> its slot (rows of ``keys``, ``sums`` and ``arena``)."""
        self.free_slots: list[int] = []
        self.num_rows = 0
        """Rows ever used (live or free)."""
        self.arena = TableArena(_FIRST_ROWS)
        """Per slot: its request's table (``arena.py``)."""
        self.keys_buffer, self.keys = uint64_buffer(_FIRST_ROWS)
        self.sums_buffer, self.sums = uint64_buffer(_FIRST_ROWS)
        self.scratch = np.zeros(SCRATCH_WORDS, dtype=np.uint64)
        """``keys_into``'s working words."""

    @property
    def per_request(self) -> dict[str, list[int]]:
        """Per live request: ``[key, sum of its table's terms]`` (built on demand)."""
        keys, sums = self.keys_buffer, self.sums_buffer
        return {req_id: [keys[slot], sums[slot]] for req_id, slot in self.slots.items()}

    # -- rows ----------------------------------------------------------------------------
    def add_request(self, req_id: str) -> int:
        """A row for a request without one, its table empty; its slot."""
        if self.free_slots:
            slot = self.free_slots.pop()
        else:
            slot = self.num_rows
            if slot == len(self.keys_buffer):
                self._grow()
            self.num_rows = slot + 1
        self.keys_buffer[slot] = request_key(req_id)
        self.sums_buffer[slot] = 0
        self.slots[req_id] = slot
        return slot

    def add_requests(self, req_ids: list[str]) -> None:
        """``add_request`` for each of ``req_ids`` (distinct, none with a row), in order:
        the same slots, keys and order of ``slots``; the keys hashed in one compiled pass
        from ``_BULK_KEYS`` requests on, else by ``request_key`` each."""
        count = len(req_ids)
        free = self.free_slots
        reused = min(count, len(free))
        rows = free[len(free) - reused :][::-1]  # as pop() takes them, last first
        del free[len(free) - reused :]
        fresh = count - reused
        if fresh:
            while self.num_rows + fresh > len(self.keys_buffer):
                self._grow()
            rows += range(self.num_rows, self.num_rows + fresh)
            self.num_rows += fresh
        if count >= _BULK_KEYS:  # one compiled pass (``request_keys.py``)
            keys_into(req_ids, rows, self.keys, self.sums, self.scratch)
        else:
            keys, sums = self.keys_buffer, self.sums_buffer
            for slot, req_id in zip(rows, req_ids, strict=True):
                keys[slot] = request_key(req_id)
                sums[slot] = 0
        self.slots.update(zip(req_ids, rows, strict=True))

    def _grow(self) -> None:
        """Twice the rows (the old arrays are left to their holders: copied, not resized)."""
        size = 2 * len(self.keys_buffer)
        for name in ("keys", "sums"):
            buffer, view = uint64_buffer(size)
            view[: size // 2] = getattr(self, name)
            setattr(self, name + "_buffer", buffer)
            setattr(self, name, view)
        self.arena.grow_rows(size)

    def release_slots(self, slots: list[int]) -> None:
        """Rows whose requests left ``slots`` (and their sums and arena regions) already:
        free to reuse."""
        self.free_slots += slots

    # -- changes (called by State's primitives) ------------------------------------------
    def table_extended(self, slot: int, start: int, block_ids: list[int] | np.ndarray) -> None:
        """``block_ids`` were appended to the table of ``slot`` at position ``start``:
        hashed now, O(len)."""
        delta = table_terms(self.keys_buffer[slot], start, block_ids)
        self.sums_buffer[slot] = (self.sums_buffer[slot] + delta) & MASK
        self.tables = (self.tables + delta) & MASK

    def tables_changed(self, delta: int) -> None:
        """``State.commit_step``'s kernel changed rows' sums: the tables' sum by ``delta``."""
        self.tables = (self.tables + delta) & MASK

    def table_removed(self, req_id: str) -> None:
        slot = self.slots.pop(req_id, None)
        if slot is not None:
            self.tables = (self.tables - self.sums_buffer[slot]) & MASK
            self.arena.close(slot)
            self.release_slots([slot])

    def mapping_moved(self, delta: int) -> None:
        """The mapping sum changed by ``delta`` (the defrag move computes it as it moves)."""
        self.fwd = (self.fwd + delta) & MASK

    def job_added(self, job: Job) -> None:
        job.term = job_term(job)
        delta = job.term + (submitted_term(job.job_id) if job.submitted else 0)
        self.jobs = (self.jobs + delta) & MASK

    def job_submitted(self, job_id: int) -> None:
        self.jobs = (self.jobs + submitted_term(job_id)) & MASK

    def job_removed(self, job: Job) -> None:
        delta = job.term + (submitted_term(job.job_id) if job.submitted else 0)
        self.jobs = (self.jobs - delta) & MASK

    # -- from scratch --------------------------------------------------------------------
    def reseat(self, fwd: int, tables: int, jobs: int, per_request: dict[str, int]) -> None:
        """All sums from sums computed from scratch (``checkpoint.reseat``): the totals,
        and per live request its table's sum (its row and table stay)."""
        self.fwd, self.tables, self.jobs = fwd, tables, jobs
        slots, sums = self.slots, self.sums_buffer
        for req_id, total in per_request.items():
            sums[slots[req_id]] = total


class Tables(Mapping[str, list[int]]):
    """The live requests' tables as a read-only mapping: request -> its logical ids, a new
    list at each lookup (the ids live in the running digest's arena, ``arena.py``), in the
    order the requests got their tables."""

    __slots__ = ("_digest",)

    def __init__(self, digest: RunningDigest) -> None:
        self._digest = digest

    def __getitem__(self, req_id: str) -> list[int]:
        digest = self._digest
        return digest.arena.table(digest.slots[req_id])

    def get(self, req_id: str, default: Any = None) -> Any:
        digest = self._digest
        slot = digest.slots.get(req_id)
        return default if slot is None else digest.arena.table(slot)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._digest.slots

    def __iter__(self) -> Iterator[str]:
        return iter(self._digest.slots)

    def __len__(self) -> int:
        return len(self._digest.slots)

    def __repr__(self) -> str:
        return f"Tables({dict(self.items())!r})"

"""The reducers' per-block loops, compiled: the seed rule's pairing walk, the move, and the
reference counting of allocations and releases.

These loops are most of a step's cost in Python (a defrag step at 32k blocks moves about 55
blocks spread over a few dozen bitmap words; a request arrives or finishes with tens of
blocks), so they are written once, in the subset of Python that numba compiles, and run
compiled (``numba.njit``, cached on disk: ``load`` compiles them, or reads the cache, once
per process). With ``NUMBA_DISABLE_JIT=1`` the same source runs as plain Python: slow, the
same decisions (numpy then warns of the uint64 wraparound the digest sums rely on).

They work on the :class:`~kvlog.reducers.state.State` arrays in place (numpy views of the
``array.array`` buffers): the ``used`` bitmap (``words``) with its ``nonempty`` / ``notfull``
summaries (bit ``i`` of summary word ``j``: word ``64 * j + i`` has a set / a clear bit),
the ``pinned`` bitmap, and ``refs`` / ``fwd`` / ``bwd``. Pure: no I/O, no clock, no
randomness; results go to caller-owned, preallocated output arrays. The move also returns
what it changed in the running digest's mapping sum (``running.py``: the same splitmix64
terms, in wrapping uint64 arithmetic), so a checkpoint has nothing left to hash for it.

A whole scheduler step (``StepScheduled``) is two calls: ``step_allocation`` checks all of
its blocks, ``step_commit`` does its reference counting, its running-digest rows, and the
seed rule's walk and move, so that a numba call's fixed cost (about a microsecond with
this many arrays) is paid twice a step, not once per loop.

The defrag rule (``defrag.py``): sources are the used, unpinned blocks from ``max_used`` down,
destinations the free, unpinned blocks from 1 up; pair source ``i`` with destination ``i``
while the destination is below the source, for at most ``limit`` pairs. Cost: O(pairs +
words the cursors pass); the summaries skip empty (sources) or full (destinations) runs of
4096 blocks.
"""

from __future__ import annotations

from typing import Any, cast

import numba
import numpy as np
from numba.cpython.unsafe import numbers as numba_numbers

from kvlog.events.int_lists import int_lists
from kvlog.reducers.request_keys import SCRATCH_WORDS, keys_into
from kvlog.util.jit import inline, jit
from kvlog.util.splitmix import GOLDEN, M1, M2

__all__ = [
    "FWD_KEY",
    "GOLDEN",
    "M1",
    "M2",
    "MIN_CAPACITY",
    "add_refs",
    "allocation",
    "drop_refs",
    "grown_capacity",
    "load",
    "move",
    "pack_rows",
    "pin",
    "resolve_into",
    "seed_walk",
    "step_allocation",
    "step_allocation_after",
    "step_commit",
    "table_terms",
    "unpin",
]

FWD_KEY = 0x243F6A8885A308D3
"""The mapping terms' key; with splitmix64's constants (:mod:`kvlog.util.splitmix`) the running
digest's arithmetic (``running.py``), which the kernels below compute in wrapping uint64."""

MIN_CAPACITY = 4
"""The smallest region a table gets in the tables' arena (``arena.py``): a decode step's
one-block growth then moves its table rarely."""
_MIN_CAPACITY = MIN_CAPACITY


def grown_capacity(capacity: int, length: int) -> int:
    """The region a table of ``length`` ids moves to when its ``capacity`` is too small:
    twice as large, and half as much again as it holds (a new table's first growth, a
    decode step's one block, then fits), at least ``MIN_CAPACITY``."""
    return max(2 * capacity, length + length // 2, _MIN_CAPACITY)


_ALL = np.uint64(0xFFFF_FFFF_FFFF_FFFF)
_ONE = np.uint64(1)
_ZERO = np.uint64(0)
_FWD_KEY, _GOLDEN = np.uint64(FWD_KEY), np.uint64(GOLDEN)
_M1, _M2 = np.uint64(M1), np.uint64(M2)
_DE_BRUIJN = np.uint64(0x03F79D71B4CB0A89)
_DE_BRUIJN_INDEX = np.zeros(64, dtype=np.int64)
for _bit in range(64):
    _DE_BRUIJN_INDEX[((1 << _bit) * 0x03F79D71B4CB0A89 & (2**64 - 1)) >> 58] = _bit


def _mix(x: Any) -> Any:
    """splitmix64's finalizer (``running.mix``) on a uint64."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def _fwd_term(logical: int, physical: int) -> Any:
    """``running.fwd_terms`` of one mapping entry ``fwd[logical] == physical``."""
    if logical == physical:
        return _ZERO
    return _mix(_FWD_KEY + ((np.uint64(logical) << np.uint64(32)) | np.uint64(physical)) * _GOLDEN)


def _table_terms(key: Any, start: int, block_ids: Any) -> Any:
    """``running.table_terms``: the sum of the terms of ``block_ids`` at positions
    ``start, start + 1, ...`` of the table of the request keyed ``key`` (a uint64)."""
    total = _ZERO
    base = key
    for i in range(len(block_ids)):
        item = (np.uint64(start + i) << np.uint64(32)) | np.uint64(block_ids[i])
        total += _mix(base + item * _GOLDEN)
    return total


def _add_member(words: Any, nonempty: Any, notfull: Any, block_id: int) -> None:
    """Set a clear bit of the ``used`` bitmap, summaries included."""
    w = block_id >> 6
    if words[w] == _ZERO:
        nonempty[w >> 6] |= _ONE << np.uint64(w & 63)
    words[w] |= _ONE << np.uint64(block_id & 63)
    if words[w] == _ALL:
        notfull[w >> 6] &= ~(_ONE << np.uint64(w & 63))


def _remove_member(words: Any, nonempty: Any, notfull: Any, block_id: int) -> None:
    """Clear a set bit of the ``used`` bitmap, summaries included."""
    w = block_id >> 6
    if words[w] == _ALL:
        notfull[w >> 6] |= _ONE << np.uint64(w & 63)
    words[w] &= ~(_ONE << np.uint64(block_id & 63))
    if words[w] == _ZERO:
        nonempty[w >> 6] &= ~(_ONE << np.uint64(w & 63))


def _lowest_bit_portable(x: Any) -> int:
    """Index of the lowest set bit of a non-zero uint64 (a de Bruijn multiply)."""
    return int(_DE_BRUIJN_INDEX[((x & (~x + _ONE)) * _DE_BRUIJN) >> np.uint64(58)])


def _highest_bit_portable(x: Any) -> int:
    """Index of the highest set bit of a non-zero uint64."""
    x |= x >> np.uint64(1)
    x |= x >> np.uint64(2)
    x |= x >> np.uint64(4)
    x |= x >> np.uint64(8)
    x |= x >> np.uint64(16)
    x |= x >> np.uint64(32)
    return _lowest_bit_portable(x ^ (x >> np.uint64(1)))


_trailing_zeros: Any = numba_numbers.trailing_zeros
_leading_zeros: Any = numba_numbers.leading_zeros


def _lowest_bit_compiled(x: Any) -> int:
    """``_lowest_bit_portable`` as the CPU's count of trailing zeros (LLVM's ``cttz``)."""
    return int(_trailing_zeros(x))


def _highest_bit_compiled(x: Any) -> int:
    """``_highest_bit_portable`` as 63 less the CPU's count of leading zeros (``ctlz``)."""
    return 63 - int(_leading_zeros(x))


if cast(Any, numba.config).DISABLE_JIT:  # plain Python: numba's intrinsics cannot run uncompiled
    _lowest_bit, _highest_bit = _lowest_bit_portable, _highest_bit_portable
else:
    _lowest_bit, _highest_bit = _lowest_bit_compiled, _highest_bit_compiled


def _refresh_summaries(words: Any, nonempty: Any, notfull: Any, w: int) -> None:
    """Word ``w``'s bits of the ``nonempty`` / ``notfull`` summaries, from its value now."""
    bit = _ONE << np.uint64(w & 63)
    if words[w] == _ZERO:
        nonempty[w >> 6] &= ~bit
    else:
        nonempty[w >> 6] |= bit
    if words[w] == _ALL:
        notfull[w >> 6] &= ~bit
    else:
        notfull[w >> 6] |= bit


def _prev_word(words: Any, pinned: Any, nonempty: Any, w: int) -> int:
    """The highest word ``<= w`` holding a used, unpinned block, or -1."""
    while w >= 0:
        s = w >> 6
        if nonempty[s] << np.uint64(63 - (w & 63)) == _ZERO:
            w = (s << 6) - 1  # no used block in this summary word at or below w
            continue
        if words[w] & ~pinned[w]:
            return w
        w -= 1
    return -1


def _next_word(words: Any, pinned: Any, notfull: Any, w: int, last: int) -> int:
    """The lowest word in ``[w, last]`` holding a free, unpinned block, or -1."""
    while w <= last:
        s = w >> 6
        if notfull[s] >> np.uint64(w & 63) == _ZERO:
            w = (s + 1) << 6  # every word from w to the end of this summary word is full
            continue
        if ~(words[w] | pinned[w]):
            return w
        w += 1
    return -1


def _next_pair(
    words: Any,
    nonempty: Any,
    notfull: Any,
    pinned: Any,
    sw: int,
    source_bits: Any,
    dw: int,
    free_bits: Any,
) -> Any:
    """One step of the seed rule's walk: from the source cursor (word ``sw``, its
    ``source_bits`` not yet taken) and the destination cursor (word ``dw``, its
    ``free_bits``), the next pair, highest source with lowest destination. Returns
    (found, the cursors after it: ``sw``, ``source_bits``, ``dw``, ``free_bits``, source,
    destination); not found: no source or destination is left, or the destination would
    lie above the source. Reads the bitmaps only, and only words at or below ``sw`` and
    at or above ``dw``: never a word a cursor has left."""
    if source_bits == _ZERO:
        sw = _prev_word(words, pinned, nonempty, sw - 1)
        if sw < 0:
            return False, sw, source_bits, dw, free_bits, -1, -1
        source_bits = words[sw] & ~pinned[sw]
    if free_bits == _ZERO:
        dw = _next_word(words, pinned, notfull, dw + 1, sw)
        if dw < 0:
            return False, sw, source_bits, dw, free_bits, -1, -1
        free_bits = ~(words[dw] | pinned[dw])
    top, low = _highest_bit(source_bits), _lowest_bit(free_bits)
    source, destination = (sw << 6) | top, (dw << 6) | low
    if destination > source:
        return False, sw, source_bits, dw, free_bits, -1, -1
    source_bits ^= _ONE << np.uint64(top)
    free_bits &= free_bits - _ONE  # the lowest bit, ``low``, taken
    return True, sw, source_bits, dw, free_bits, source, destination


def _seed_walk(
    words: Any,
    nonempty: Any,
    notfull: Any,
    pinned: Any,
    max_used: int,
    limit: int,
    sources: Any,
    destinations: Any,
) -> int:
    """Write the seed rule's pairs into ``sources`` / ``destinations`` (descending /
    ascending, at most ``limit``); their number. Reads the bitmaps only."""
    count = 0
    sw, source_bits = (max_used >> 6) + 1, _ZERO
    dw, free_bits = 0, ~(words[0] | pinned[0] | _ONE)  # block 0 is never a destination
    while count < limit:
        found, sw, source_bits, dw, free_bits, source, destination = _next_pair(
            words, nonempty, notfull, pinned, sw, source_bits, dw, free_bits
        )
        source_bits, free_bits = (
            np.uint64(source_bits),
            np.uint64(free_bits),
        )  # (Python ints, run uncompiled)
        if not found:
            break
        sources[count], destinations[count] = source, destination
        count += 1
    return count


def _move_pair(refs: Any, fwd: Any, bwd: Any, s: int, d: int) -> Any:
    """Source ``s`` hands its refs and logical id to the free destination ``d``, which hands
    its logical id back (refs and both mappings; the bitmap is the caller's); the change
    of the mapping sum (uint64, wrapping)."""
    logical_source, logical_destination = bwd[s], bwd[d]
    # uint64 on both sides: run as Python, a compiled helper returns a Python int,
    # whose difference numpy 1.x would not wrap (NUMBA_DISABLE_JIT, the tests)
    delta = np.uint64(_fwd_term(logical_source, d)) - np.uint64(_fwd_term(logical_source, s))
    delta += np.uint64(_fwd_term(logical_destination, s)) - np.uint64(
        _fwd_term(logical_destination, d)
    )
    refs[d], refs[s] = refs[s], 0
    fwd[logical_source], fwd[logical_destination] = d, s
    bwd[d], bwd[s] = logical_source, logical_destination
    return delta


def _move(
    words: Any,
    nonempty: Any,
    notfull: Any,
    refs: Any,
    fwd: Any,
    bwd: Any,
    sources: Any,
    destinations: Any,
    max_used: int,
) -> Any:
    """Each source hands its refs and logical id to its (free) destination, which hands its
    logical id back: ref counts, both mappings and the used bitmap with its summaries
    follow. Returns the change of the running digest's mapping sum (uint64, wrapping) and
    the highest used block after the move (at most ``max_used``, the highest before).
    A word's summary bits are refreshed once its side's run of pairs leaves it (the seed
    rule's sources descend and its destinations ascend, so dozens of pairs share each),
    and both last words at the end: every word changed is refreshed after its change, in
    any order of pairs."""
    delta = _ZERO
    source_word, destination_word = -1, -1
    for i in range(len(sources)):
        s, d = sources[i], destinations[i]
        delta += np.uint64(_move_pair(refs, fwd, bwd, s, d))  # (a Python int, run uncompiled)
        if s >> 6 != source_word:
            if source_word >= 0:
                _refresh_summaries(words, nonempty, notfull, source_word)
            source_word = s >> 6
        if d >> 6 != destination_word:
            if destination_word >= 0:
                _refresh_summaries(words, nonempty, notfull, destination_word)
            destination_word = d >> 6
        words[s >> 6] &= ~(_ONE << np.uint64(s & 63))
        words[d >> 6] |= _ONE << np.uint64(d & 63)
    if source_word >= 0:
        _refresh_summaries(words, nonempty, notfull, source_word)
        _refresh_summaries(words, nonempty, notfull, destination_word)
    return delta, _highest_member(words, nonempty, max_used)


def _walk_and_move(
    words: Any,
    nonempty: Any,
    notfull: Any,
    pinned: Any,
    refs: Any,
    fwd: Any,
    bwd: Any,
    max_used: int,
    limit: int,
    sources: Any,
    destinations: Any,
) -> Any:
    """``_seed_walk`` then ``_move`` of its pairs, in one pass: each pair is moved as the
    walk finds it (refs, both mappings, the mapping sum's change), and the bits a cursor
    took from a word are applied to the ``used`` bitmap, summaries and all, once it has
    left that word (and at the end). The walk reads the bitmap as it was: ``_next_pair``
    never reads a word a cursor has left. Returns (pairs, the change of the mapping sum,
    the highest used block), the pairs written to ``sources`` / ``destinations`` as
    ``_seed_walk`` writes them."""
    count, delta = 0, _ZERO
    sw, source_bits, moved_out = (max_used >> 6) + 1, _ZERO, _ZERO
    dw, free_bits, moved_in = 0, ~(words[0] | pinned[0] | _ONE), _ZERO  # block 0: never
    while count < limit:
        found, next_sw, source_bits, next_dw, free_bits, s, d = _next_pair(
            words, nonempty, notfull, pinned, sw, source_bits, dw, free_bits
        )
        source_bits, free_bits = (
            np.uint64(source_bits),
            np.uint64(free_bits),
        )  # (Python ints, run uncompiled)
        if next_sw != sw and moved_out != _ZERO:  # the source cursor left word sw
            _apply_bits(words, nonempty, notfull, sw, moved_out, False)
            moved_out = _ZERO
        if next_dw != dw and moved_in != _ZERO:  # the destination cursor left word dw
            _apply_bits(words, nonempty, notfull, dw, moved_in, True)
            moved_in = _ZERO
        sw, dw = next_sw, next_dw
        if not found:
            break
        sources[count], destinations[count] = s, d
        count += 1
        moved_out |= _ONE << np.uint64(s & 63)
        moved_in |= _ONE << np.uint64(d & 63)
        delta += np.uint64(_move_pair(refs, fwd, bwd, s, d))  # (a Python int, run uncompiled)
    if moved_out != _ZERO:
        _apply_bits(words, nonempty, notfull, sw, moved_out, False)
    if moved_in != _ZERO:
        _apply_bits(words, nonempty, notfull, dw, moved_in, True)
    if count:
        max_used = _highest_member(words, nonempty, max_used)
    return count, delta, max_used


def _apply_bits(words: Any, nonempty: Any, notfull: Any, w: int, bits: Any, add: bool) -> None:
    """Word ``w`` of the used bitmap gains (``add``) or loses ``bits``; its summary bits
    follow."""
    if add:
        words[w] |= bits
    else:
        words[w] &= ~bits
    _refresh_summaries(words, nonempty, notfull, w)


def _highest_member(words: Any, nonempty: Any, limit: int) -> int:
    """The highest member of the bitmap at or below ``limit``, or -1."""
    if limit < 0:
        return -1
    w = limit >> 6
    bits = words[w] & (_ALL >> np.uint64(63 - (limit & 63)))
    while bits == _ZERO:
        w -= 1
        while w >= 0 and nonempty[w >> 6] << np.uint64(63 - (w & 63)) == _ZERO:
            w = ((w >> 6) << 6) - 1  # nothing at or below w in its summary word
        if w < 0:
            return -1
        bits = words[w]
    return (w << 6) | _highest_bit(bits)


def _add_refs(words: Any, nonempty: Any, notfull: Any, refs: Any, physical: Any) -> Any:
    """One more reference to each of ``physical`` (distinct ids); a block that becomes used
    joins the bitmap. Returns (blocks that became used, the highest of them or -1)."""
    fresh, top = 0, -1
    for i in range(len(physical)):
        p = physical[i]
        refs[p] += 1
        if refs[p] == 1:
            _add_member(words, nonempty, notfull, p)
            fresh += 1
            top = max(top, p)
    return fresh, top


def _drop_refs(
    words: Any, nonempty: Any, notfull: Any, refs: Any, fwd: Any, logical: Any, freed: Any
) -> int:
    """One reference fewer to the physical block of each of ``logical`` (a repeated id
    drops one each); a block that becomes free leaves the bitmap and is written to
    ``freed``. Returns how many."""
    count = 0
    for i in range(len(logical)):
        p = fwd[logical[i]]
        refs[p] -= 1
        if refs[p] == 0:
            _remove_member(words, nonempty, notfull, p)
            freed[count] = p
            count += 1
    return count


def _pin(pins: Any, pinned: Any, physical: Any) -> None:
    """One more pin on each of ``physical`` (distinct ids) in ``pins`` (one direction's
    counts); each joins the ``pinned`` bitmap."""
    for i in range(len(physical)):
        p = physical[i]
        pins[p] += 1
        pinned[p >> 6] |= np.uint64(1) << np.uint64(p & 63)


def _unpin(pins: Any, others: Any, pinned: Any, physical: Any) -> None:
    """One pin fewer on each of ``physical`` (distinct ids) in ``pins``; a block neither
    direction pins any more leaves the ``pinned`` bitmap (the caller sets the bits of
    quarantined blocks again)."""
    for i in range(len(physical)):
        p = physical[i]
        pins[p] -= 1
        if pins[p] == 0 and others[p] == 0:
            pinned[p >> 6] &= ~(np.uint64(1) << np.uint64(p & 63))


def _resolve_into(fwd: Any, block_ids: Any, out: Any) -> None:
    """A 2-D table of logical ids resolved into ``out`` (same shape): ``fwd[b]`` for an id
    in the pool, the id itself for any other (a pad, -1), as ``State.resolve`` does."""
    size = len(fwd)
    for i in range(block_ids.shape[0]):
        for j in range(block_ids.shape[1]):
            b = block_ids[i, j]
            out[i, j] = fwd[b] if 0 <= b < size else b


def _allocation(
    fwd: Any, refs: Any, store_pins: Any, load_pins: Any, logical: Any, shared: bool, physical: Any
) -> int:
    """Resolve an allocation's logical ids into ``physical``; 0: every block is free and
    unpinned, 1: accepted but not all free (shared under prefix caching, or read by an
    unfinished store), 2: refused (an unfinished load writes one, or, without prefix
    caching, one is in use)."""
    status = 0
    for i in range(len(logical)):
        p = fwd[logical[i]]
        physical[i] = p
        if load_pins[p] or (refs[p] and not shared):
            return 2
        if refs[p] or store_pins[p]:
            status = 1
    return status


def _step_allocation(
    fwd: Any, refs: Any, store_pins: Any, load_pins: Any, logical: Any, physical: Any
) -> int:
    """A whole step's allocations at once: resolve ``logical`` into ``physical``. Returns 0
    when every block is in range, free, unpinned and given once (then the step takes them
    all as they are), 2 when an id is negative or not below the pool size (nothing
    resolved), else 1 (the caller checks block by block; ``physical`` is then partly
    written). A repeat is found by marking each free block's ref count as it is taken
    (the count just read: no other memory touched) and clearing the marks before
    returning, so ``refs`` is as it was: no sort, no scratch, nothing allocated."""
    n = len(logical)
    size = len(fwd)
    for i in range(n):
        if logical[i] < 0 or logical[i] >= size:
            return 2
    status, marked = 0, 0
    for i in range(n):
        p = fwd[logical[i]]
        physical[i] = p
        if refs[p] or store_pins[p] or load_pins[p]:  # busy, or a repeat: marked below
            status = 1
            break
        refs[p] = 1
        marked += 1
    for i in range(marked):
        refs[physical[i]] = 0
    return status


_MARK = 1 << 30
"""Added to a block's reference count while one allocation of a step takes it
(``_step_allocation_after``): a second sight within the same allocation is a repeat."""


def _step_allocation_after(
    fwd: Any,
    refs: Any,
    store_pins: Any,
    load_pins: Any,
    logical: Any,
    physical: Any,
    arena: Any,
    starts: Any,
    lengths: Any,
    rows: Any,
    counts: Any,
    shared: bool,
    flush_at: Any,
) -> Any:
    """``step_allocation`` for a step it did not settle, taken as the step's events take
    it: the tables of ``rows`` (the released requests' rows of the tables' arena) drop
    their references first, then the allocations (``counts`` ids each, in order) take
    ``logical`` (all in range: ``step_allocation`` looked) one reference a block. Returns
    (status, flushes): status 0 when the step can commit in bulk (``State.commit_step``):
    no block an unfinished load writes, none given twice to one allocation, and, unless
    ``shared`` (prefix caching), none with a reference left; else 1 (the caller checks
    allocation by allocation). A block with no reference left that an unfinished store
    reads is taken all the same, its index in ``logical`` written to ``flush_at``
    (``flushes`` of them, ascending): its allocation flushes those stores first. ``refs``
    is as it was on return (the drops and takes are counted in place and given back)."""
    for r in range(len(rows)):
        start = starts[rows[r]]
        for j in range(lengths[rows[r]]):
            refs[fwd[arena[start + j]]] -= 1
    status, done, flushes = 0, 0, 0
    for k in range(len(counts)):
        first, stop = done, done + counts[k]
        while done < stop:
            p = fwd[logical[done]]
            physical[done] = p
            held = refs[p]
            if held >= _MARK or load_pins[p] or (held and not shared):
                status = 1
                break
            if not held and store_pins[p]:
                flush_at[flushes] = done
                flushes += 1
            refs[p] = held + 1 + _MARK
            done += 1
        for j in range(first, done):
            refs[physical[j]] -= _MARK
        if status:
            break
    for j in range(done):
        refs[physical[j]] -= 1
    for r in range(len(rows)):
        start = starts[rows[r]]
        for j in range(lengths[rows[r]]):
            refs[fwd[arena[start + j]]] += 1
    return status, flushes


def _arena_need(rows: Any, num_released: int, starts: Any, lengths: Any, capacities: Any) -> int:
    """Ids of new regions the step's allocations take in the tables' arena (``arena.py``):
    a table that outgrows its region moves to one of twice its capacity (at least its new
    length and ``MIN_CAPACITY``)."""
    k = (len(rows) - num_released) // 2
    need = 0
    for i in range(k):
        slot, count = rows[num_released + i], rows[num_released + k + i]
        if lengths[slot] + count > capacities[slot]:
            need += _grown(capacities[slot], lengths[slot] + count)
    return need


def _release_rows(
    words: Any,
    nonempty: Any,
    notfull: Any,
    refs: Any,
    fwd: Any,
    arena: Any,
    starts: Any,
    lengths: Any,
    capacities: Any,
    rows: Any,
    num_released: int,
    sums: Any,
    freed: Any,
) -> Any:
    """The released rows' tables drop one reference per id (the freed blocks go to
    ``freed``), their sums leave the total and their regions turn to garbage. Returns
    (blocks freed, ids of garbage, the change of the tables' sum)."""
    count, garbage, change = 0, 0, _ZERO
    for i in range(num_released):
        slot = rows[i]
        start = starts[slot]
        for j in range(lengths[slot]):
            p = fwd[arena[start + j]]
            refs[p] -= 1
            if refs[p] == 0:
                _remove_member(words, nonempty, notfull, p)
                freed[count] = p
                count += 1
        change -= sums[slot]
        garbage += capacities[slot]
        lengths[slot] = 0
        capacities[slot] = 0
    return count, garbage, change


def _append_rows(
    arena: Any,
    starts: Any,
    lengths: Any,
    capacities: Any,
    top: int,
    rows: Any,
    num_released: int,
    keys: Any,
    sums: Any,
    logical: Any,
) -> Any:
    """Each allocation's ids appended to its row's table (a row outgrowing its region
    moves to the top first: ``_arena_need`` made room), its terms added to ``sums[slot]``.
    Returns (the new top, ids of garbage, the change of the tables' sum)."""
    k = (len(rows) - num_released) // 2
    offset, garbage, change = 0, 0, _ZERO
    for i in range(k):
        slot, count = rows[num_released + i], rows[num_released + k + i]
        length = lengths[slot]
        if length + count > capacities[slot]:
            capacity = _grown(capacities[slot], length + count)
            old = starts[slot]
            for j in range(length):
                arena[top + j] = arena[old + j]
            garbage += capacities[slot]
            starts[slot], capacities[slot] = top, capacity
            top += capacity
        at = starts[slot] + length
        key, term = keys[slot], _ZERO
        for j in range(count):
            block = logical[offset + j]
            arena[at + j] = block
            item = (np.uint64(length + j) << np.uint64(32)) | np.uint64(block)
            term += _mix(key + item * _GOLDEN)
        lengths[slot] = length + count
        sums[slot] += term
        change += term
        offset += count
    return top, garbage, change


def _pack_rows(old: Any, new: Any, starts: Any, lengths: Any, capacities: Any) -> int:
    """The tables' arena packed (``arena.py``): every live row's region (capacity > 0), in
    row order, copied from ``old`` to the start of ``new``; its start follows. Returns
    the new top."""
    top = 0
    for row in range(len(capacities)):
        if capacities[row]:
            start = starts[row]
            for j in range(lengths[row]):
                new[top + j] = old[start + j]
            starts[row] = top
            top += capacities[row]
    return top


def _take_blocks(words: Any, nonempty: Any, notfull: Any, refs: Any, physical: Any) -> Any:
    """One more reference to each of ``physical`` (a block free before joins the bitmap);
    returns (blocks that became used, the highest of ``physical`` or -1)."""
    fresh, peak = 0, -1
    for i in range(len(physical)):
        p = physical[i]
        refs[p] += 1
        if refs[p] == 1:
            _add_member(words, nonempty, notfull, p)
            fresh += 1
        peak = max(peak, p)
    return fresh, peak


def _trigger_walk_move(
    words: Any,
    nonempty: Any,
    notfull: Any,
    pinned: Any,
    refs: Any,
    fwd: Any,
    bwd: Any,
    sources: Any,
    destinations: Any,
    max_used: int,
    num_used: int,
    threshold: int,
    max_swaps: int,
) -> Any:
    """The seed rule at a step's end (``max_swaps > 0``): its trigger, walk and move.
    Returns (pairs moved, the change of the mapping sum, the highest used block)."""
    num_pairs, delta = 0, _ZERO
    if max_swaps > 0 and max_used >= 0 and max_used - threshold > num_used:
        num_pairs, delta, max_used = _walk_and_move(
            words, nonempty, notfull, pinned, refs, fwd, bwd, max_used, max_swaps, sources,
            destinations,
        )  # fmt: skip
    return num_pairs, delta, max_used


def _pin_freed(pinned: Any, freed: Any, count: int) -> None:
    """Set the ``pinned`` bits of ``freed[:count]`` (a step's quarantine of what it freed)."""
    for i in range(count):
        p = freed[i]
        pinned[p >> 6] |= _ONE << np.uint64(p & 63)


def _max_after_releases(words: Any, nonempty: Any, max_used: int, num_freed: int) -> int:
    """The highest used block once releases freed ``num_freed`` blocks: ``max_used``, or
    the highest member below it where it was freed (-1: none)."""
    if (
        num_freed
        and max_used >= 0
        and not (words[max_used >> 6] >> np.uint64(max_used & 63)) & _ONE
    ):
        return _highest_member(words, nonempty, max_used)
    return max_used


def _step_commit(
    words: Any,
    nonempty: Any,
    notfull: Any,
    pinned: Any,
    refs: Any,
    fwd: Any,
    bwd: Any,
    arena: Any,
    starts: Any,
    lengths: Any,
    capacities: Any,
    top: int,
    physical: Any,
    logical: Any,
    rows: Any,
    num_released: int,
    keys: Any,
    sums: Any,
    freed: Any,
    sources: Any,
    destinations: Any,
    max_used: int,
    num_used: int,
    threshold: int,
    max_swaps: int,
    quarantine: bool,
) -> Any:
    """A whole checked step's bookkeeping and, when asked, its seed-rule defrag, in one call.

    ``rows``: the released requests' rows (the first ``num_released``), then per
    allocation its row, then their counts; tables are rows of the arena (``arena``,
    ``starts``, ``lengths``, ``capacities``, next region at ``top``: ``arena.py``), keys
    and sums rows of ``keys`` / ``sums``; ``logical`` / ``physical``: the allocations' ids
    concatenated (as the check found them: no block an unfinished load writes or given
    twice to one allocation, and, where it found no prefix caching's sharing, every one
    free and given once). If the new
    regions would pass the arena's end nothing changes and the ids needed come back (the
    caller makes room, calls again). Else the released tables drop a reference per id
    (freed blocks to ``freed``) and leave, each allocation joins its table and sum, each
    of ``physical`` gets a reference (``max_used``, ``num_used``: before the step). With
    ``max_swaps > 0`` the seed rule's trigger, walk and move follow (pairs to ``sources``
    / ``destinations``); with ``quarantine`` the blocks freed are pinned before the walk
    (``State.quarantine``; the caller lifts it after the move, which reads no pins).
    Returns (ids needed first or 0, the arena's new top, ids turned garbage, blocks freed,
    highest used block after the step, the change of the tables' sum, pairs moved, the
    change of the mapping sum, blocks that became used), sums as wrapping uint64."""
    need = _arena_need(rows, num_released, starts, lengths, capacities)
    if top + need > len(arena):
        return need, top, 0, 0, max_used, _ZERO, 0, _ZERO, 0
    num_freed, garbage, change = _release_rows(
        words, nonempty, notfull, refs, fwd, arena, starts, lengths, capacities, rows,
        num_released, sums, freed,
    )  # fmt: skip
    _pin_freed(pinned, freed, num_freed if quarantine else 0)
    top, moved, added = _append_rows(
        arena, starts, lengths, capacities, top, rows, num_released, keys, sums, logical
    )
    change += added
    fresh, peak = _take_blocks(words, nonempty, notfull, refs, physical)
    max_used = max(_max_after_releases(words, nonempty, max_used, num_freed), peak)
    num_used += fresh - num_freed
    num_pairs, delta, max_used = _trigger_walk_move(
        words, nonempty, notfull, pinned, refs, fwd, bwd, sources, destinations, max_used,
        num_used, threshold, max_swaps,
    )  # fmt: skip
    return 0, top, garbage + moved, num_freed, max_used, change, num_pairs, delta, fresh


_mix = inline(_mix)
_fwd_term = inline(_fwd_term)
table_terms = jit(_table_terms, allocates=False)
_table_terms = inline(_table_terms)
_add_member = inline(_add_member)
_remove_member = inline(_remove_member)
_lowest_bit = inline(_lowest_bit)
_highest_bit = inline(_highest_bit)
_refresh_summaries = inline(_refresh_summaries)
_apply_bits = inline(_apply_bits)
_highest_member = inline(_highest_member)
_prev_word = inline(_prev_word)
_next_word = inline(_next_word)
_next_pair = inline(_next_pair)
_grown = inline(grown_capacity)
_arena_need = inline(_arena_need)
_release_rows = inline(_release_rows)
_append_rows = inline(_append_rows)
_take_blocks = inline(_take_blocks)
_pin_freed = inline(_pin_freed)
_max_after_releases = inline(_max_after_releases)
seed_walk = jit(_seed_walk, allocates=False)
move = jit(_move, allocates=False)
_move_pair = inline(_move_pair)
_walk_and_move = inline(_walk_and_move)
_trigger_walk_move = inline(_trigger_walk_move)
add_refs = jit(_add_refs, allocates=False)
drop_refs = jit(_drop_refs, allocates=False)
pin = jit(_pin, allocates=False)
unpin = jit(_unpin, allocates=False)
allocation = jit(_allocation, allocates=False)
step_allocation = jit(_step_allocation, allocates=False)
step_allocation_after = jit(_step_allocation_after, allocates=False)
step_commit = jit(_step_commit, allocates=False)
pack_rows = jit(_pack_rows, allocates=False)
resolve_into = jit(_resolve_into, allocates=False)


_loaded = False


def load() -> None:
    """Compile the kernels (or load them from numba's on-disk cache) now, once per process:
    a configured State calls this, so that the first defrag step of a serving loop does not
    pay it (about 0.2 s from the cache, a few seconds without)."""
    global _loaded
    if _loaded:
        return
    words = np.zeros(1, dtype=np.uint64)
    ids = np.zeros(1, dtype=np.int64)
    blocks = np.zeros(1, dtype=np.int32)
    none = ids[:0]
    seed_walk(words, words, words, words, 0, 1, ids, ids)
    move(words, words, words, blocks, blocks, blocks, none, none, 0)
    add_refs(words, words, words, blocks, none)
    drop_refs(words, words, words, blocks, blocks, none, ids)
    pin(blocks, words, none)
    unpin(blocks, blocks, words, none)
    allocation(blocks, blocks, blocks, blocks, none, False, ids)
    step_allocation(blocks, blocks, blocks, blocks, none, ids)
    step_allocation_after(
        blocks, blocks, blocks, blocks, none, ids, blocks, ids, ids, ids, ids, True, ids
    )
    table_terms(np.uint64(GOLDEN), 0, none)
    table_terms(np.uint64(GOLDEN), 0, blocks[:0])  # a table's ids in the arena (int32)
    drop_refs(words, words, words, blocks, blocks, blocks[:0], ids)
    pack_rows(blocks, blocks, ids, ids, ids)
    table = np.zeros((1, 2), dtype=np.int32)
    resolve_into(blocks, table, table)  # a whole table (C order) and a runner's slice of one
    resolve_into(blocks, table[:, :1], table)
    step_commit(
        words, words, words, words, blocks, blocks, blocks, blocks, ids, ids, ids, 0, none,
        none, none, 0, words, words, ids, ids, ids, -1, 0, 0, 0, False,
    )  # fmt: skip
    int_lists([[0]], 1)  # a StepScheduled's ids read back (``kvlog.events.int_lists``)
    keys_into(["k"], [0], words, words, np.zeros(SCRATCH_WORDS, dtype=np.uint64))  # new rows
    _loaded = True

"""The defrag step's per-block loops, compiled: the seed rule's pairing walk and the move.

These two loops are most of a defrag step's cost in Python (a step at 32k blocks moves
about 55 blocks spread over a few dozen bitmap words), so they are written once, in the
subset of Python that numba compiles, and run compiled (``numba.njit``, cached on disk; the
first call in a process without a cache compiles, about a second). With
``NUMBA_DISABLE_JIT=1`` the same source runs as plain Python: slow, the same decisions.

Both work on the :class:`~kvlog.reducers.state.State` arrays in place (numpy views of the
``array.array`` buffers): the ``used`` bitmap (``words``) with its ``nonempty`` / ``notfull``
summaries (bit ``i`` of summary word ``j``: word ``64 * j + i`` has a set / a clear bit),
the ``pinned`` bitmap, and ``refs`` / ``fwd`` / ``bwd``. Pure: no I/O, no clock, no
randomness; results go to caller-owned, preallocated output arrays. The move also returns
what it changed in the running digest's mapping sum (``running.py``: the same splitmix64
terms, in wrapping uint64 arithmetic), so a checkpoint has nothing left to hash for it.

The rule (``defrag.py``): sources are the used, unpinned blocks from ``max_used`` down,
destinations the free, unpinned blocks from 1 up; pair source ``i`` with destination ``i``
while the destination is below the source, for at most ``limit`` pairs. Cost: O(pairs +
words the cursors pass); the summaries skip empty (sources) or full (destinations) runs of
4096 blocks.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

from kvlog.reducers import running

__all__ = ["move", "seed_walk"]

_ALL = np.uint64(0xFFFF_FFFF_FFFF_FFFF)
_ONE = np.uint64(1)
_ZERO = np.uint64(0)
_FWD_KEY, _GOLDEN = np.uint64(running.FWD_KEY), np.uint64(running.GOLDEN)
_M1, _M2 = np.uint64(running.M1), np.uint64(running.M2)


def _fwd_term(logical: int, physical: int) -> Any:
    """``running.fwd_terms`` of one mapping entry ``fwd[logical] == physical``."""
    if logical == physical:
        return _ZERO
    x = _FWD_KEY + ((np.uint64(logical) << np.uint64(32)) | np.uint64(physical)) * _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


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
        if source_bits == _ZERO:
            sw = _prev_word(words, pinned, nonempty, sw - 1)
            if sw < 0:
                break
            source_bits = words[sw] & ~pinned[sw]
        if free_bits == _ZERO:
            dw = _next_word(words, pinned, notfull, dw + 1, sw)
            if dw < 0:
                break
            free_bits = ~(words[dw] | pinned[dw])
        top = 63
        while source_bits >> np.uint64(top) == _ZERO:
            top -= 1
        low = 0
        while ((free_bits >> np.uint64(low)) & _ONE) == _ZERO:
            low += 1
        source, destination = (sw << 6) | top, (dw << 6) | low
        if destination > source:
            break
        sources[count], destinations[count] = source, destination
        count += 1
        source_bits ^= _ONE << np.uint64(top)
        free_bits ^= _ONE << np.uint64(low)
    return count


def _move(
    words: Any,
    nonempty: Any,
    notfull: Any,
    refs: Any,
    fwd: Any,
    bwd: Any,
    sources: Any,
    destinations: Any,
) -> Any:
    """Each source hands its refs and logical id to its (free) destination, which hands its
    logical id back: ref counts, both mappings and the used bitmap with its summaries
    follow. Returns the change of the running digest's mapping sum (uint64, wrapping)."""
    delta = _ZERO
    for i in range(len(sources)):
        s, d = sources[i], destinations[i]
        logical_source, logical_destination = bwd[s], bwd[d]
        delta += _fwd_term(logical_source, d) - _fwd_term(logical_source, s)
        delta += _fwd_term(logical_destination, s) - _fwd_term(logical_destination, d)
        refs[d], refs[s] = refs[s], 0
        fwd[logical_source], fwd[logical_destination] = d, s
        bwd[d], bwd[s] = logical_source, logical_destination
        w = s >> 6
        if words[w] == _ALL:
            notfull[w >> 6] |= _ONE << np.uint64(w & 63)
        words[w] &= ~(_ONE << np.uint64(s & 63))
        if words[w] == _ZERO:
            nonempty[w >> 6] &= ~(_ONE << np.uint64(w & 63))
        w = d >> 6
        if words[w] == _ZERO:
            nonempty[w >> 6] |= _ONE << np.uint64(w & 63)
        words[w] |= _ONE << np.uint64(d & 63)
        if words[w] == _ALL:
            notfull[w >> 6] &= ~(_ONE << np.uint64(w & 63))
    return delta


_jit = numba.njit(cache=True, nogil=True)
_fwd_term = _jit(_fwd_term)
_prev_word = _jit(_prev_word)
_next_word = _jit(_next_word)
seed_walk = _jit(_seed_walk)
move = _jit(_move)

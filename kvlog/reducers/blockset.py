"""Sets of block ids as two-level uint64 bitmaps (numpy views of ``array.array`` words).

A :class:`BlockSet` holds a subset of ``range(size)``: bit ``i`` of ``words[w]`` is block
``64 * w + i``. Two summary bitmaps over the words (``nonempty``: the word has a set bit;
``notfull``: the word has a clear bit) let scans skip 4096 blocks per summary bit, so finding
the highest member or the lowest non-member costs a few word operations, not a pass over the
cache. Each bitmap is a numpy array (``words``, ``nonempty``, ``notfull``) sharing memory
with an ``array.array`` (``word_buffer``, ``nonempty_buffer``, ``notfull_buffer``, see
``buffers.py``): per-id loops read and write Python ints through the buffers, compiled
loops (``kernels.py``: the State's reference counting) the numpy views. Updates touch the
changed ids only, O(len(ids)): a Python-int loop here up to ``SCALAR_LIMIT`` ids (one word
write per run of ids in the same word), a compiled loop in ``kernels.py`` beyond;
whole-word updates (``set_word_bits`` / ``clear_word_bits``) serve callers that have
grouped their ids already.

Bits at or above ``size`` in the last word are always clear: a scan for clear bits can yield
such ids, and callers bound their scans (defrag never pairs a destination above its source).
"""

from __future__ import annotations

from array import array

import numpy as np
import numpy.typing as npt

from kvlog.reducers.buffers import WordArray, uint64_buffer

__all__ = [
    "ALL_ONES",
    "BIT",
    "SCALAR_LIMIT",
    "BlockSet",
    "IdArray",
    "WordArray",
    "clear_bits",
    "pack_words",
    "set_bits",
    "summaries",
]

IdArray = npt.NDArray[np.int64]

ALL_ONES = np.uint64(0xFFFF_FFFF_FFFF_FFFF)
BIT: WordArray = np.left_shift(np.uint64(1), np.arange(64, dtype=np.uint64))
"""``BIT[i] == 1 << i`` as uint64, to build masks by fancy indexing."""
_CHUNK = 256
"""Summary words looked at per numpy call when a scan has to skip far."""
_NEAR = 32
"""Summary words a scan reads one by one (Python ints) before it switches to numpy."""
_MASK64 = (1 << 64) - 1
SCALAR_LIMIT = 16
"""Up to this many ids, updates loop over Python ints; beyond, one compiled loop
(``kernels.py``) is cheaper than the Python loop plus converting the ids to an array."""


def set_bits(words: WordArray, ids: IdArray) -> None:
    """Set the bits of ``ids`` in a plain bitmap (ids may share words); a few ids (a
    transfer job's pins) one by one, as ``ufunc.at``'s set-up costs more than they do."""
    if len(ids) <= SCALAR_LIMIT:
        for i in ids.tolist():
            words[i >> 6] |= BIT[i & 63]
        return
    np.bitwise_or.at(words, ids >> 6, BIT[ids & 63])


def clear_bits(words: WordArray, ids: IdArray) -> None:
    """Clear the bits of ``ids`` in a plain bitmap (ids may share words; a few one by one)."""
    if len(ids) <= SCALAR_LIMIT:
        for i in ids.tolist():
            words[i >> 6] &= ~BIT[i & 63]
        return
    np.bitwise_and.at(words, ids >> 6, ~BIT[ids & 63])


def _prev_set(summary: array[int], view: WordArray, index: int) -> int:
    """Largest ``i <= index`` whose bit is set in ``summary`` (bit ``i % 64`` of word
    ``i // 64``), or -1. ``view`` is the numpy view of ``summary``."""
    if index < 0:
        return -1
    s = index >> 6
    bits = summary[s] & ((2 << (index & 63)) - 1)
    near = s - _NEAR
    while not bits:
        if s == 0:
            return -1
        if s > near:
            s -= 1
            bits = summary[s]
            continue
        lo = max(0, s - _CHUNK)
        hits = np.flatnonzero(view[lo:s])
        s = lo + int(hits[-1]) if hits.size else lo
        bits = summary[s] if hits.size else 0
    return (s << 6) | (bits.bit_length() - 1)


def _next_set(summary: array[int], view: WordArray, index: int) -> int:
    """Smallest ``i >= index`` whose bit is set in ``summary``, or -1."""
    s = index >> 6
    size = len(summary)
    if s >= size:
        return -1
    bits = summary[s] >> (index & 63) << (index & 63)
    near = s + _NEAR
    while not bits:
        s += 1
        if s >= size:
            return -1
        if s < near:
            bits = summary[s]
            continue
        hits = np.flatnonzero(view[s : s + _CHUNK])
        if hits.size == 0:
            s += _CHUNK - 1
            continue
        s += int(hits[0])
        bits = summary[s]
    return (s << 6) | ((bits & -bits).bit_length() - 1)


class BlockSet:
    """A subset of ``range(size)`` with O(changed) updates and word-level scans."""

    __slots__ = (
        "count",
        "nonempty",
        "nonempty_buffer",
        "notfull",
        "notfull_buffer",
        "size",
        "word_buffer",
        "words",
    )

    def __init__(self, size: int) -> None:
        num_words = (size + 63) >> 6
        self.size = size
        self.count = 0
        self.word_buffer, self.words = uint64_buffer(num_words)
        self.nonempty_buffer, self.nonempty = uint64_buffer((num_words + 63) >> 6)
        self.notfull_buffer, self.notfull = uint64_buffer((num_words + 63) >> 6)
        self.nonempty[:], self.notfull[:] = summaries(self.words)

    @classmethod
    def from_mask(cls, mask: npt.NDArray[np.bool_]) -> BlockSet:
        """The set of ``i`` with ``mask[i]``; O(size), for restore and checks."""
        out = cls(mask.size)
        out.words[:] = pack_words(mask)
        out.count = int(np.count_nonzero(mask))
        out.nonempty[:], out.notfull[:] = summaries(out.words)
        return out

    def contains(self, block_id: int) -> bool:
        """Whether ``block_id`` is a member."""
        return bool((self.word_buffer[block_id >> 6] >> (block_id & 63)) & 1)

    def add_ids(self, ids: list[int]) -> None:
        """Add distinct non-members given as Python ints; a run of ids in one word is one
        word write (a request's blocks often share words)."""
        w, mask = -1, 0
        for block_id in ids:
            if block_id >> 6 != w:
                if mask:
                    self.set_word_bits(w, mask)
                w, mask = block_id >> 6, 0
            mask |= 1 << (block_id & 63)
        if mask:
            self.set_word_bits(w, mask)

    def remove_ids(self, ids: list[int]) -> None:
        """Remove distinct members given as Python ints, a run in one word at a time."""
        w, mask = -1, 0
        for block_id in ids:
            if block_id >> 6 != w:
                if mask:
                    self.clear_word_bits(w, mask)
                w, mask = block_id >> 6, 0
            mask |= 1 << (block_id & 63)
        if mask:
            self.clear_word_bits(w, mask)

    def set_word_bits(self, w: int, mask: int) -> None:
        """Add the members ``64 * w + i`` for the bits ``i`` of ``mask`` (all non-members)."""
        old = self.word_buffer[w]
        new = old | mask
        self.word_buffer[w] = new
        if not old:
            self.nonempty_buffer[w >> 6] |= 1 << (w & 63)
        if new == _MASK64:
            self.notfull_buffer[w >> 6] ^= 1 << (w & 63)
        self.count += mask.bit_count()

    def clear_word_bits(self, w: int, mask: int) -> None:
        """Remove the members ``64 * w + i`` for the bits ``i`` of ``mask`` (all members)."""
        old = self.word_buffer[w]
        new = old ^ mask
        self.word_buffer[w] = new
        if not new:
            self.nonempty_buffer[w >> 6] ^= 1 << (w & 63)
        if old == _MASK64:
            self.notfull_buffer[w >> 6] |= 1 << (w & 63)
        self.count -= mask.bit_count()

    def prev_nonempty(self, w: int) -> int:
        """The largest word index ``<= w`` with a member, or -1."""
        return _prev_set(self.nonempty_buffer, self.nonempty, w)

    def next_notfull(self, w: int) -> int:
        """The smallest word index ``>= w`` with a non-member bit, or -1."""
        return _next_set(self.notfull_buffer, self.notfull, w)

    def highest_at_most(self, limit: int) -> int:
        """The largest member ``<= limit``, or -1."""
        if limit < 0 or self.size == 0:
            return -1
        limit = min(limit, self.size - 1)
        w = limit >> 6
        bits = self.word_buffer[w] & ((2 << (limit & 63)) - 1)
        if not bits:
            w = self.prev_nonempty(w - 1)
            if w < 0:
                return -1
            bits = self.word_buffer[w]
        return (w << 6) | (bits.bit_length() - 1)


def pack_words(mask: npt.NDArray[np.bool_]) -> WordArray:
    """Bool array to little-endian uint64 words (bit ``i % 64`` of word ``i // 64``)."""
    num_words = (mask.size + 63) >> 6
    padded = np.zeros(num_words * 64, dtype=bool)
    padded[: mask.size] = mask
    packed = np.packbits(padded, bitorder="little")
    return packed.view("<u8").astype(np.uint64)


def summaries(words: WordArray) -> tuple[WordArray, WordArray]:
    """The ``nonempty`` and ``notfull`` summaries of ``words``; O(len(words))."""
    return pack_words(words != 0), pack_words(words != ALL_ONES)

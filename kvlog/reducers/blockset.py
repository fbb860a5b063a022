"""Sets of block ids as two-level numpy uint64 bitmaps.

A :class:`BlockSet` holds a subset of ``range(size)``: bit ``i`` of ``words[w]`` is block
``64 * w + i``. Two summary bitmaps over the words (``nonempty``: the word has a set bit;
``notfull``: the word has a clear bit) let scans skip 4096 blocks per summary bit, so finding
the highest member or the lowest non-member costs a few word operations, not a pass over the
cache. Updates touch the changed ids only, O(len(ids)): a Python-int loop for a few ids
(cheaper than a dozen numpy calls), vectorized numpy (``ufunc.at``) for more.

Bits at or above ``size`` in the last word are always clear: a scan for clear bits can yield
such ids, and callers bound their scans (defrag never pairs a destination above its source).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import numpy.typing as npt

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
WordArray = npt.NDArray[np.uint64]

ALL_ONES = np.uint64(0xFFFF_FFFF_FFFF_FFFF)
BIT: WordArray = np.left_shift(np.uint64(1), np.arange(64, dtype=np.uint64))
"""``BIT[i] == 1 << i`` as uint64, to build masks by fancy indexing."""
_CHUNK = 256
"""Summary words looked at per numpy call when a scan has to skip far."""
_MASK64 = (1 << 64) - 1
SCALAR_LIMIT = 16
"""Up to this many ids, updates loop over Python ints: cheaper than a dozen numpy calls."""


def set_bits(words: WordArray, ids: IdArray) -> None:
    """Set the bits of ``ids`` in a plain bitmap (ids may share words)."""
    np.bitwise_or.at(words, ids >> 6, BIT[ids & 63])


def clear_bits(words: WordArray, ids: IdArray) -> None:
    """Clear the bits of ``ids`` in a plain bitmap (ids may share words)."""
    np.bitwise_and.at(words, ids >> 6, ~BIT[ids & 63])


def _prev_set(summary: WordArray, index: int) -> int:
    """Largest ``i <= index`` whose bit is set in ``summary`` (bit ``i % 64`` of word
    ``i // 64``), or -1."""
    s = index >> 6
    bits = int(summary[s]) & ((2 << (index & 63)) - 1)
    while not bits:
        if s == 0:
            return -1
        lo = max(0, s - _CHUNK)
        hits = np.flatnonzero(summary[lo:s])
        if hits.size == 0:
            s = lo  # summary[lo] was zero too: the next round looks below it
            continue
        s = lo + int(hits[-1])
        bits = int(summary[s])
    return (s << 6) | (bits.bit_length() - 1)


def _next_set(summary: WordArray, index: int) -> int:
    """Smallest ``i >= index`` whose bit is set in ``summary``, or -1."""
    s = index >> 6
    if s >= summary.size:
        return -1
    bits = int(summary[s]) & ~((1 << (index & 63)) - 1)
    while not bits:
        lo = s + 1
        if lo >= summary.size:
            return -1
        hits = np.flatnonzero(summary[lo : lo + _CHUNK])
        if hits.size == 0:
            s = lo + _CHUNK - 1
            continue
        s = lo + int(hits[0])
        bits = int(summary[s])
    return (s << 6) | ((bits & -bits).bit_length() - 1)


class BlockSet:
    """A subset of ``range(size)`` with O(changed) updates and word-level scans."""

    __slots__ = ("count", "nonempty", "notfull", "size", "words")

    def __init__(self, size: int) -> None:
        num_words = (size + 63) >> 6
        self.size = size
        self.count = 0
        self.words: WordArray = np.zeros(num_words, dtype=np.uint64)
        self.nonempty, self.notfull = summaries(self.words)

    @classmethod
    def from_mask(cls, mask: npt.NDArray[np.bool_]) -> BlockSet:
        """The set of ``i`` with ``mask[i]``; O(size), for restore and checks."""
        out = cls(mask.size)
        out.words[:] = pack_words(mask)
        out.count = int(np.count_nonzero(mask))
        out.nonempty[:], out.notfull[:] = summaries(out.words)
        return out

    def to_mask(self) -> npt.NDArray[np.bool_]:
        """A bool array of ``size``; O(size)."""
        bits = np.unpackbits(self.words.view(np.uint8), bitorder="little")
        return bits[: self.size].astype(bool)

    def contains(self, block_id: int) -> bool:
        """Whether ``block_id`` is a member."""
        return bool((int(self.words[block_id >> 6]) >> (block_id & 63)) & 1)

    def add(self, ids: IdArray) -> None:
        """Add distinct ids that are not members."""
        if ids.size <= SCALAR_LIMIT:
            for block_id in ids.tolist():
                self._add_one(block_id)
            return
        words = ids >> 6
        np.bitwise_or.at(self.words, words, BIT[ids & 63])
        np.bitwise_or.at(self.nonempty, words >> 6, BIT[words & 63])
        full = words[self.words[words] == ALL_ONES]
        if full.size:
            np.bitwise_and.at(self.notfull, full >> 6, ~BIT[full & 63])
        self.count += int(ids.size)

    def remove(self, ids: IdArray) -> None:
        """Remove distinct ids that are members."""
        if ids.size <= SCALAR_LIMIT:
            for block_id in ids.tolist():
                self._remove_one(block_id)
            return
        words = ids >> 6
        np.bitwise_and.at(self.words, words, ~BIT[ids & 63])
        np.bitwise_or.at(self.notfull, words >> 6, BIT[words & 63])
        empty = words[self.words[words] == 0]
        if empty.size:
            np.bitwise_and.at(self.nonempty, empty >> 6, ~BIT[empty & 63])
        self.count -= int(ids.size)

    def _add_one(self, block_id: int) -> None:
        w = block_id >> 6
        old = int(self.words[w])
        new = old | (1 << (block_id & 63))
        self.words[w] = new
        if not old:
            self.nonempty[w >> 6] = int(self.nonempty[w >> 6]) | (1 << (w & 63))
        if new == _MASK64:
            self.notfull[w >> 6] = int(self.notfull[w >> 6]) & ~(1 << (w & 63))
        self.count += 1

    def _remove_one(self, block_id: int) -> None:
        w = block_id >> 6
        old = int(self.words[w])
        new = old & ~(1 << (block_id & 63))
        self.words[w] = new
        if not new:
            self.nonempty[w >> 6] = int(self.nonempty[w >> 6]) & ~(1 << (w & 63))
        if old == _MASK64:
            self.notfull[w >> 6] = int(self.notfull[w >> 6]) | (1 << (w & 63))
        self.count -= 1

    def highest_at_most(self, limit: int) -> int:
        """The largest member ``<= limit``, or -1."""
        return next(self.descending(limit), -1)

    def descending(self, limit: int, exclude: WordArray | None = None) -> Iterator[int]:
        """Members ``<= limit`` from the highest down, skipping bits set in ``exclude``.

        Words are read 64 at a time (one summary word's worth) as Python ints.
        """
        if limit < 0 or self.size == 0:
            return
        limit = min(limit, self.size - 1)
        first = limit >> 6
        w = first
        while w >= 0:
            w = _prev_set(self.nonempty, w)
            if w < 0:
                return
            lo = w & ~63
            chunk = self.words[lo : lo + 64].tolist()
            skip = exclude[lo : lo + 64].tolist() if exclude is not None else None
            todo = int(self.nonempty[w >> 6]) & ((2 << (w & 63)) - 1)
            while todo:
                top = todo.bit_length() - 1
                todo ^= 1 << top
                bits = chunk[top]
                if lo + top == first:
                    bits &= (2 << (limit & 63)) - 1
                if skip is not None:
                    bits &= ~skip[top]
                while bits:
                    b = bits.bit_length() - 1
                    yield ((lo + top) << 6) | b
                    bits ^= 1 << b
            w = lo - 1

    def ascending_clear(self, start: int, exclude: WordArray | None = None) -> Iterator[int]:
        """Non-members ``>= start`` from the lowest up, skipping bits set in ``exclude``.

        Words are read 64 at a time as Python ints. May yield ids at or above ``size`` from
        the last word's unused bits.
        """
        first = start >> 6
        w = first
        while w < self.words.size:
            w = _next_set(self.notfull, w)
            if w < 0:
                return
            lo = w & ~63
            chunk = self.words[lo : lo + 64].tolist()
            skip = exclude[lo : lo + 64].tolist() if exclude is not None else None
            todo = int(self.notfull[w >> 6]) & ~((1 << (w & 63)) - 1)
            while todo:
                low = todo & -todo
                todo ^= low
                index = low.bit_length() - 1
                bits = ~chunk[index] & _MASK64
                if lo + index == first:
                    bits &= ~((1 << (start & 63)) - 1)
                if skip is not None:
                    bits &= ~skip[index]
                while bits:
                    bit = bits & -bits
                    yield ((lo + index) << 6) | (bit.bit_length() - 1)
                    bits ^= bit
            w = lo + 64


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

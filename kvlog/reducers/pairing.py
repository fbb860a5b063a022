"""The defrag pairing walk: which used blocks move into which free ones, found word by word.

Rule (``defrag.py`` docstring): sources are the used blocks from ``max_used`` down,
destinations the free blocks from 1 up, both skipping pinned blocks; source ``i`` pairs
with destination ``i`` while the destination is below the source, for at most
``max_swaps`` pairs. Because the sources descend and the destinations ascend, every
destination in a word below the current source word is below every source in it, so the
walk needs no per-block comparison there: it takes ``min(sources left in the word, free
blocks left in the word, pairs left)`` at once, and compares bit by bit only where both
cursors reach the same word (after which nothing more can pair). Besides the block ids it
returns the taken bits per bitmap word, ``(word index, mask)`` in walk order, which
``move_blocks`` applies one word at a time.

Cost: O(words the cursors pass + pairs); summary bitmaps skip empty or full 4096-block runs.
"""

from __future__ import annotations

from kvlog.reducers.state import State

__all__ = ["Walk", "WordMasks", "walk"]

WordMasks = list[tuple[int, int]]
"""``(word index, bit mask)`` entries: bit ``i`` of the mask is block ``64 * word + i``."""

_MASK64 = (1 << 64) - 1


Walk = tuple[list[int], list[int], WordMasks, WordMasks]
"""Sources (descending), destinations (ascending), and the same bits as ``WordMasks``."""


def walk(state: State) -> Walk:
    """This step's defrag: (sources, destinations, vacated, filled), ``vacated`` /
    ``filled`` the sources' / destinations' bits per word in walk order; all empty when the
    trigger does not fire or no pair exists. Reads the bitmaps before anything moves."""
    config = state.config
    assert config is not None, "the pairing walk needs a configured state"
    max_used = state.max_used
    moved: Walk = ([], [], [], [])
    if max_used < 0 or max_used - config.threshold <= state.num_used:
        return moved
    sources, destinations, vacated, filled = moved
    used, pinned = state.used, state.pinned_buffer
    words = used.word_buffer
    sw, dw, limit = max_used >> 6, 0, config.max_swaps
    # *_bits: what the cursor's word offers now; *_start: what it offered on arrival
    source_start = source_bits = words[sw] & ~pinned[sw]  # nothing is used above max_used
    free_start = free_bits = ~(words[0] | pinned[0]) & _MASK64 & ~1  # never block 0
    while limit:
        if not source_bits:
            if source_start:
                vacated.append((sw, source_start))
            sw = used.prev_nonempty(sw - 1)
            source_start = source_bits = words[sw] & ~pinned[sw] if sw >= dw else 0
            if sw < dw:  # every source left is below every destination left (or none)
                break
        elif not free_bits:
            if free_start:
                filled.append((dw, free_start))
            dw = used.next_notfull(dw + 1)
            if dw < 0 or dw > sw:
                free_start = free_bits = 0
                break
            free_start = free_bits = ~(words[dw] | pinned[dw]) & _MASK64
        elif sw == dw:
            source_bits, free_bits = _pair_within(sw, source_bits, free_bits, limit, moved)
            break
        else:
            count = min(source_bits.bit_count(), free_bits.bit_count(), limit)
            source_bits = _take_highest(source_bits, count, sw << 6, sources)
            free_bits = _take_lowest(free_bits, count, dw << 6, destinations)
            limit -= count
    if source_start != source_bits:
        vacated.append((sw, source_start ^ source_bits))
    if free_start != free_bits:
        filled.append((dw, free_start ^ free_bits))
    return moved


def _take_highest(bits: int, count: int, base: int, out: list[int]) -> int:
    """Append ``base | i`` for the ``count`` highest set bits ``i`` (``count`` at most
    ``bits.bit_count()``), highest first, a run of consecutive bits at a time (free and
    used blocks come in runs); the bits left."""
    while count:
        end = bits.bit_length()  # one above the top run
        start = (~bits & ((1 << end) - 1)).bit_length()  # its lowest bit
        if end - start > count:
            start = end - count
        out.extend(range(base + end - 1, base + start - 1, -1))
        count -= end - start
        bits &= (1 << start) - 1
    return bits


def _take_lowest(bits: int, count: int, base: int, out: list[int]) -> int:
    """Append ``base | i`` for the ``count`` lowest set bits ``i`` (``count`` at most
    ``bits.bit_count()``), lowest first, a run at a time; the bits left."""
    while count:
        low = bits & -bits
        start = low.bit_length() - 1  # the bottom run's lowest bit
        above = bits + low  # carries through the run: its lowest set bit ends the run
        end = (above & -above).bit_length() - 1
        if end - start > count:
            end = start + count
        out.extend(range(base + start, base + end))
        count -= end - start
        bits &= -(1 << end)
    return bits


def _pair_within(
    w: int, source_bits: int, free_bits: int, limit: int, moved: Walk
) -> tuple[int, int]:
    """Both cursors in word ``w``: pair the highest source bits with the lowest free bits
    while the free bit is below the source bit, appending the ids to ``moved``; the source
    and free bits left."""
    sources, destinations, _, _ = moved
    base = w << 6
    while limit and source_bits and free_bits:
        top = source_bits.bit_length() - 1
        low = free_bits & -free_bits
        if low >> top:  # the free bit is above the source bit
            break
        sources.append(base | top)
        destinations.append(base | (low.bit_length() - 1))
        source_bits ^= 1 << top
        free_bits ^= low
        limit -= 1
    return source_bits, free_bits

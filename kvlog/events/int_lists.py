"""Lists of Python ints as one int64 array, at the speed of msgspec's encoder.

A scheduler step hands its block ids over as lists of Python ints (``StepScheduled``: one
list per request, hundreds of ids a step). Checking that each is an exact int and then
building an int64 array from them are two passes at 10-15 ns an id (a type lookup, an
unboxing), most of a step's check. msgspec's msgpack encoder unboxes an int in about
3 ns and tags what it writes, so ``int_lists`` encodes the lists once and reads the ints
back out of the bytes in one compiled pass: any item that is not an int (a bool, a float,
a str, a numpy integer, which msgspec refuses) or does not fit int64 makes it answer
None, and the caller takes its exact, slow path (which names the culprit).

What counts as an int is what msgpack encodes as one: a Python int, and an ``IntEnum``
member (msgspec writes its value). Pure: no I/O, no clock, no randomness.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np
import numpy.typing as npt

from kvlog.util.jit import inline, jit

__all__ = ["int_lists"]


def int_lists(lists: Sequence[object], count: int) -> npt.NDArray[np.int64] | None:
    """The items of ``lists`` (a sequence of ``count`` items in all, in lists or tuples),
    concatenated as int64; None where one is not an int of int64's range, or ``lists``
    holds anything but lists of items (msgspec cannot encode it, or it is not an array of
    arrays of ints)."""
    try:
        encoded = msgspec.msgpack.encode(lists)
    except (TypeError, OverflowError, ValueError):
        return None
    out = np.empty(count, dtype=np.int64)
    if _read_int_lists(np.frombuffer(encoded, dtype=np.uint8), out) != count:
        return None
    return out


def _length(buf: npt.NDArray[np.uint8], pos: int, tag: int) -> tuple[int, int]:
    """An array header's length and where its items start; length -1: not an array."""
    if 0x90 <= tag <= 0x9F:
        return tag & 0x0F, pos + 1
    if tag == 0xDC:
        return _big_endian(buf, pos + 1, 2), pos + 3
    if tag == 0xDD:
        return _big_endian(buf, pos + 1, 4), pos + 5
    return -1, pos


def _big_endian(buf: npt.NDArray[np.uint8], pos: int, size: int) -> int:
    value = 0
    for k in range(size):
        value = (value << 8) | int(buf[pos + k])
    return value


def _signed(value: int, bits: int) -> int:
    return value - (1 << bits) if value >= 1 << (bits - 1) else value


def _read_int(buf: npt.NDArray[np.uint8], pos: int) -> tuple[bool, int, int]:
    """(whether the item at ``pos`` is an int of int64's range, its value, the next
    item's position)."""
    tag = int(buf[pos])
    if tag < 0x80:  # positive fixint
        return True, tag, pos + 1
    if tag >= 0xE0:  # negative fixint
        return True, tag - 0x100, pos + 1
    if 0xCC <= tag <= 0xCE:  # uint8, uint16, uint32
        size = 1 << (tag - 0xCC)
        return True, _big_endian(buf, pos + 1, size), pos + 1 + size
    if 0xD0 <= tag <= 0xD2:  # int8, int16, int32
        size = 1 << (tag - 0xD0)
        return True, _signed(_big_endian(buf, pos + 1, size), 8 * size), pos + 1 + size
    if tag == 0xCF or tag == 0xD3:  # uint64 (past int64 unless its top bit is clear), int64
        if tag == 0xCF and buf[pos + 1] >= 0x80:
            return False, 0, pos
        high, low = _big_endian(buf, pos + 1, 4), _big_endian(buf, pos + 5, 4)
        return True, _signed(high, 32) * (1 << 32) + low, pos + 9
    return False, 0, pos


def _read_int_lists_py(buf: npt.NDArray[np.uint8], out: npt.NDArray[np.int64]) -> int:
    """msgpack's array of arrays of ints in ``buf``: the ints into ``out`` (at most its
    size); how many, or -1 where an item is not an array of ints of int64's range, or
    they are more than ``out`` holds."""
    num_lists, pos = _length(buf, 0, int(buf[0]))
    if num_lists < 0:
        return -1
    count = 0
    for _ in range(num_lists):
        num_items, pos = _length(buf, pos, int(buf[pos]))
        if num_items < 0 or count + num_items > len(out):
            return -1
        for _ in range(num_items):
            ok, value, pos = _read_int(buf, pos)
            if not ok:
                return -1
            out[count] = value
            count += 1
    return count


_length = inline(_length)
_big_endian = inline(_big_endian)
_signed = inline(_signed)
_read_int = inline(_read_int)
_read_int_lists = jit(_read_int_lists_py, allocates=False)

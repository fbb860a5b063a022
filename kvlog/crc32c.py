"""CRC-32C (Castagnoli), the checksum of every log record and of the log header.

Uses the ``crc32c`` package (hardware accelerated where the CPU allows) and falls back to
a table-driven implementation when it is missing: pure Python for short inputs, numpy
lane-parallel for long ones. ``zlib.crc32`` is a different polynomial and is never used.

``crc32c(data, value)`` continues a running checksum: ``crc32c(b, crc32c(a)) ==
crc32c(a + b)``, so a frame header and its payload are checksummed without a copy.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import numpy.typing as npt

__all__ = ["NATIVE", "crc32c", "crc32c_fallback"]

_POLY = 0x82F63B78  # CRC-32C, bit-reversed
_MASK = 0xFFFFFFFF
_LANES_MIN_BYTES = 512  # below this the plain table loop is faster than numpy lanes

Buffer = bytes | bytearray | memoryview
U32Array = npt.NDArray[np.uint32]


def _make_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ _POLY if crc & 1 else crc >> 1
        table.append(crc)
    return table


_TABLE = _make_table()
_TABLE_NP = np.array(_TABLE, dtype=np.uint32)


def _raw_python(register: int, data: Buffer) -> int:
    """The bare CRC register update over ``data`` (no pre/post inversion)."""
    table = _TABLE
    for byte in bytes(data):
        register = table[(register ^ byte) & 0xFF] ^ (register >> 8)
    return register


def _gf2_apply(
    columns: npt.NDArray[np.uint32], vectors: npt.NDArray[np.uint32]
) -> npt.NDArray[np.uint32]:
    """Multiply 32-bit vectors by a GF(2) matrix given as its 32 columns."""
    out = np.zeros_like(vectors)
    for bit in range(32):
        out ^= columns[bit] * ((vectors >> np.uint32(bit)) & np.uint32(1))
    return out


def _zeros_operator(num_bytes: int) -> U32Array:
    """Columns of the linear map "run the raw register over ``num_bytes`` zero bytes"."""
    one_byte = np.array([_raw_python(1 << bit, b"\0") for bit in range(32)], dtype=np.uint32)
    result = np.array([1 << bit for bit in range(32)], dtype=np.uint32)  # identity
    power = one_byte
    while num_bytes:
        if num_bytes & 1:
            result = _gf2_apply(power, result)
        power = _gf2_apply(power, power)
        num_bytes >>= 1
    return result


def _raw_lanes(register: int, data: Buffer) -> int:
    """Raw register update, vectorized: a power-of-two count of equal lanes run side by
    side from a zero register, then folded pairwise (CRC is linear over GF(2))."""
    view = np.frombuffer(data, dtype=np.uint8)
    num_lanes = 1 << (int(np.sqrt(view.size)).bit_length() - 1)
    lane_bytes = view.size // num_lanes
    lanes = view[: num_lanes * lane_bytes].reshape(num_lanes, lane_bytes)
    registers = np.zeros(num_lanes, dtype=np.uint32)
    low = np.uint32(0xFF)
    for column in lanes.T:
        registers = _TABLE_NP[(registers ^ column) & low] ^ (registers >> np.uint32(8))
    shift = _zeros_operator(lane_bytes)  # doubles with the span of each folded lane
    while registers.size > 1:
        registers = _gf2_apply(shift, registers[0::2]) ^ registers[1::2]
        shift = _gf2_apply(shift, shift)
    start = _gf2_apply(shift, np.array([register], dtype=np.uint32))
    register = int(start[0] ^ registers[0])
    return _raw_python(register, view[num_lanes * lane_bytes :].tobytes())


def crc32c_fallback(data: Buffer, value: int = 0) -> int:
    """CRC-32C of ``data`` continuing from ``value``, without the ``crc32c`` package."""
    register = (value ^ _MASK) & _MASK
    if len(data) >= _LANES_MIN_BYTES:
        register = _raw_lanes(register, data)
    else:
        register = _raw_python(register, data)
    return register ^ _MASK


class _Checksum(Protocol):
    def __call__(self, data: Buffer, value: int = 0) -> int: ...


_native: _Checksum | None
try:
    from crc32c import crc32c as _native
except ImportError:  # pragma: no cover - exercised by forcing the fallback in tests
    _native = None

NATIVE: bool = _native is not None
"""True when the ``crc32c`` package is in use."""

crc32c: _Checksum = _native if _native is not None else crc32c_fallback
"""CRC-32C of ``data``, continuing from the checksum ``value`` of what came before.

The package's function itself when it is installed (no wrapper on the hot path), so
callers that want the fallback switch to apply look it up as ``kvlog.crc32c.crc32c``.
"""

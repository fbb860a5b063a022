"""CRC-32C (Castagnoli), the checksum of every log record, of the log header and of
snapshots.

A thin re-export of the ``crc32c`` package (a hard dependency; hardware accelerated
where the CPU allows), so the log and the reducers name one checksum in one place.
``zlib.crc32`` is a different polynomial and is never used.

``crc32c(data, value)`` continues a running checksum: ``crc32c(b, crc32c(a)) ==
crc32c(a + b)``, so a frame header and its payload are checksummed without a copy.
"""

from __future__ import annotations

from crc32c import crc32c

__all__ = ["crc32c"]

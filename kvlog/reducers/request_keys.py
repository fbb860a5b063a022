"""Request keys in bulk: the running digest's 64-bit key of each of a step's new requests.

A request's key is blake2b of its UTF-8 id, 8 bytes, read little-endian (``running.py``:
``request_key``, hashlib's). A step of a busy server brings a dozen or more new requests,
and hashlib's three calls a key (``copy``, ``update``, ``digest``) and the int built from
its bytes were the largest Python cost of a replayed step after the commit's kernel. Here
the ids are encoded once, joined, and BLAKE2b (RFC 7693: unkeyed, 8-byte digest) runs over
each in one compiled loop that writes the keys to the digest's rows. Same keys as
``request_key`` for every id (a property test draws ids of every length and script).

Pure: no I/O, no clock, no randomness; the compiled loop allocates nothing (its working
words live in a caller-owned scratch array).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from kvlog.util.jit import inline, jit

__all__ = ["SCRATCH_WORDS", "keys_into"]

SCRATCH_WORDS = 24
"""uint64 words of the scratch array ``keys_into`` works in (h and m of RFC 7693)."""

_IV = np.array(
    [
        0x6A09E667F3BCC908,
        0xBB67AE8584CAA73B,
        0x3C6EF372FE94F82B,
        0xA54FF53A5F1D36F1,
        0x510E527FADE682D1,
        0x9B05688C2B3E6C1F,
        0x1F83D9ABFB41BD6B,
        0x5BE0CD19137E2179,
    ],
    dtype=np.uint64,
)
_SIGMA = np.array(
    [
        [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15],
        [14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3],
        [11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4],
        [7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8],
        [9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13],
        [2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9],
        [12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11],
        [13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10],
        [6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5],
        [10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0],
    ],
    dtype=np.uint64,  # unsigned: compiled indexing skips the negative-index wraparound
)
_PARAMS = np.uint64(0x01010008)
"""The parameter block's first word: digest length 8, no key, fanout 1, depth 1."""
_ZERO = np.uint64(0)
_BLOCK_BYTES = 128


def _rotr(x: Any, n: int) -> Any:
    return (x >> np.uint64(n)) | (x << np.uint64(64 - n))


def _g(a: Any, b: Any, c: Any, d: Any, x: Any, y: Any) -> Any:
    """RFC 7693's mixing function G."""
    a = a + b + x
    d = _rotr(d ^ a, 32)
    c = c + d
    b = _rotr(b ^ c, 24)
    a = a + b + y
    d = _rotr(d ^ a, 16)
    c = c + d
    b = _rotr(b ^ c, 63)
    return a, b, c, d


def _load(m: Any, data: Any, start: int, end: int) -> None:
    """The block ``data[start:end]`` (at most 128 bytes) as 16 little-endian words,
    zero-padded, into ``m``."""
    for j in range(16):
        m[j] = _ZERO
    for at in range(start, end):
        offset = at - start
        m[offset >> 3] |= np.uint64(data[at]) << np.uint64(8 * (offset & 7))


def _compress(h: Any, m: Any, counter: int, last: bool) -> None:
    """RFC 7693's F: the state ``h`` takes the block ``m``, ``counter`` bytes hashed so
    far (this block's included)."""
    v0, v1, v2, v3, v4, v5, v6, v7 = h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]
    v8, v9, v10, v11 = _IV[0], _IV[1], _IV[2], _IV[3]
    v12, v13, v14, v15 = _IV[4] ^ np.uint64(counter), _IV[5], _IV[6], _IV[7]
    if last:
        v14 = ~v14
    for r in range(12):
        s = _SIGMA[r % 10]
        v0, v4, v8, v12 = _g(v0, v4, v8, v12, m[s[0]], m[s[1]])
        v1, v5, v9, v13 = _g(v1, v5, v9, v13, m[s[2]], m[s[3]])
        v2, v6, v10, v14 = _g(v2, v6, v10, v14, m[s[4]], m[s[5]])
        v3, v7, v11, v15 = _g(v3, v7, v11, v15, m[s[6]], m[s[7]])
        v0, v5, v10, v15 = _g(v0, v5, v10, v15, m[s[8]], m[s[9]])
        v1, v6, v11, v12 = _g(v1, v6, v11, v12, m[s[10]], m[s[11]])
        v2, v7, v8, v13 = _g(v2, v7, v8, v13, m[s[12]], m[s[13]])
        v3, v4, v9, v14 = _g(v3, v4, v9, v14, m[s[14]], m[s[15]])
    h[0] ^= v0 ^ v8
    h[1] ^= v1 ^ v9
    h[2] ^= v2 ^ v10
    h[3] ^= v3 ^ v11
    h[4] ^= v4 ^ v12
    h[5] ^= v5 ^ v13
    h[6] ^= v6 ^ v14
    h[7] ^= v7 ^ v15


def _key(scratch: Any, data: Any, start: int, end: int) -> Any:
    """blake2b of ``data[start:end]`` with an 8-byte digest, as a little-endian uint64
    (``scratch``: h in words 0-7, the block in 8-23)."""
    h, m = scratch[:8], scratch[8:24]
    for i in range(8):
        h[i] = _IV[i]
    h[0] ^= _PARAMS
    at = start
    while end - at > _BLOCK_BYTES:  # every block but the last (which may be full)
        _load(m, data, at, at + _BLOCK_BYTES)
        _compress(h, m, at + _BLOCK_BYTES - start, False)
        at += _BLOCK_BYTES
    _load(m, data, at, end)
    _compress(h, m, end - start, True)
    return h[0]


def _keys_into(data: Any, lengths: Any, rows: Any, keys: Any, sums: Any, scratch: Any) -> None:
    """For each id (``lengths[i]`` bytes of ``data`` after the ones before it): its key
    to ``keys[rows[i]]``, and 0 to ``sums[rows[i]]``."""
    start = 0
    for i in range(len(lengths)):
        end = start + lengths[i]
        keys[rows[i]] = _key(scratch, data, start, end)
        sums[rows[i]] = _ZERO
        start = end


_rotr = inline(_rotr)
_g = inline(_g)
_load = inline(_load)
_compress = inline(_compress)
_key = inline(_key)
_keys_into_compiled = jit(_keys_into, allocates=False)


def keys_into(
    req_ids: list[str],
    rows: list[int],
    keys: npt.NDArray[np.uint64],
    sums: npt.NDArray[np.uint64],
    scratch: npt.NDArray[np.uint64],
) -> None:
    """``keys[rows[i]] = request_key(req_ids[i])`` and ``sums[rows[i]] = 0`` for every i
    (``scratch``: ``SCRATCH_WORDS`` uint64 of the caller's)."""
    joined = "".join(req_ids)
    data = joined.encode("utf-8", "surrogatepass")
    count = len(req_ids)
    if len(data) == len(joined):  # all ASCII: a byte a character
        lengths = np.fromiter(map(len, req_ids), np.int64, count)
    else:
        encoded = [req_id.encode("utf-8", "surrogatepass") for req_id in req_ids]
        data = b"".join(encoded)
        lengths = np.fromiter(map(len, encoded), np.int64, count)
    _keys_into_compiled(
        np.frombuffer(data, dtype=np.uint8),
        lengths,
        np.fromiter(rows, np.int64, count),
        keys,
        sums,
        scratch,
    )

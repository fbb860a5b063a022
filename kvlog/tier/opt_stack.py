"""The optimum's whole hit-rate curve in one pass: Mattson et al.'s (1970) OPT stack,
compiled.

One stack of keys serves every capacity at once: the tier of capacity ``c`` holds the top
``c`` keys. A key that must enter (a store) goes to the top; the keys it displaces bubble
down, and at each depth the one with the nearer next ask stays, the farther goes on: at
every capacity below the key's old depth, the key that leaves the top ``c`` is the farthest
of them, which is Belady's victim at that capacity. Priorities may change between
references (the invariant only needs each victim to be the farthest at that moment), so the
same pass follows ``optimum.belady``'s batch rules: a request's keys of later store batches
take ``LATER`` (first victims) until their batch; a batch's keys are protected (priority -1)
while it is stored, then take their next ask. Ties break as ``belady``'s heap breaks them
(farther ask first, then the smaller key), with keys interned in byte order.

The stack is cut at ``max_chunks`` (a key below is held at no capacity asked about), so the
pass costs O(chunk asks x max_chunks) compiled.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvlog.util.jit import jit

__all__ = ["opt_depths"]


def _opt_depths(
    keys: Any, starts: Any, num_keys: int, keys_per_step: int, max_chunks: int, depths: Any
) -> None:
    """Fill ``depths`` (one per chunk ask): the ask's depth in the stack when its request
    starts (1 is the top; ``max_chunks + 1``: held at no capacity up to ``max_chunks``)."""
    num_accesses = len(starts) - 1
    later = num_accesses + 1  # ``never`` is num_accesses
    following = np.full(num_keys, num_accesses, dtype=np.int64)
    upcoming = np.empty(len(keys), dtype=np.int64)
    for index in range(num_accesses - 1, -1, -1):
        for i in range(starts[index], starts[index + 1]):
            upcoming[i] = following[keys[i]]
        for i in range(starts[index], starts[index + 1]):
            following[keys[i]] = index
    priority = np.zeros(num_keys, dtype=np.int64)
    where = np.full(num_keys, -1, dtype=np.int64)
    stack = np.empty(max_chunks, dtype=np.int64)
    size = 0
    for index in range(num_accesses):
        first, last = starts[index], starts[index + 1]
        for i in range(first, last):
            w = where[keys[i]]
            depths[i] = w + 1 if w >= 0 else max_chunks + 1
        for i in range(first + keys_per_step, last):
            priority[keys[i]] = later * num_keys + (num_keys - 1 - keys[i])
        for batch in range(first, last, keys_per_step):
            end = min(batch + keys_per_step, last)
            for i in range(batch, end):
                priority[keys[i]] = -1
            for i in range(batch, end):
                size = _to_top(stack, size, where, priority, keys[i])
            for i in range(batch, end):
                priority[keys[i]] = upcoming[i] * num_keys + (num_keys - 1 - keys[i])


def _to_top(stack: Any, size: int, where: Any, priority: Any, key: int) -> int:
    """``key`` to the top; the displaced bubble down (the farther ask goes on). Returns the
    new size (a key pushed past the cut leaves the stack)."""
    old = where[key]
    if old == 0:
        return size
    stop = old if old > 0 else size
    if size == 0:
        stack[0] = key
        where[key] = 0
        return 1
    carried = stack[0]
    stack[0] = key
    where[key] = 0
    for d in range(1, stop):
        item = stack[d]
        if priority[item] > priority[carried]:
            stack[d] = carried
            where[carried] = d
            carried = item
    if old > 0:
        stack[old] = carried
        where[carried] = old
    elif size < len(stack):
        stack[size] = carried
        where[carried] = size
        size += 1
    else:
        where[carried] = -1
    return size


_to_top = jit(_to_top)
opt_depths = jit(_opt_depths)

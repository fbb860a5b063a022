"""``request_keys.keys_into``: the running digest's request keys, compiled, are hashlib's."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kvlog.reducers.request_keys import SCRATCH_WORDS, keys_into
from kvlog.reducers.running import request_key

# every code point, lone surrogates included (the log encodes ids with surrogatepass)
_IDS = st.text(st.characters(blacklist_categories=()), max_size=300)


def _keys(req_ids: list[str]) -> tuple[list[int], list[int]]:
    size = len(req_ids) + 3
    keys = np.zeros(size, dtype=np.uint64)
    sums = np.full(size, 7, dtype=np.uint64)
    rows = list(range(size - 1, 2, -1))[: len(req_ids)]  # rows out of order
    keys_into(req_ids, rows, keys, sums, np.zeros(SCRATCH_WORDS, dtype=np.uint64))
    assert sums[rows].tolist() == [0] * len(rows) and sums[:3].tolist() == [7, 7, 7]
    return [int(keys[row]) for row in rows], rows


def test_every_block_boundary_and_script() -> None:
    """Ids of 0-1 bytes, one short of, at and one past each 128-byte block (the last
    block full or not), and of multi-byte characters and surrogates."""
    ids = ["", "a", "req-1"] + ["x" * n for n in (127, 128, 129, 255, 256, 257, 384)]
    ids += ["é" * 64, "日本語" * 50, "\ud800", "a\udfffb", "🦙" * 40]
    got, _ = _keys(ids)
    assert got == [request_key(req_id) for req_id in ids]


@given(st.lists(_IDS, max_size=40))
def test_keys_are_request_keys(req_ids: list[str]) -> None:
    got, _ = _keys(req_ids)
    assert got == [request_key(req_id) for req_id in req_ids]

"""The CPU tier events' stateless checks: what they accept, and the first bad value each
refusal names."""

from __future__ import annotations

from typing import Any

import pytest

from kvlog.errors import InvalidEvent
from kvlog.events import TierBatch, TierLoadPrepared, TierLookedUp, TierRequestStarted
from kvlog.events.tier_checks import MAX_KEY_BYTES, MAX_TIER_CHUNKS, TIER_VALIDATORS

KEY = b"k" * 36


def check(event: Any) -> None:
    TIER_VALIDATORS[type(event)](event)


def started(**fields: Any) -> TierRequestStarted:
    base: dict[str, Any] = {"req_id": "r", "context": 0, "position_keys": [KEY, KEY]}
    base["positions"] = [16, 32]
    return TierRequestStarted(**{**base, **fields})


def prepared(**fields: Any) -> TierLoadPrepared:
    base: dict[str, Any] = {"req_id": "r", "context": 1, "keys": [KEY, b"x"], "chunk_ids": [0, 7]}
    return TierLoadPrepared(**{**base, **fields})


def test_good_events_and_a_batch_of_them_pass() -> None:
    good = [
        started(),
        started(position_keys=[], positions=[]),
        started(req_id="é-request"),
        prepared(),
        prepared(chunk_ids=[0, MAX_TIER_CHUNKS - 1]),
        prepared(keys=[b"x" * MAX_KEY_BYTES, b"y"]),
        TierLookedUp(req_id="r", context=0, key=KEY, result="hit"),
    ]
    for event in good:
        check(event)
    check(TierBatch(events=good))


@pytest.mark.parametrize(
    ("event", "message"),
    [
        (started(positions=[16, -1]), "position must be an int in .* got -1"),
        (started(positions=[16, True]), "position must be an int in .* got True"),
        (started(positions=[1.5, "x"]), "position must be an int in .* got 1.5"),
        (started(positions=[16, 2**63]), "position must be an int in .* got 9223372036854775808"),
        (started(position_keys=[KEY, "k"]), "position_keys holds 'k', not 1-1024 key bytes"),
        (started(position_keys=[KEY, b""]), "position_keys holds b'', not 1-1024 key bytes"),
        (prepared(keys=[b"x" * (MAX_KEY_BYTES + 1), 3]), "keys holds b'xxx"),
        (prepared(keys=[KEY, bytearray(b"k")]), r"keys holds bytearray\(b'k'\)"),
        (prepared(chunk_ids=[MAX_TIER_CHUNKS, -1]), f"chunk id must be .* got {MAX_TIER_CHUNKS}"),
        (prepared(chunk_ids=[3, -1]), "chunk id must be an int in .* got -1"),
        (started(req_id="bad\ud800"), "req_id is not valid UTF-8 text"),
        (TierLookedUp(req_id="r", context=0, key=b"", result="hit"), "key holds b'', not 1-1024"),
        (TierLookedUp(req_id="r", context=0, key="k", result="hit"), "key holds 'k', not 1-1024"),
    ],
)
def test_the_first_bad_value_is_named(event: Any, message: str) -> None:
    with pytest.raises(InvalidEvent, match=message):
        check(event)
    with pytest.raises(InvalidEvent, match=message):
        check(TierBatch(events=[started(), event]))

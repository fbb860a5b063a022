"""Replay validates the events its typed decoder produced with ``DECODED_VALIDATORS``,
which skip the type checks msgspec has already made. The contract: on every event the
decoder can produce, the same verdict and the same error as ``VALIDATORS``."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import example, given
from hypothesis import strategies as st

from kvlog.events import Event, StepPacked, StepScheduled, decode, encode
from kvlog.events.validate import DECODED_VALIDATORS, MAX_ID, MAX_REQ_ID_LENGTH, VALIDATORS
from tests.support.strategies import any_record

_LENGTHS = st.sampled_from([0, 1, 7, MAX_REQ_ID_LENGTH, MAX_REQ_ID_LENGTH + 1])
_REQ_IDS = st.one_of(st.text(max_size=12), _LENGTHS.map(lambda n: "r" * n))
_STEPS = st.one_of(st.integers(-3, 3), st.sampled_from([MAX_ID, MAX_ID + 1, 2**64 - 1, -(2**63)]))
_BLOCK_IDS = st.lists(st.integers(-(2**63), 2**64 - 1), max_size=6)


def _verdict(validate: Any, event: Event) -> tuple[str, str]:
    """What a validator says of ``event``: ("", "") or the error's type and message."""
    try:
        validate(event)
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "", ""


def _same_verdicts(event: Event) -> None:
    decoded = decode(encode(event))
    kind = type(decoded)
    assert _verdict(DECODED_VALIDATORS[kind], decoded) == _verdict(VALIDATORS[kind], decoded)


@given(
    _STEPS,
    st.dictionaries(_REQ_IDS, _BLOCK_IDS, max_size=4),
    *(st.lists(_REQ_IDS, max_size=3) for _ in range(3)),
)
@example(0, {"a" * (MAX_REQ_ID_LENGTH + 1): [1]}, [], [], [])
@example(0, {"a": [1]}, ["b", ""], [], [])
@example(-1, {"": [1]}, [], [], [])
@example(MAX_ID + 1, {}, [], [], ["x" * (MAX_REQ_ID_LENGTH + 1)])
def test_decoded_steps_get_the_full_validators_verdict(
    step: int,
    allocated: dict[str, list[int]],
    finished: list[str],
    preempted: list[str],
    resumed: list[str],
) -> None:
    _same_verdicts(StepScheduled(step, allocated, finished, preempted, resumed))


@given(any_record)
def test_every_decoded_record_gets_the_full_validators_verdict(record: Any) -> None:
    if type(record) in VALIDATORS:
        _same_verdicts(record)


@given(
    _STEPS,
    st.lists(_REQ_IDS, max_size=4),
    st.lists(st.integers(-3, 4), max_size=5),
    st.integers(0, 24),
    *(st.lists(_REQ_IDS, max_size=3) for _ in range(3)),
    st.sampled_from([2, 4, 3, 0]),
)
@example(0, ["a", "a"], [1, 1], 8, [], [], [], 4)
@example(0, ["a"], [-1], 0, [], [], [], 4)
@example(0, ["a", "b"], [1], 4, [], [], [], 4)
@example(MAX_ID + 1, ["a"], [1], 4, [], [], [], 4)
@example(0, ["a"], [2], 4, [], [], [], 2)
@example(0, ["a"], [1], 3, [], [], [], 3)
def test_decoded_packed_steps_get_the_full_validators_verdict(
    step: int,
    req_ids: list[str],
    counts: list[int],
    num_bytes: int,
    finished: list[str],
    preempted: list[str],
    resumed: list[str],
    id_bytes: int,
) -> None:
    packed = np.asarray(counts, dtype="<i4").tobytes()
    ids = bytes(range(num_bytes))
    record = StepPacked(step, req_ids, packed, ids, finished, preempted, resumed, id_bytes)
    _same_verdicts(record)

"""The tier reducer's manager rules (``TierConfigured.rule``, issue 30) without vLLM: each
vLLM release's store threshold, ``touch`` and eviction, on hand-built calls; logs from before
the field replay by 0.33's rule. ``tests/test_cpu_tier_vllm.py`` compares every rule with
the real manager of its release in that release's CI stage."""

from __future__ import annotations

import msgspec
import pytest

from kvlog.errors import InvalidEvent
from kvlog.events import (
    TIER_RULES,
    TierConfigured,
    TierLoadCompleted,
    TierLoadPrepared,
    TierLookedUp,
    TierRequestStarted,
    TierStoreCompleted,
    TierStorePrepared,
    TierTouched,
    decode,
    encode,
)
from kvlog.reducers.cpu_tier import TierAnswer, TierState, reduce_tier

K = [bytes([i]) * 8 + b"\0\0\0\0" for i in range(8)]


def _tier(rule: str, **fields: object) -> TierState:
    state, _ = reduce_tier(None, TierConfigured(rule=rule, **fields))  # type: ignore[arg-type]
    return state


def _call(state: TierState, event: object) -> TierAnswer:
    return reduce_tier(state, event)[1]  # type: ignore[arg-type]


def _offer(state: TierState, context: int, keys: list[bytes]) -> TierAnswer:
    return _call(state, TierStorePrepared(f"r{context}", context, keys, True, [], [], []))


def test_a_log_from_before_the_field_follows_vllm_0_33() -> None:
    old = b'{"type":"TierConfigured","num_chunks":4,"store_threshold":2}'
    config = msgspec.json.decode(old, type=TierConfigured)
    assert config.rule == "vllm-0.33" == TIER_RULES[0]
    assert decode(encode(config)) == config


def test_an_unknown_rule_is_refused() -> None:
    with pytest.raises(InvalidEvent, match="rule"):
        reduce_tier(None, TierConfigured(num_chunks=4, rule="vllm-0.20"))


@pytest.mark.parametrize(("rule", "stored"), [("vllm-0.33", [K[0]]), ("vllm-0.34", [])])
def test_vllm_0_34_counts_a_key_once_per_request(rule: str, stored: list[bytes]) -> None:
    """One request offering a key twice reaches threshold 2 under 0.33's rule; under 0.34's
    a retry of the same request is no second use of the content."""
    state = _tier(rule, num_chunks=4, store_threshold=2)
    _call(state, TierRequestStarted("r1", 1))
    assert _offer(state, 1, [K[0]]).keys_to_store == []
    assert _offer(state, 1, [K[0]]).keys_to_store == stored


def test_vllm_0_34_admits_a_key_a_second_request_offers() -> None:
    state = _tier("vllm-0.34", num_chunks=4, store_threshold=2)
    for context in (1, 2):
        _call(state, TierRequestStarted(f"r{context}", context))
    assert _offer(state, 1, [K[0]]).keys_to_store == []
    assert _offer(state, 2, [K[0]]).keys_to_store == [K[0]]


def test_vllm_0_34_has_no_touch() -> None:
    state = _tier("vllm-0.34", num_chunks=4)
    with pytest.raises(InvalidEvent, match="no touch"):
        _call(state, TierTouched("r1", 1, [K[0]]))
    _call(_tier("vllm-0.33", num_chunks=4), TierTouched("r1", 1, [K[0]]))


def test_vllm_0_26_counts_lookups_not_offers() -> None:
    """0.26's threshold counts lookups: two lookups admit a key; offers alone never do."""
    state = _tier("vllm-0.26", num_chunks=4, store_threshold=2)
    assert _offer(state, 1, [K[0]]).keys_to_store == []
    assert _offer(state, 1, [K[0]]).keys_to_store == []
    for _ in range(2):
        assert _call(state, TierLookedUp("r1", 1, K[1], "miss")).result == "miss"
    assert _offer(state, 1, [K[0], K[1]]).keys_to_store == [K[1]]


def _fill(state: TierState, keys: list[bytes]) -> None:
    answer = _offer(state, 1, keys)
    assert answer.keys_to_store == keys
    _call(state, TierStoreCompleted("r1", 1, keys, True))


def test_vllm_0_26_lru_evicts_the_least_recently_idle_key() -> None:
    """0.26's LRU: a load's end makes its key the most recent; 0.33's ranks by request."""
    state = _tier("vllm-0.26", num_chunks=2)
    _fill(state, [K[0], K[1]])
    _call(state, TierLoadPrepared("r2", 2, [K[0]], [0]))
    _call(state, TierLoadCompleted("r2", 2, [K[0]]))
    answer = _offer(state, 3, [K[2]])
    assert answer.evicted_keys == [K[1]] and answer.chunk_ids == [1]


def test_vllm_0_26_queues_no_event_for_a_failed_store() -> None:
    for rule, changes in (("vllm-0.26", 0), ("vllm-0.33", 1)):
        state = _tier(rule, num_chunks=2)
        _offer(state, 1, [K[0]])
        answer = _call(state, TierStoreCompleted("r1", 1, [K[0]], False))
        assert len(answer.changes) == changes


def test_vllm_0_26_arc_does_not_fall_back_to_t1() -> None:
    """T1 below its target and T2 holding no idle key: 0.26's ARC fails the store, 0.33's
    evicts from T1."""
    for rule, accepted in (("vllm-0.26", False), ("vllm-0.33", True)):
        state = _tier(rule, num_chunks=2, eviction="arc")
        _fill(state, [K[0], K[1]])
        state.policy.target_t1_size = 5.0  # type: ignore[attr-defined]
        assert _offer(state, 2, [K[2]]).accepted is accepted, rule

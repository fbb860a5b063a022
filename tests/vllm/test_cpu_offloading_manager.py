"""The tier reducer against the installed vLLM's real ``CPUOffloadingManager`` (issues 23, 30).

Random call sequences (hypothesis) drive the real manager, wrapped in kvlog's
``TierRecorder``; every recorded call is refolded by ``reducers/cpu_tier.py`` at once and
every return value compared: lookup answers, load chunks, the keys a store chose, their
chunks, the evicted keys, and the manager's ``OffloadingEvent``s. LRU and ARC, store
threshold off, 1 and 2 (a small tracker, so it ages keys out). Runs in the vLLM stages only,
once per supported vLLM (0.26: a tier of blocks, no key positions; 0.34: no ``touch``): the
recorded ``TierConfigured.rule`` picks the reducer's rule; ``test_figures`` prints the
sequences and calls compared.
"""

from __future__ import annotations

import collections
import inspect
from typing import Any

import pytest

pytest.importorskip(
    "vllm", reason="vLLM is not installed here: the vLLM stages run this module in their venvs"
)

from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.v1.kv_offload.base import ReqContext, make_offload_key
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

from kvlog.events import TierBatch
from kvlog.reducers.cpu_tier import TierState, reduce_tier
from kvlog.tier.record import TierRecorder, tier_config_of
from kvlog.tier.replay import _comparable, _recorded, replay_tier, tier_events
from kvlog.util import vllm_compat
from tests.support.strategies import tier_calls

NUM_HASHES = 16
TOKENS_PER_CHUNK = 16
FIGURES: collections.Counter[tuple[str, int, str]] = collections.Counter()


def _key(hash_index: int, group: int) -> bytes:
    return make_offload_key(hash_index.to_bytes(8, "big"), group)


class Driver:
    """Turns abstract calls into calls the manager can take; compares each answer."""

    def __init__(self, config: dict[str, Any], flush_every: int = 0) -> None:
        """``flush_every``: a batched recorder, flushed every that many calls (its log is
        compared whole by the test, not call by call)."""
        self.manager = _manager(config)
        self.log: list[Any] = []
        self.flush_every = flush_every
        self.calls = self.started = 0
        self.recorder_config = tier_config_of(self.manager)
        self.recorder = TierRecorder(
            self.manager, self.log.append, self.recorder_config, batched=flush_every > 0
        )
        self.state: TierState | None = None
        self.done = 0
        self.slots: list[tuple[ReqContext, list[bytes], bool] | None] = [None] * 4
        self.loads: list[tuple[list[bytes], ReqContext]] = []
        self.stores: list[tuple[list[bytes], ReqContext]] = []
        self.compared = 0
        self._check()

    def _check(self) -> None:
        """Refold the calls recorded since the last check; compare answers and events."""
        if self.flush_every:
            self.calls += 1
            if self.calls % self.flush_every == 0:
                self.recorder.flush()
            return
        changes: list[Any] = []
        for event in self.log[self.done :]:
            self.state, answer = reduce_tier(self.state, event)
            recorded = _recorded(event)
            if recorded is not None:
                assert _comparable(answer) == recorded, (event, answer)
                self.compared += 1
            changes += answer.changes
        self.done = len(self.log)
        real = [
            (list(e.keys), e.removed, getattr(e, "metadata_only", False))  # none in 0.26
            for e in self.manager.events or ()
        ]
        ours = [(c.keys, c.removed, c.metadata_only) for c in changes]
        assert ours == real, (ours, real)
        assert self.manager.events is not None
        self.manager.events.clear()

    def _start(self, slot: int, a: int, b: int) -> None:
        self.started += 1
        context = ReqContext(req_id=f"req-{self.started}")
        group = b % 2
        keys = [_key((a + i) % NUM_HASHES, group) for i in range(b % 7 + 1)]
        for i, key in enumerate(keys[: len(keys) // 2 + 1]):
            if hasattr(context, "set_offload_key_position"):  # 0.33 on
                context.set_offload_key_position(key, (i + 1) * TOKENS_PER_CHUNK)
        self.slots[slot] = (context, keys, False)
        self.recorder.on_new_request(context)

    def call(self, kind: int, a: int, b: int, c: int) -> None:
        slot = self.slots[a % 4]
        if kind == 0 or slot is None:
            self._start(a % 4, b, c)
        elif kind == 4:
            if self.loads:
                keys, context = self.loads.pop(b % len(self.loads))
                self.recorder.complete_load(keys, context)
        elif kind == 6:
            if self.stores:
                keys, context = self.stores.pop(b % len(self.stores))
                self.recorder.complete_store(keys, context, success=c % 5 != 0)
        elif kind == 9 and c % 8 == 0:
            self.recorder.reset_cache()
            self.loads.clear()
            self.stores.clear()
        else:
            self._request_call(kind, a % 4, slot, b, c)
        self._check()

    def _request_call(
        self, kind: int, index: int, slot: tuple[ReqContext, list[bytes], bool], b: int, c: int
    ) -> None:
        context, keys, finished = slot
        if finished:
            self._start(index, b, c)
            return
        chosen = keys[b % len(keys) : b % len(keys) + c % 5 + 1]
        if kind in (1, 9):
            self.recorder.lookup(keys[b % len(keys)], context)
        elif kind == 2:
            if vllm_compat.has_touch(self.manager):  # gone in 0.34
                self.recorder.touch(chosen, context)
        elif kind == 3:
            ready = [k for k in chosen if _ready(self.manager, k)]
            if ready:
                self.recorder.prepare_load(ready, context)
                self.loads.append((ready, context))
        elif kind == 5:
            out = self.recorder.prepare_store(chosen, context)
            if out is not None and out.keys_to_store:
                self.stores.append((list(out.keys_to_store), context))
        elif kind == 7:
            self.recorder.on_request_finished(context)
            self.slots[index] = (context, keys, True)
        elif hasattr(context, "set_offload_key_position"):  # 0.33 on
            for i, key in enumerate(keys):
                context.set_offload_key_position(key, (i + 1) * TOKENS_PER_CHUNK)


def _manager(config: dict[str, Any]) -> CPUOffloadingManager:
    """The manager of the installed vLLM (0.26 counts its tier in ``num_blocks``)."""
    config = dict(config)
    if "num_chunks" not in inspect.signature(CPUOffloadingManager).parameters:
        config["num_blocks"] = config.pop("num_chunks")
    return CPUOffloadingManager(enable_events=True, **config)


def _ready(manager: CPUOffloadingManager, key: bytes) -> bool:
    """Whether ``key`` is stored and readable, asked without a call that counts (0.26's
    ``lookup`` counts toward the store threshold)."""
    chunk = manager._policy.get(key)
    return chunk is not None and bool(chunk.is_ready)


def _run(eviction: str, threshold: int, case: tuple[dict[str, Any], list[Any]]) -> None:
    config, calls = case
    driver = Driver(config)
    for call in calls:
        driver.call(*call)
    replayed = replay_tier(driver.log)  # the whole log again, from the start
    assert replayed.mismatch is None, replayed.mismatch
    rule = driver.recorder_config.rule
    name = f"vLLM {vllm_compat.installed_vllm()} ({rule}) {eviction} threshold {threshold}"
    FIGURES[(name, 0, "sequences")] += 1
    FIGURES[(name, 1, "calls")] += len(driver.log) - 1
    FIGURES[(name, 2, "answers compared")] += driver.compared


def _make(eviction: str, threshold: int) -> Any:
    @settings(max_examples=100, deadline=None)
    @given(
        case=tier_calls(eviction=eviction, store_threshold=threshold, min_calls=40, max_calls=120)
    )
    def test(case: tuple[dict[str, Any], list[Any]]) -> None:
        _run(eviction, threshold, case)

    return test


test_lru = _make("lru", 0)
test_arc = _make("arc", 0)
test_lru_threshold_1 = _make("lru", 1)
test_arc_threshold_1 = _make("arc", 1)
test_lru_threshold_2 = _make("lru", 2)
test_arc_threshold_2 = _make("arc", 2)


@settings(max_examples=60, deadline=None)
@given(
    case=tier_calls(eviction="arc", store_threshold=1, min_calls=40, max_calls=120),
    flush_every=st.integers(1, 9),
)
def test_a_batched_recorder_logs_the_same_calls(
    case: tuple[dict[str, Any], list[Any]], flush_every: int
) -> None:
    """The scheduler side's recorder keeps a step's calls and writes them as one
    ``TierBatch``: read back one by one they are the unbatched recorder's events, and the
    log refolds exactly."""
    config, calls = case
    plain, batched = Driver(config), Driver(config, flush_every=flush_every)
    for call in calls:
        plain.call(*call)
        batched.call(*call)
    batched.recorder.flush()
    assert list(tier_events(batched.log)) == plain.log
    assert (flush_every > 1) == any(type(e) is TierBatch for e in batched.log)
    assert replay_tier(batched.log).mismatch is None


def test_figures(capsys: pytest.CaptureFixture[str]) -> None:
    """Print what the differential tests above compared."""
    if not FIGURES:
        pytest.skip("no differential test ran")
    with capsys.disabled():
        print()
        for name in dict.fromkeys(name for name, _, _ in sorted(FIGURES)):
            parts = [
                f"{FIGURES[(name, i, what)]} {what}"
                for i, what in enumerate(("sequences", "calls", "answers compared"))
            ]
            print(f"tier differential, {name}: " + ", ".join(parts))

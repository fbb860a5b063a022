"""The CPU tier's reducer, what-ifs, optimum and hit-rate curves without vLLM.

The reducer is compared with vLLM's real manager in the vLLM stage
(``tests/vllm/test_cpu_offloading_manager.py``); here: narrative scenarios with exact keys,
and properties on random workloads: the one-pass LRU curve equals per-capacity replays, the
optimum is never below LRU or ARC, and every policy's hits never decrease with capacity.
"""

from __future__ import annotations

import csv
import os
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlog import replay
from kvlog.cli import main
from kvlog.errors import InvalidEvent, NotConfigured
from kvlog.events import (
    TierConfigured,
    TierLoadPrepared,
    TierLookedUp,
    TierRequestFinished,
    TierRequestStarted,
    TierStoreCompleted,
    TierStorePrepared,
    validate_event,
)
from kvlog.reducers.cpu_tier import reduce_tier
from kvlog.tier.optimum import belady, lru_curve, opt_curve
from kvlog.tier.replay import replay_tier
from kvlog.tier.synth import synth_tier_log
from kvlog.tier.trace import TierAccess, accesses_from_log, chunk_key
from kvlog.tier.variants import TierVariant
from kvlog.tier.whatif import run_variant
from tests.support.strategies import tier_traces

K = [chunk_key(i) for i in range(8)]


def _accesses(requests: list[list[int]]) -> list[TierAccess]:
    return [
        TierAccess(f"r{i}", tuple(chunk_key(k) for k in keys)) for i, keys in enumerate(requests)
    ]


def test_lru_scenario_evicts_the_tail_of_the_oldest_request() -> None:
    """Two chunks: r0 stores K0, K1 and finishes (K0, its head, most recent); r1's K2 needs
    one chunk: the victim is K1, r0's tail, and K2 takes K1's chunk."""
    state, _ = reduce_tier(None, TierConfigured(num_chunks=2, eviction="lru"))
    reduce_tier(state, TierRequestStarted("r0", 0, [K[0], K[1]], [16, 32]))
    stored = reduce_tier(state, TierStorePrepared("r0", 0, [K[0], K[1]], True, [], [], []))[1]
    assert (stored.keys_to_store, stored.chunk_ids, stored.evicted_keys) == (
        [K[0], K[1]],
        [0, 1],
        [],
    )
    reduce_tier(state, TierStoreCompleted("r0", 0, [K[0], K[1]]))
    reduce_tier(state, TierRequestFinished("r0", 0))
    reduce_tier(state, TierRequestStarted("r1", 1, [K[2]], [16]))
    assert reduce_tier(state, TierLookedUp("r1", 1, K[1], ""))[1].result == "hit"
    answer = reduce_tier(state, TierStorePrepared("r1", 1, [K[2]], True, [], [], []))[1]
    assert (answer.keys_to_store, answer.chunk_ids, answer.evicted_keys) == ([K[2]], [1], [K[1]])
    assert reduce_tier(state, TierLookedUp("r1", 1, K[2], ""))[1].result == "hit_pending"
    assert reduce_tier(state, TierLookedUp("r1", 1, K[1], ""))[1].result == "miss"


def test_refused_calls_change_nothing() -> None:
    with pytest.raises(NotConfigured):
        reduce_tier(None, TierLookedUp("r0", 0, K[0], ""))
    state, _ = reduce_tier(None, TierConfigured(num_chunks=1, eviction="arc"))
    with pytest.raises(InvalidEvent, match="does not hold"):
        reduce_tier(state, TierLoadPrepared("r0", 0, [K[0]], []))
    assert state.num_allocated == 0 and not state.contexts
    full = reduce_tier(state, TierStorePrepared("r0", 0, [K[0], K[1]], True, [], [], []))[1]
    assert not full.accepted  # two keys, one chunk: vLLM returns None


@settings(deadline=None)
@given(requests=tier_traces(), extra=st.integers(0, 40))
def test_lru_curve_equals_per_capacity_replays(requests: list[list[int]], extra: int) -> None:
    accesses = _accesses(requests)
    largest = max(len(a.keys) for a in accesses)
    curve = lru_curve(accesses, largest + extra)
    for num_chunks in range(largest, largest + extra + 1, 3):
        replayed = run_variant(accesses, TierVariant("lru", num_chunks, keys_per_step=4))
        assert curve[num_chunks] == replayed.tally.blocks_hit, num_chunks


@settings(deadline=None)
@given(requests=tier_traces(), threshold=st.sampled_from([0, 1, 2]))
def test_optimum_never_below_lru_or_arc_and_hits_grow_with_capacity(
    requests: list[list[int]], threshold: int
) -> None:
    accesses = _accesses(requests)
    largest = max(len(a.keys) for a in accesses)
    previous = {"lru": -1, "arc": -1, "opt": -1}
    for num_chunks in range(largest, largest + 24, 2):
        hits = {
            eviction: run_variant(
                accesses, TierVariant(eviction, num_chunks, threshold, keys_per_step=4)
            ).tally.blocks_hit
            for eviction in ("lru", "arc", "opt")
        }
        assert hits["opt"] >= max(hits["lru"], hits["arc"]), (num_chunks, hits)
        for eviction in ("lru", "opt"):
            assert hits[eviction] >= previous[eviction], (eviction, num_chunks, hits)
        previous = hits


@settings(deadline=None)
@given(
    requests=tier_traces(),
    keys_per_step=st.sampled_from([1, 2, 3, 4, 16]),
    extra=st.integers(0, 30),
)
def test_opt_curve_equals_per_capacity_belady_and_grows_above_lru(
    requests: list[list[int]], keys_per_step: int, extra: int
) -> None:
    """The one-pass optimum equals belady() at every capacity from the largest store batch
    up, never decreases with capacity, and is never below LRU's curve where that one is
    exact (from the largest request up)."""
    accesses = _accesses(requests)
    largest = max(len(a.keys) for a in accesses)
    curve = opt_curve(accesses, largest + extra, keys_per_step)
    assert (curve[1:] >= curve[:-1]).all()
    assert (curve[largest:] >= lru_curve(accesses, largest + extra)[largest:]).all()
    for num_chunks in range(min(keys_per_step, largest), largest + extra + 1):
        variant = TierVariant("opt", num_chunks, keys_per_step=keys_per_step)
        assert curve[num_chunks] == belady(accesses, variant).blocks_hit, num_chunks


def test_opt_curve_scenario_protects_the_batch_and_evicts_later_batches_first() -> None:
    """Two chunks, one key a batch. r0 stores K0, K1. r1 hits K0; its first batch (K2) must
    evict: K0 (next asked by r2) is in r1's later batch, so it is stored again there and
    costs no hit (LATER, the first victim), while K1 is asked by r3: K0 goes, and the next
    batch stores it again in place of K2 (never asked). r2 hits K0, r3 hits K1: 3 hits
    (evicting K1, the farther next ask, would make 2). One chunk: only r2's K0 hits."""
    accesses = _accesses([[0, 1], [2, 0], [0], [1]])
    curve = opt_curve(accesses, 3, keys_per_step=1)
    assert curve.tolist() == [0, 1, 3, 3]
    for num_chunks in (1, 2, 3):
        variant = TierVariant("opt", num_chunks, keys_per_step=1)
        assert belady(accesses, variant).blocks_hit == curve[num_chunks]


DATA = os.path.join(os.path.dirname(__file__), "..", "data")
MOONCAKE = os.path.join(DATA, "mooncake_synthetic_trace_3601-3800.jsonl")
AZURE = os.path.join(DATA, "AzureLLMInferenceTrace_conv_head300.csv")


def test_a_synthesized_tier_log_replays_exactly_and_verifies(tmp_path: str) -> None:
    """The Mooncake slice through ``python -m kvlog.tier.synth``'s writer: the tier events
    replay to the same answers, the GPU books' replay verifies the log, the accesses come
    back, and what-ifs run on it."""
    path = os.path.join(tmp_path, "tier.kvlog")
    variant = TierVariant("arc", 64, store_threshold=2, keys_per_step=4)
    tally = synth_tier_log(MOONCAKE, path, variant, gpu_tokens=65536)
    assert tally.blocks_hit > 0 and tally.evictions > 0
    replayed = replay_tier(path)
    assert replayed.exact and replayed.lookups == tally.blocks_asked
    assert replayed.lookup_hits == tally.blocks_hit
    assert replay(path, verify=True).ok
    accesses = accesses_from_log(path)
    assert len(accesses) == tally.accesses
    again = run_variant(accesses, variant).tally
    assert (again.blocks_hit, again.blocks_stored) == (tally.blocks_hit, tally.blocks_stored)
    bigger = run_variant(accesses, TierVariant("opt", 256, keys_per_step=4)).tally
    assert bigger.blocks_hit >= again.blocks_hit


def test_a_recorded_answer_that_differs_is_named(tmp_path: str) -> None:
    events = [
        TierConfigured(num_chunks=2),
        TierRequestStarted("r0", 0),
        TierLookedUp("r0", 0, K[0], "hit"),  # the tier is empty: a miss
    ]
    out = replay_tier(events)
    assert out.mismatch is not None and out.mismatch.index == 2 and not out.exact
    assert "'hit'" in out.mismatch.recorded and "'miss'" in out.mismatch.replayed


def test_tier_events_validate() -> None:
    validate_event(TierStorePrepared("r0", 0, [K[0]], True, [K[0]], [3], []))
    for bad in (
        TierStorePrepared("r0", 0, [K[0]], True, [K[0]], [], []),  # a chunk per stored key
        TierStorePrepared("r0", 0, [K[0]], False, [K[0]], [3], []),  # refused stores nothing
        TierLookedUp("r0", 0, K[0], "maybe"),
        TierLookedUp("r0", -1, K[0], "hit"),
        TierConfigured(num_chunks=4, eviction="fifo"),
        TierRequestStarted("r0", 0, [K[0]], []),
    ):
        with pytest.raises(InvalidEvent):
            validate_event(bad)


@pytest.mark.parametrize(
    "bad",
    [
        TierLoadPrepared("r0", 0, [K[0], "k"], [1, 2]),  # type: ignore[list-item]
        TierLoadPrepared("r0", 0, [K[0], b""], [1, 2]),
        TierLoadPrepared("r0", 0, [K[0], b"x" * 1025], [1, 2]),
        TierLoadPrepared("r0", 0, [K[0], K[1]], [1, True]),
        TierLoadPrepared("r0", 0, [K[0], K[1]], [1, -2]),
        TierLoadPrepared("r0", 0, [K[0], K[1]], [1, 1 << 31]),
        TierRequestStarted("r0", 0, [K[0], K[1]], [0, 1.0]),  # type: ignore[list-item]
        TierRequestStarted("r0", 0, [K[0], K[1]], [0, -1]),
        TierRequestStarted("r\ud800", 0, [K[0]], [0]),  # not UTF-8
        TierStoreCompleted("r0", -1, [K[0]]),
    ],
    ids=repr,
)
def test_each_bad_tier_field_is_refused_where_the_whole_list_checks_pass_first(bad: Any) -> None:
    """The validators check a list in C first (types, bounds) and fall back to naming the
    first bad entry: every kind of bad entry must still be refused."""
    with pytest.raises(InvalidEvent):
        validate_event(bad)
    validate_event(TierRequestStarted("ré", 0, [K[0], K[1]], [0, 5]))  # not ASCII, fine
    validate_event(TierLoadPrepared("r0", 0, [K[0], b"x" * 1024], [0, (1 << 31) - 1]))


def test_kvlog_sweep_cpu_bytes_writes_the_csv_and_the_png(
    tmp_path: str, capsys: pytest.CaptureFixture[str]
) -> None:
    out = os.path.join(tmp_path, "sweep")
    argv = ["sweep", MOONCAKE, AZURE, "--cpu-bytes", "1GiB,4GiB", "--eviction", "lru,arc,opt"]
    argv += ["--gpu-tokens", "16384", "--serial", "--out", out]
    assert main(argv) == 0
    with open(os.path.join(out, "sweep.csv"), encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 12 and {"eviction", "cpu_bytes", "hit_rate"} <= set(rows[0])
    by = {(os.path.basename(r["log"]), r["eviction"], int(r["cpu_bytes"])): r for r in rows}
    mooncake = os.path.basename(MOONCAKE)
    for size in (1 << 30, 4 << 30):
        opt = float(by[(mooncake, "opt", size)]["hit_rate"])
        assert opt >= float(by[(mooncake, "lru", size)]["hit_rate"]) > 0
    assert float(by[(mooncake, "lru", 4 << 30)]["hit_rate"]) >= float(
        by[(mooncake, "lru", 1 << 30)]["hit_rate"]
    )
    with open(os.path.join(out, "sweep.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert main([*argv[:-2], "--eviction", "fifo", "--out", out]) == 2

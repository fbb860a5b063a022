"""Issue 31: the figures behind kvlog's metrics, live and replayed, from one definition.

- the CPU tier's miss reasons (``reducers/tier_misses.py``): every lookup is a hit or a miss
  with one reason; the explainer agrees with the what-if tally on every count they share;
  narrative scenarios pin each reason;
- the Engine's figures (``analysis/figures.py``): an observer on a live Engine and the fold
  of the log it wrote count the same;
- the payloads (``integrations/metrics.py``): increments that add up to the values, and a
  Prometheus registry fed them shows the values.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlog.analysis.figures import EngineFigures, figures_of_log
from kvlog.events import (
    CacheConfigured,
    TierConfigured,
    TierLoadPrepared,
    TierLookedUp,
    TierStoreCompleted,
    TierStorePrepared,
)
from kvlog.integrations.metrics import (
    METRICS,
    PromMetrics,
    Reporter,
    metric_values,
    payload_of,
)
from kvlog.log import read_log
from kvlog.reducers.tier_misses import MISS_REASONS, TierExplainer
from kvlog.runtime.engine import Engine
from kvlog.tier.trace import TierAccess, chunk_key
from kvlog.tier.variants import TierVariant
from kvlog.tier.whatif import run_variant
from tests.support.strategies import tier_traces

K = [chunk_key(i) for i in range(8)]


def _accesses(requests: list[list[int]]) -> list[TierAccess]:
    return [
        TierAccess(f"r{i}", tuple(chunk_key(k) for k in keys)) for i, keys in enumerate(requests)
    ]


# -- the CPU tier --------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(
    tier_traces(),
    st.integers(1, 12),
    st.sampled_from(["lru", "arc"]),
    st.sampled_from([0, 2]),
    st.integers(1, 6),
)
def test_explainer_agrees_with_the_whatif_tally(
    requests: list[list[int]], chunks: int, eviction: str, threshold: int, per_step: int
) -> None:
    """Fed the calls a what-if makes (with the reducer's answers), the explainer counts the
    same lookups, hits, evictions, refused stores and never-read chunks as the what-if's
    own tally; and every miss has exactly one reason."""
    variant = TierVariant(
        eviction=eviction, num_chunks=chunks, store_threshold=threshold, keys_per_step=per_step
    )
    explainer = TierExplainer()
    result = run_variant(_accesses(requests), variant, record=explainer.feed)
    t, f = result.tally, explainer.figures
    assert (f.lookups, f.hits) == (t.blocks_asked, t.blocks_hit)
    assert f.lookups == f.hits + sum(f.misses.values())
    assert set(f.misses) == set(MISS_REASONS)
    assert f.chunks_evicted == t.evictions
    assert f.stores_refused == t.refused_stores
    assert f.chunks_stored == t.blocks_stored
    assert f.never_read + f.unread == t.never_read
    assert f.resident <= chunks


def _store(explainer: TierExplainer, keys: list[bytes], stored: list[bytes], **kw: Any) -> None:
    explainer.feed(
        TierStorePrepared(
            "r",
            0,
            keys,
            kw.get("accepted", True),
            stored,
            list(range(len(stored))),
            kw.get("evicted", []),
        )
    )


def _miss(explainer: TierExplainer, key: bytes, result: str = "miss") -> str:
    before = dict(explainer.figures.misses)
    explainer.feed(TierLookedUp("r", 0, key, result))
    changed = [r for r in MISS_REASONS if explainer.figures.misses[r] != before[r]]
    assert len(changed) == 1, changed
    return changed[0]


def test_each_miss_reason_in_a_scenario() -> None:
    e = TierExplainer()
    e.feed(TierConfigured(num_chunks=2, store_threshold=2))
    assert _miss(e, K[0]) == "first"  # never asked before
    assert _miss(e, K[0]) == "never_stored"  # asked, never offered
    _store(e, [K[1]], [])  # offered once: under the threshold of 2
    assert _miss(e, K[1]) == "threshold"
    _store(e, [K[2]], [K[2]])
    assert _miss(e, K[2], "hit_pending") == "in_flight"
    e.feed(TierStoreCompleted("r", 0, [K[2]]))
    e.feed(TierLookedUp("r", 0, K[2], "hit"))
    _store(e, [K[3], K[4]], [K[3], K[4]], evicted=[K[2]])
    assert _miss(e, K[2]) == "evicted"
    assert e.figures.never_read == 1  # K2 left unread
    _store(e, [K[5]], [], accepted=False)
    assert _miss(e, K[5]) == "no_room"
    e.feed(TierStoreCompleted("r", 0, [K[3]], success=False))
    assert _miss(e, K[3]) == "failed"
    e.feed(TierLoadPrepared("r", 0, [K[4]], [1]))
    assert e.figures.unread == 0 and e.figures.chunks_loaded == 1
    f = e.figures
    assert f.lookups == f.hits + sum(f.misses.values()) == 8


def test_explainer_history_is_bounded() -> None:
    e = TierExplainer()
    e.feed(TierConfigured(num_chunks=1))
    for i in range(70_000):
        e.feed(TierLookedUp("r", 0, i.to_bytes(8, "big"), "miss"))
    assert e.figures.misses["first"] == 70_000
    # the oldest keys were forgotten: asked again, they read as first misses once more
    assert _miss(e, (0).to_bytes(8, "big")) == "first"
    assert _miss(e, (69_999).to_bytes(8, "big")) == "never_stored"


# -- the Engine ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def synth_log(tmp_path_factory: pytest.TempPathFactory) -> str:
    from kvlog.cli import main

    path = str(tmp_path_factory.mktemp("fig") / "a.kvlog")
    argv = ["synth", "--out", path, "--steps", "300", "--num-cpu-blocks", "64"]
    assert main([*argv, "--failure-rate", "0.05"]) == 0
    return path


def _rerun(log: str, out: str, figures: EngineFigures) -> Engine:
    records = [r for _, r in read_log(log)]
    assert type(records[0]) is CacheConfigured
    engine = Engine(records[0], log_path=out)
    engine.machine.observers.append(figures)
    for record in records[1:]:
        if type(record).__name__ not in ("Checkpoint", "LogDetached"):
            engine.apply(record)
    return engine


def test_live_figures_equal_the_replay_of_their_log(synth_log: str, tmp_path: Any) -> None:
    live = EngineFigures()
    engine = _rerun(synth_log, str(tmp_path / "b.kvlog"), live)
    gauges = live.gauges(engine.state)
    engine.close()
    replayed = figures_of_log(str(tmp_path / "b.kvlog"))
    assert live.counters() == replayed.figures.counters()
    assert gauges == replayed.gauges
    counters = live.counters()
    assert counters["defrag_pairs"] > 0 and counters["transfer_jobs"]["store"] > 0  # type: ignore[index]
    assert counters["transfer_failures"]["store"] > 0  # type: ignore[index]
    assert replayed.figures.steps == 300


# -- payloads and Prometheus ---------------------------------------------------------------
def test_payload_increments_add_up_and_a_registry_shows_the_values(
    synth_log: str, tmp_path: Any
) -> None:
    from prometheus_client import CollectorRegistry, Counter, Gauge

    registry = CollectorRegistry()

    class C(Counter):  # type: ignore[misc]
        def __init__(self, *a: Any, **k: Any) -> None:
            super().__init__(*a, registry=registry, **k)

    class G(Gauge):  # type: ignore[misc]
        def __init__(self, *a: Any, **k: Any) -> None:
            super().__init__(*a, registry=registry, **k)

    prom = PromMetrics({Counter: C, Gauge: G}, ["engine"], {0: ["0"]})
    figures = EngineFigures()
    records = [r for _, r in read_log(synth_log)]
    engine = Engine(records[0], log_path=str(tmp_path / "c.kvlog"))
    engine.machine.observers.append(figures)
    reporter = Reporter(interval_s=0.0)
    reporter.watch_engine(engine, figures)
    for n, record in enumerate(records[1:]):
        if type(record).__name__ in ("Checkpoint", "LogDetached"):
            continue
        engine.apply(record)
        if n % 7 == 0:
            payload = reporter.take()
            if payload is not None:
                prom.observe(payload, 0)
    payload = reporter.take(force=True)
    if payload is not None:
        prom.observe(payload, 0)
    want = metric_values(figures, figures.gauges(engine.state))
    engine.close()
    for name, series in want.items():
        for labels, value in series.items():
            label_map = {"engine": "0", **dict(zip(METRICS[name].labels, labels, strict=True))}
            got = registry.get_sample_value(name, label_map)
            assert got == pytest.approx(value), (name, labels)
    assert os.path.getsize(str(tmp_path / "c.kvlog")) > 0


def test_payload_of_leaves_out_unchanged_counters() -> None:
    before = {"kvlog_steps_total": {(): 5}, "kvlog_kv_used_blocks": {(): 3}}
    now = {"kvlog_steps_total": {(): 5}, "kvlog_kv_used_blocks": {(): 3}}
    payload = payload_of(now, before)
    assert "kvlog_steps_total" not in payload["data"]
    assert payload["data"]["kvlog_kv_used_blocks"] == {(): 3}
    now["kvlog_steps_total"] = {(): 9}
    assert payload_of(now, before)["data"]["kvlog_steps_total"] == {(): 4}


def test_every_metric_follows_the_conventions() -> None:
    for name, d in METRICS.items():
        assert name.startswith("kvlog_")
        assert name.endswith("_total") == (d.kind == "counter"), name
        assert set(d.labels) <= {"direction", "reason", "log"}

"""The plain vLLM worker the harness times beside kvlog's connector (``harness.shadow``):
it gets every job kvlog's connector gets, on metadata of its own; its time is its own (not
kvlog's, not the scheduler's); its failure ends the shadow, never the run; and the table's
ratio, kvlog's calls over the plugin's defragmenter plus that worker, is what it says."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "vllm", reason="vLLM is not installed here: the vLLM stages run this module in their venvs"
)

from tests import vllm_harness as harness
from tests.vllm.harness import kvcache
from tests.vllm.harness.results import baseline_summary
from tests.vllm.harness.shadow import NOTE, own_metadata

SMALL = dataclasses.replace(harness.CONFIGS["nopc-bpc1-async"], num_requests=40)
"""A short run of a main configuration (sync scheduling: every step's output is in)."""


def test_own_metadata_keeps_each_connectors_pops_to_itself() -> None:
    """vLLM's ``handle_preemptions`` pops ``jobs_to_flush`` out of ``store_jobs``: the
    shadow's copy and the scheduler's metadata must not see each other's pops."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingConnectorMetadata,
    )

    meta = OffloadingConnectorMetadata(
        load_jobs={3: "load"}, store_jobs={1: "a", 2: "b"}, jobs_to_flush={1}
    )
    twin = own_metadata(meta)
    assert type(twin) is type(meta) and twin.store_jobs == meta.store_jobs
    twin.store_jobs.pop(1)
    twin.load_jobs.clear()
    twin.jobs_to_flush.add(2)
    assert meta.store_jobs == {1: "a", 2: "b"} and meta.load_jobs == {3: "load"}
    assert meta.jobs_to_flush == {1}
    meta.store_jobs.pop(2)
    assert twin.store_jobs == {2: "b"}


def _counting(
    monkeypatch: pytest.MonkeyPatch, delay: float = 0.0, budget: int = 0
) -> dict[str, float]:
    """Count the plain worker's copies; the first ``budget`` of them sleep ``delay``."""
    counts: dict[str, float] = {"store": 0, "load": 0, "slept": 0.0}
    copy = kvcache.ReferenceWorker._copy

    def counted(self: Any, job_id: int, spec: Any, ids: Any, store: bool) -> bool:
        counts["store" if store else "load"] += 1
        if counts["store"] + counts["load"] <= budget:
            t0 = time.perf_counter()
            time.sleep(delay)
            counts["slept"] += time.perf_counter() - t0
        return copy(self, job_id, spec, ids, store)

    monkeypatch.setattr(kvcache.ReferenceWorker, "_copy", counted)
    return counts


def test_the_plain_worker_gets_every_job_and_its_time_is_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every store and load kvlog's connector is given, the plain worker copies (its own
    tensors: the canary checks stay clean); 2 s of sleep in its copies lands in
    ``plain_s`` and in neither kvlog's time nor the scheduler's."""
    counts = _counting(monkeypatch, delay=0.04, budget=50)
    res = harness.run_config(SMALL, str(tmp_path))
    assert res.ok, res.summary()
    assert NOTE not in res.details, res.details
    assert counts["store"] == res.stores == res.stores_done > 0
    assert counts["load"] == res.loads_async + res.loads_sync == res.loads_done > 0
    assert counts["slept"] >= 2.0
    assert res.plain_s >= counts["slept"]
    assert res.kvlog_s < 1.0 and res.sched_s < 1.0, (res.kvlog_s, res.sched_s)
    assert res.baseline_s == pytest.approx(res.seed_s + res.plain_s)
    assert res.over_baseline == pytest.approx(res.kvlog_s / (res.seed_s + res.plain_s))


def test_a_failing_plain_worker_ends_the_shadow_not_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: Any, **kwargs: Any) -> bool:
        raise RuntimeError("the plain worker's own limit")

    monkeypatch.setattr(kvcache.ReferenceWorker, "submit_load", refuse)
    res = harness.run_config(SMALL, str(tmp_path))
    assert res.ok, res.summary()
    assert res.loads_done > 0 and res.seed_s > 0
    assert res.plain_s == 0.0 and "the plain worker's own limit" in res.details[NOTE][0]
    assert res.baseline_s is None and res.over_baseline is None
    assert f"{SMALL.name} " not in "\n".join(baseline_summary([res]))


def _result(name: str, kvlog: float, seed: float, plain: float, **cfg: Any) -> Any:
    res = harness.RunResult(dataclasses.replace(harness.CONFIGS[name], **cfg))
    res.steps, res.kvlog_s, res.seed_s, res.plain_s = 100, kvlog, seed, plain
    return res


def test_the_summary_gives_each_ratio_and_the_main_configurations_median_and_max() -> None:
    main = [c.name for c in harness.CI_MATRIX[:12]]
    at_default = [n for n in main if harness.CONFIGS[n].log_sync == "background"]
    at_step = [n for n in main if harness.CONFIGS[n].log_sync != "background"]
    results = [_result(n, 1.0 + i, 1.0, 1.0) for i, n in enumerate(at_default[:3])]
    results.append(_result(at_step[0], 9.0, 1.0, 1.0))
    results.append(_result("defrag-off-nopc-bpc2", 3.0, 0.0, 2.0))  # no seed: plain only
    stopped = _result(at_default[3], 100.0, 1.0, 1.0)
    stopped.note("seed shadow", "stopped")
    results.append(stopped)
    lines = baseline_summary(results)
    assert f"{at_default[0]} 0.50" in lines[0] and f"{at_default[2]} 1.50" in lines[0]
    assert "defrag-off-nopc-bpc2 1.50" in lines[0] and at_default[3] not in lines[0]
    assert lines[1].startswith("kvlog's calls / (seed + plain worker) over the 3 main")
    assert "median 1.00, max 1.50" in lines[1] and "1: max 4.50" in lines[1]
    assert "median 1.00, max 1.50" in harness.cost_summary(results)

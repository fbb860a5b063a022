"""Issue 31 in the real-vLLM harness: kvlog's metrics through vLLM's own stats path.

A harness run (vLLM's scheduler and offloading connector flow, kvlog's connector and
defragmenter, the fake Gaudi runner) with the runner handing the worker connector's stats in
``KVConnectorOutput.kv_connector_stats`` as vLLM's GPU runner does. Every payload vLLM's
scheduler builds (``update_from_output``: the workers' stats aggregated with the scheduler
connector's, the ``kv_connector_stats`` of ``make_stats``) is observed by vLLM's own
``KVConnectorProm`` (``build_prom_metrics``) into a private registry, and fed to vLLM's
``KVConnectorLogging`` (the "KV Transfer metrics" line). After the run, a scrape of that
registry shows every ``kvlog_`` metric with the value the replay of the run's logs computes
(the worker's log folded with ``EngineFigures``, the scheduler's tier log with
``TierExplainer``), but the few that are measurements of the live process (time, ages in
seconds, disk bytes, lag), which are checked for sanity instead.

Runs only where vLLM is installed (the vLLM stage).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "vllm",
    minversion="0.26",
    reason="vLLM is not installed here: the vLLM stage runs this module in its own venv",
)

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvlog.analysis.figures import figures_of_log
from kvlog.integrations.metrics import LOGS, METRICS, metric_values, recorder_figures
from kvlog.log import LogStatus
from kvlog.reducers.tier_misses import TierExplainer
from kvlog.tier.replay import tier_events
from tests import vllm_harness as harness

LIVE_ONLY = {
    "kvlog_transfer_seconds_total",
    "kvlog_transfer_finished_bytes_total",
    "kvlog_transfer_oldest_job_age_seconds",
    "kvlog_recorder_log_bytes",
    "kvlog_recorder_lag_seconds",
}
"""Measurements of the live process, not in the log (checked for sanity, not equality)."""


def _registry_types(registry: CollectorRegistry) -> dict[type, type]:
    def bound(base: type) -> type:
        class Bound(base):  # type: ignore[misc, valid-type]
            def __init__(self, *a: Any, **k: Any) -> None:
                super().__init__(*a, registry=registry, **k)

        return Bound

    return {Gauge: bound(Gauge), Counter: bound(Counter), Histogram: bound(Histogram)}


class MetricsRun(harness.Run):
    """A harness run whose runner hands the worker connector's stats to the scheduler,
    and whose scheduler stats go to vLLM's Prometheus and logging objects."""

    def __init__(self, cfg: harness.RunConfig, workdir: str) -> None:
        super().__init__(cfg, workdir)
        self.registry = CollectorRegistry()
        self.payloads = 0
        self.lines: list[str] = []

    def _setup(self) -> None:
        super()._setup()
        from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
            KVConnectorLogging,
            KVConnectorProm,
        )

        types = _registry_types(self.registry)
        prom_cls = type(
            "Prom",
            (KVConnectorProm,),
            {"_gauge_cls": types[Gauge], "_counter_cls": types[Counter],
             "_histogram_cls": types[Histogram]},
        )  # fmt: skip
        self.prom = prom_cls(self.vllm_config, ["engine"], {0: ["0"]})
        self.logging = KVConnectorLogging(self.vllm_config.kv_transfer_config)
        make_stats = self.scheduler.make_stats
        signature = inspect.signature(make_stats)

        def capture(*args: Any, **kwargs: Any) -> Any:
            stats = signature.bind(*args, **kwargs).arguments.get("kv_connector_stats")
            if stats is not None and not stats.is_empty():
                self.observe(stats)
            return make_stats(*args, **kwargs)

        self.scheduler.make_stats = capture

    def observe(self, stats: Any) -> None:
        data = stats.to_dict() if hasattr(stats, "to_dict") else stats.data
        self.payloads += 1
        self.prom.observe(data, 0)
        self.logging.observe(data)
        if self.payloads % 50 == 0:
            self.logging.log(log_fn=lambda fmt, *a: self.lines.append(fmt % a))

    def _runner_output(self, so: Any, sampled: dict[str, list[int]], kv_output: Any) -> Any:
        if kv_output is not None:  # vLLM's GPU runner: the worker connector's stats
            kv_output.kv_connector_stats = self.connector.get_kv_connector_stats()
        return super()._runner_output(so, sampled, kv_output)

    def final_payload(self) -> None:
        """After the run (both sides shut down, the logs closed): the last change, as the
        scheduler would aggregate it, so the scrape covers the whole logs."""
        worker = self.connector.get_kv_connector_stats()
        scheduler = self.scheduler.connector.get_kv_connector_stats()
        parts = [s for s in (worker, scheduler) if s is not None and not s.is_empty()]
        if parts:
            total = parts[0]
            for part in parts[1:]:
                total = total.aggregate(part)
            self.observe(total)


def _scrape(registry: CollectorRegistry) -> dict[str, dict[tuple[str, ...], float]]:
    out: dict[str, dict[tuple[str, ...], float]] = {}
    for family in registry.collect():
        for sample in family.samples:
            if not sample.name.startswith("kvlog_") or sample.name.endswith("_created"):
                continue
            d = METRICS[sample.name]
            key = tuple(sample.labels[label] for label in d.labels)
            out.setdefault(sample.name, {})[key] = sample.value
    return out


def _replayed(log_path: str, scheduler_log: str, live_checkpoints: int) -> dict[str, Any]:
    fold = figures_of_log(log_path)
    explainer = TierExplainer()
    for event in tier_events(scheduler_log):
        explainer.feed(event)
    tier_fold = figures_of_log(scheduler_log)
    recorders = {
        "worker": recorder_figures(LogStatus(log_path, True, last_seq=fold.last_seq),
                                   fold.checkpoints, disk=True),
        "scheduler": recorder_figures(LogStatus(scheduler_log, True, last_seq=tier_fold.last_seq),
                                      tier_fold.checkpoints, disk=True),
    }  # fmt: skip
    return metric_values(fold.figures, fold.gauges, explainer, recorders)


@pytest.mark.parametrize("name", ["pc-bpc2-async", "nopc-bpc1-sync"])
def test_scrape_equals_the_replay_of_the_logs(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVLOG_METRICS_INTERVAL_S", "0")
    cfg = dataclasses.replace(harness.CONFIGS[name], num_requests=60)
    run = MetricsRun(cfg, str(tmp_path))
    result = run.execute()
    assert result.ok, result.summary()
    run.final_payload()
    scraped = _scrape(run.registry)
    from kvlog.integrations.vllm import scheduler_log_path

    want = _replayed(run.log_path, scheduler_log_path(run.log_path), 0)
    assert set(scraped) == set(METRICS), set(METRICS) ^ set(scraped)
    for metric, series in want.items():
        if metric in LIVE_ONLY:
            continue
        for labels, value in series.items():
            assert scraped[metric][labels] == pytest.approx(value), (metric, labels)
    # the run exercised what the metrics count
    assert want["kvlog_defrag_pairs_total"][()] > 0
    assert want["kvlog_cpu_tier_lookups_total"][()] > 0
    assert sum(want["kvlog_cpu_tier_misses_total"].values()) > 0
    assert want["kvlog_transfer_jobs_total"][("store",)] > 0
    assert scraped["kvlog_transfer_seconds_total"][("store",)] > 0
    assert all(scraped["kvlog_recorder_attached"][(log,)] == 1 for log in LOGS)
    assert run.lines and "kvlog_defrag_pairs_total=" in " ".join(run.lines)
    # vLLM's own offloading metrics still arrive next to kvlog's
    names = {f.name for f in run.registry.collect()}
    assert any(n.startswith("vllm:kv_offload") for n in names)
    logging.getLogger(__name__).info("payloads %d", run.payloads)

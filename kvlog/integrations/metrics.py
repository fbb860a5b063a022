"""kvlog's figures as Prometheus metrics, through vLLM's own connector stats path.

Every metric is named ``kvlog_...`` and follows Prometheus conventions: counters end in
``_total``, units are ``_bytes`` / ``_seconds``, labels take bounded values only
(``direction``: store, load; ``reason``: ``tier_misses.MISS_REASONS``; ``log``: worker,
scheduler). :data:`METRICS` defines them (the way an offloading spec's
``build_metric_definitions`` does): defrag, transfers, the CPU tier, the recorder.

How they travel (vLLM 0.33; the other versions through ``kvlog.integrations.vllm``):

- a :class:`Reporter` folds one Engine's figures (an :class:`EngineFigures` observer on its
  machine, attached before the first step), the CPU tier's (a :class:`TierExplainer` fed the
  events the tier recorder logs) and the recorder's, and ``take()`` hands the change since
  its last payload as vLLM's offloading stats payload (``{"types", "data", "info"}``:
  counters as increments, gauges as values), at most once per ``interval_s`` (a detach
  right away, the next step);
- ``KvlogOffloadingConnector.get_kv_connector_stats`` returns it on the worker (vLLM sums
  the TP workers' payloads) and merges it into vLLM's own on the scheduler; vLLM's
  ``OffloadingConnectorStats`` aggregates it, its periodic "KV Transfer metrics" line shows
  it, and :class:`PromMetrics` (``build_prom_metrics``) records it into vLLM's registry,
  handing vLLM's own keys to vLLM's ``OffloadPromMetrics``;
- a defragmenter without kvlog's connector reports through :class:`MultiprocessExporter`:
  the ``prometheus_client`` multiprocess files under ``PROMETHEUS_MULTIPROC_DIR`` that
  vLLM's ``/metrics`` collects (``docs/operators.md`` says why).

No vLLM import here: the prometheus metric classes come from vLLM's ``metric_types``.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvlog.analysis.figures import DIRECTIONS, EngineFigures, EngineGauges
from kvlog.log import LogStatus, is_log_directory, list_segments
from kvlog.log.manifest import log_num_bytes
from kvlog.reducers.tier_misses import MISS_REASONS, TierExplainer

__all__ = [
    "DEFAULT_INTERVAL_S",
    "DISK_EVERY_S",
    "LABEL_VALUES",
    "LOGS",
    "METRICS",
    "MetricDef",
    "MultiprocessExporter",
    "PromMetrics",
    "Reporter",
    "RecorderFigures",
    "metric_values",
    "process_exporter",
    "metrics_enabled",
    "payload_of",
    "disk_figures",
    "recorder_figures",
]

DISK_EVERY_S = 10.0
"""How often a reporter reads a log's bytes and segments from the disk."""
DEFAULT_INTERVAL_S = 1.0
"""How often a reporter hands a payload (``KVLOG_METRICS_INTERVAL_S``): a scrape or vLLM's
log line (every 10 s by default) never needs more; 0 hands one every step."""

COUNTER, GAUGE = "counter", "gauge"
LOGS: tuple[str, str] = ("worker", "scheduler")
LABEL_VALUES: dict[str, tuple[str, ...]] = {
    "direction": DIRECTIONS,
    "reason": MISS_REASONS,
    "log": LOGS,
}
"""Every value each label takes (bounded: no request id, no path)."""


@dataclass(frozen=True)
class MetricDef:
    """One metric: its name, kind, help text and label names (after vLLM's own)."""

    name: str
    kind: str
    doc: str
    labels: tuple[str, ...] = ()


def _c(name: str, doc: str, *labels: str) -> MetricDef:
    return MetricDef(name, COUNTER, doc, labels)


def _g(name: str, doc: str, *labels: str) -> MetricDef:
    return MetricDef(name, GAUGE, doc, labels)


_DEFS = (
    _c("kvlog_steps_total", "Scheduler steps kvlog's Engine ended."),
    _c("kvlog_defrag_steps_total", "Steps on which the defragmenter moved blocks."),
    _c("kvlog_defrag_pairs_total", "Block pairs the defragmenter moved."),
    _c("kvlog_defrag_moved_bytes_total", "Bytes the defragmenter copied (swaps count twice)."),
    _c("kvlog_defrag_padded_pairs_total", "Pairs the padded swaps executed (moved + padding)."),
    _g("kvlog_kv_used_blocks", "Accelerator KV blocks in use."),
    _g("kvlog_kv_highest_used_block", "Highest physical KV block id in use (-1: none)."),
    _g("kvlog_kv_fragmentation_ratio", "Highest used block id over used blocks (1: compact)."),
    _c("kvlog_transfer_jobs_total", "Transfer jobs planned.", "direction"),
    _c("kvlog_transfer_bytes_total", "Bytes of the transfer jobs planned.", "direction"),
    _c("kvlog_transfer_failures_total", "Transfer jobs that finished failed.", "direction"),
    _c("kvlog_transfer_seconds_total", "Time the finished transfers took.", "direction"),
    _c("kvlog_transfer_finished_bytes_total", "Bytes of the finished transfers.", "direction"),
    _g("kvlog_transfer_jobs_in_flight", "Transfer jobs not finished.", "direction"),
    _g("kvlog_transfer_oldest_job_age_steps", "Steps since the oldest unfinished job began."),
    _g("kvlog_transfer_oldest_job_age_seconds", "Seconds since the oldest unfinished job began."),
    _g("kvlog_transfer_pinned_blocks", "KV blocks unfinished transfers pin (defrag skips them)."),
    _g("kvlog_transfer_held_blocks", "KV blocks held for loads their request has not claimed."),
    _c("kvlog_cpu_tier_lookups_total", "CPU tier lookups (vLLM's offloading manager)."),
    _c("kvlog_cpu_tier_hits_total", "CPU tier lookups that hit a ready chunk."),
    _c("kvlog_cpu_tier_misses_total", "CPU tier lookups that missed, by reason.", "reason"),
    _c("kvlog_cpu_tier_stored_chunks_total", "Chunks the CPU tier accepted to store."),
    _c("kvlog_cpu_tier_loaded_chunks_total", "Chunks loaded from the CPU tier."),
    _c("kvlog_cpu_tier_evicted_chunks_total", "Chunks the CPU tier evicted for room."),
    _c("kvlog_cpu_tier_refused_stores_total", "Store offers refused for lack of room."),
    _c("kvlog_cpu_tier_never_read_chunks_total", "Stored chunks that left the tier unread."),
    _g("kvlog_cpu_tier_resident_chunks", "Chunks the CPU tier holds."),
    _g("kvlog_cpu_tier_unread_chunks", "Chunks the CPU tier holds that no load read yet."),
    _c("kvlog_recorder_records_total", "Records the recorder appended to its log.", "log"),
    _c("kvlog_recorder_checkpoints_total", "Checkpoint records the recorder wrote.", "log"),
    _g("kvlog_recorder_log_bytes", "Bytes the log takes on disk (its retained segments).", "log"),
    _g("kvlog_recorder_segments", "Segments of a log directory (1 for a file).", "log"),
    _g("kvlog_recorder_lag_seconds", "Age of the oldest record not yet fsynced.", "log"),
    _g("kvlog_recorder_attached", "1 while the recorder writes its log, 0 once detached.", "log"),
    _g("kvlog_recorder_errno", "errno of the I/O error the recorder detached on (0: none).", "log"),
)
METRICS: dict[str, MetricDef] = {d.name: d for d in _DEFS}


def metrics_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the facades keep figures for the metrics (``KVLOG_METRICS=0``: no)."""
    return (os.environ if environ is None else environ).get("KVLOG_METRICS", "1") != "0"


# -- the recorder ------------------------------------------------------------------------
@dataclass(frozen=True)
class RecorderFigures:
    """Where one log's recorder stands (``recorder_figures``); ``log_bytes`` and
    ``segments`` are -1 until read from the disk (``disk_figures``)."""

    path: str | None = None
    records: int = 0
    checkpoints: int = 0
    log_bytes: int = -1
    segments: int = -1
    lag_s: float = 0.0
    attached: bool = False
    errno: int = 0


def disk_figures(path: str | None) -> tuple[int, int]:
    """The bytes and segments a log takes on disk (a stat per segment, the manifest of a
    directory: ~0.2 ms, so a reporter reads them every ``DISK_EVERY_S``); (0, 0) where
    there is no log or it cannot be read."""
    if path is None:
        return 0, 0
    try:
        segments = len(list_segments(path)) if is_log_directory(path) else 1
        return log_num_bytes(path), segments
    except OSError:
        return 0, 0


def recorder_figures(
    status: LogStatus,
    checkpoints: int = 0,
    lag_s: float = 0.0,
    records: int = -1,
    *,
    disk: bool = False,
) -> RecorderFigures:
    """A recorder's figures from its status and what its Engine counts (``records``: -1
    for the status's last sequence number + 1); with ``disk``, its bytes and segments too."""
    if records < 0:
        records = status.last_seq + 1
    log_bytes, segments = disk_figures(status.path) if disk else (-1, -1)
    return RecorderFigures(
        status.path, records, checkpoints, log_bytes, segments, lag_s, status.attached,
        status.errno,
    )  # fmt: skip


# -- payloads ------------------------------------------------------------------------------
Values = dict[str, dict[tuple[str, ...], float]]
"""Metric name -> label values -> value (cumulative for counters)."""


def _engine_values(figures: EngineFigures, gauges: EngineGauges, out: Values) -> None:
    out["kvlog_steps_total"] = {(): figures.steps}
    out["kvlog_defrag_steps_total"] = {(): figures.defrag_steps}
    out["kvlog_defrag_pairs_total"] = {(): figures.defrag_pairs}
    out["kvlog_defrag_moved_bytes_total"] = {(): figures.defrag_bytes}
    out["kvlog_defrag_padded_pairs_total"] = {(): figures.padded_pairs}
    out["kvlog_kv_used_blocks"] = {(): gauges.used_blocks}
    out["kvlog_kv_highest_used_block"] = {(): gauges.highest_used_id}
    out["kvlog_kv_fragmentation_ratio"] = {(): round(gauges.fragmentation, 6)}
    out["kvlog_transfer_jobs_total"] = {(d,): figures.transfer_jobs[d] for d in DIRECTIONS}
    out["kvlog_transfer_bytes_total"] = {(d,): figures.transfer_bytes[d] for d in DIRECTIONS}
    out["kvlog_transfer_failures_total"] = {(d,): figures.transfer_failures[d] for d in DIRECTIONS}
    out["kvlog_transfer_jobs_in_flight"] = {(d,): gauges.jobs_in_flight[d] for d in DIRECTIONS}
    out["kvlog_transfer_oldest_job_age_steps"] = {(): gauges.oldest_job_age_steps}
    out["kvlog_transfer_oldest_job_age_seconds"] = {(): round(gauges.oldest_job_age_seconds, 6)}
    out["kvlog_transfer_pinned_blocks"] = {(): gauges.pinned_blocks}
    out["kvlog_transfer_held_blocks"] = {(): gauges.held_blocks}


def _tier_values(explainer: TierExplainer, out: Values) -> None:
    t = explainer.figures
    out["kvlog_cpu_tier_lookups_total"] = {(): t.lookups}
    out["kvlog_cpu_tier_hits_total"] = {(): t.hits}
    out["kvlog_cpu_tier_misses_total"] = {(r,): t.misses[r] for r in MISS_REASONS}
    out["kvlog_cpu_tier_stored_chunks_total"] = {(): t.chunks_stored}
    out["kvlog_cpu_tier_loaded_chunks_total"] = {(): t.chunks_loaded}
    out["kvlog_cpu_tier_evicted_chunks_total"] = {(): t.chunks_evicted}
    out["kvlog_cpu_tier_refused_stores_total"] = {(): t.stores_refused}
    out["kvlog_cpu_tier_never_read_chunks_total"] = {(): t.never_read}
    out["kvlog_cpu_tier_resident_chunks"] = {(): t.resident}
    out["kvlog_cpu_tier_unread_chunks"] = {(): t.unread}


def _recorder_values(log: str, rec: RecorderFigures, out: Values) -> None:
    key = (log,)
    out.setdefault("kvlog_recorder_records_total", {})[key] = rec.records
    out.setdefault("kvlog_recorder_checkpoints_total", {})[key] = rec.checkpoints
    out.setdefault("kvlog_recorder_log_bytes", {})[key] = max(0, rec.log_bytes)
    out.setdefault("kvlog_recorder_segments", {})[key] = max(0, rec.segments)
    out.setdefault("kvlog_recorder_lag_seconds", {})[key] = round(rec.lag_s, 6)
    out.setdefault("kvlog_recorder_attached", {})[key] = int(rec.attached)
    out.setdefault("kvlog_recorder_errno", {})[key] = rec.errno


def metric_values(
    figures: EngineFigures | None = None,
    gauges: EngineGauges | None = None,
    explainer: TierExplainer | None = None,
    recorders: Mapping[str, RecorderFigures] | None = None,
) -> Values:
    """Every metric's cumulative value from these sources (what a scrape shows after
    every payload was observed): the one mapping live payloads and replays both use."""
    out: Values = {}
    if figures is not None:
        _engine_values(figures, gauges if gauges is not None else EngineGauges(), out)
    if explainer is not None:
        _tier_values(explainer, out)
    for log, rec in (recorders or {}).items():
        _recorder_values(log, rec, out)
    return out


def payload_of(now: Values, before: Values) -> dict[str, Any]:
    """vLLM's offloading stats payload for the change from ``before`` to ``now``: counters
    as increments (a zero one left out), gauges as values."""
    types: dict[str, str] = {}
    data: dict[str, dict[tuple[str, ...], float]] = {}
    for name, series in now.items():
        kind = METRICS[name].kind
        last = before.get(name, {})
        if kind == COUNTER:
            values = {k: v - last.get(k, 0) for k, v in series.items() if v != last.get(k, 0)}
        else:
            values = dict(series)
        if values:
            types[name] = kind
            data[name] = values
    return {"types": types, "data": data}


# -- the reporter --------------------------------------------------------------------------
class Reporter:
    """One process's side of the metrics (module docstring): an Engine's figures (worker),
    the CPU tier's (scheduler), each recorder's; ``take()`` the payload when one is due."""

    def __init__(
        self, interval_s: float | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if interval_s is None:
            interval_s = float(os.environ.get("KVLOG_METRICS_INTERVAL_S", DEFAULT_INTERVAL_S))
        self.interval_s = interval_s
        self.clock = clock
        self.figures: EngineFigures | None = None
        self.engine: Any = None
        self.explainer: TierExplainer | None = None
        self.recorders: dict[str, Callable[[], RecorderFigures]] = {}
        self._attached: dict[str, Callable[[], bool]] = {}
        self._was_attached: dict[str, bool] = {}
        self._sent: Values = {}
        self._next = 0.0
        self._finished: dict[str, list[float]] = {d: [0, 0.0] for d in DIRECTIONS}
        self._disk: dict[str, tuple[float, tuple[int, int]]] = {}
        """Per log: when its disk figures were read, and what they were."""
        """Finished transfers' bytes and seconds, per direction (``note_finished``)."""

    def watch_engine(self, engine: Any, figures: EngineFigures) -> None:
        """Report this Engine's figures (the observer is on its machine already)."""
        self.engine, self.figures = engine, figures

    def watch_tier(self, explainer: TierExplainer) -> None:
        self.explainer = explainer

    def watch_recorder(
        self, log: str, figures: Callable[[], RecorderFigures], attached: Callable[[], bool]
    ) -> None:
        """Report a recorder as ``log`` (worker, scheduler); ``attached`` is asked every
        step (it must be cheap): a detach makes the next ``take`` hand a payload."""
        self.recorders[log] = figures
        self._attached[log] = attached
        self._was_attached[log] = True

    def note_finished(self, direction: str, num_bytes: int, seconds: float) -> None:
        """A transfer finished (the executor's figures: not in the log)."""
        done = self._finished[direction]
        done[0] += num_bytes
        done[1] += seconds

    def due(self) -> bool:
        """Whether ``take`` hands a payload now: the interval passed, or a recorder detached."""
        for log, attached in self._attached.items():
            if attached() != self._was_attached[log]:
                return True
        return self.clock() >= self._next

    def values(self) -> Values:
        """Every metric's cumulative value now."""
        gauges = None
        if self.figures is not None and self.engine is not None:
            gauges = self.figures.gauges(self.engine.state)
        recorders = {
            log: self._with_disk(log, figures()) for log, figures in self.recorders.items()
        }
        out = metric_values(self.figures, gauges, self.explainer, recorders)
        if self.figures is not None:
            out["kvlog_transfer_finished_bytes_total"] = {
                (d,): self._finished[d][0] for d in DIRECTIONS
            }
            out["kvlog_transfer_seconds_total"] = {
                (d,): round(self._finished[d][1], 9) for d in DIRECTIONS
            }
        return out

    def _with_disk(self, log: str, rec: RecorderFigures) -> RecorderFigures:
        if rec.log_bytes >= 0:
            return rec
        now = self.clock()
        read = self._disk.get(log)
        if read is None or now - read[0] >= DISK_EVERY_S:
            read = self._disk[log] = (now, disk_figures(rec.path))
        log_bytes, segments = read[1]
        return dataclasses.replace(rec, log_bytes=log_bytes, segments=segments)

    def take(self, force: bool = False) -> dict[str, Any] | None:
        """The payload of what changed since the last one, when due (or ``force``)."""
        if not force and not self.due():
            return None
        self._next = self.clock() + self.interval_s
        for log, attached in self._attached.items():
            self._was_attached[log] = attached()
        now = self.values()
        payload = payload_of(now, self._sent)
        self._sent = now
        return payload if payload["data"] else None


# -- Prometheus ----------------------------------------------------------------------------
class PromMetrics:
    """kvlog's metrics in vLLM's registry (``build_prom_metrics``): records the ``kvlog_``
    keys of a stats payload and hands the rest to ``inner`` (vLLM's own
    ``OffloadPromMetrics``), if any. ``metric_types`` maps prometheus_client's Gauge and
    Counter to the classes vLLM wants used (its multiprocess-aware ones)."""

    def __init__(
        self,
        metric_types: Mapping[type, type],
        labelnames: Sequence[str],
        per_engine_labelvalues: Mapping[int, Sequence[object]],
        inner: Any = None,
    ) -> None:
        from prometheus_client import Counter, Gauge

        self.inner = inner
        self.per_engine_labelvalues = {k: list(v) for k, v in per_engine_labelvalues.items()}
        self._metrics: dict[str, Any] = {}
        self._children: dict[tuple[int, str, tuple[str, ...]], Any] = {}
        for d in METRICS.values():
            labels = [*labelnames, *d.labels]
            if d.kind == COUNTER:
                metric = metric_types.get(Counter, Counter)(d.name, d.doc, labelnames=labels)
            else:
                metric = metric_types.get(Gauge, Gauge)(
                    d.name, d.doc, labelnames=labels, multiprocess_mode="mostrecent"
                )
            self._metrics[d.name] = metric
        for engine_idx in self.per_engine_labelvalues:  # every series shows, 0 included
            for d in METRICS.values():
                for values in itertools.product(*(LABEL_VALUES[label] for label in d.labels)):
                    self._child(engine_idx, d.name, tuple(values))

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        data = transfer_stats_data.get("data", {})
        types = transfer_stats_data.get("types", {})
        ours = [name for name in data if name in METRICS]
        for name in ours:
            for labelvalues, value in data[name].items():
                child = self._child(engine_idx, name, tuple(labelvalues))
                if types.get(name, METRICS[name].kind) == COUNTER:
                    if value > 0:
                        child.inc(value)
                else:
                    child.set(value)
        if self.inner is None:
            return
        if ours:
            rest = {k: v for k, v in data.items() if k not in METRICS}
            transfer_stats_data = {
                **transfer_stats_data,
                "data": rest,
                "types": {k: v for k, v in types.items() if k not in METRICS},
            }
        self.inner.observe(transfer_stats_data, engine_idx)

    def _child(self, engine_idx: int, name: str, labelvalues: tuple[str, ...]) -> Any:
        key = (engine_idx, name, labelvalues)
        child = self._children.get(key)
        if child is None:
            values = [*self.per_engine_labelvalues[engine_idx], *labelvalues]
            metric = self._metrics[name]
            child = self._children[key] = metric.labels(*values) if values else metric
        return child


class MultiprocessExporter:
    """A defragmenter's metrics without kvlog's connector: prometheus_client metrics in
    this (worker) process, labelled ``pid``-free as vLLM's are; under
    ``PROMETHEUS_MULTIPROC_DIR`` (prometheus_client's multiprocess mode, which vLLM's
    ``/metrics`` collects from every process) they reach vLLM's endpoint."""

    def __init__(self, labels: Mapping[str, str] | None = None) -> None:
        from prometheus_client import Counter, Gauge

        self.labels = dict(labels or {})
        self.prom = PromMetrics(
            {Counter: Counter, Gauge: Gauge}, list(self.labels), {0: list(self.labels.values())}
        )

    @staticmethod
    def enabled() -> bool:
        """Whether this process writes prometheus_client's multiprocess files."""
        return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))

    def observe(self, payload: dict[str, Any] | None) -> None:
        if payload is not None:
            self.prom.observe(payload, 0)


_EXPORTER: list[MultiprocessExporter] = []


def process_exporter() -> MultiprocessExporter | None:
    """This process's exporter under ``PROMETHEUS_MULTIPROC_DIR`` (one a process: its
    metrics register once), else None."""
    if not MultiprocessExporter.enabled():
        return None
    if not _EXPORTER:
        _EXPORTER.append(MultiprocessExporter())
    return _EXPORTER[0]

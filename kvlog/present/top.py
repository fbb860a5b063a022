"""``kvlog top LOG``: a live view of a log (or log directory) being written.

A :class:`LogWatch` folds the log as it grows (``kvlog.fold``, reading only: no lock, no
write, nothing the writer waits on) with the same observers the metrics use
(:class:`~kvlog.analysis.figures.EngineFigures`,
:class:`~kvlog.reducers.tier_misses.TierExplainer`), from its first record or, where
retention removed the start, from the first segment's snapshot; each refresh reads only the
records appended since the last (a directory: only the segments that hold them), follows
segments as they rotate and, when retention removes segments it has not read, goes on from
the snapshot that opens the oldest one left (the gap is shown). The CPU tier comes from the
log itself (a tier log) or from the scheduler's log beside it (``scheduler.kvlog`` in a
directory, ``NAME.scheduler.EXT`` beside a file).

:class:`Sampler` turns successive snapshots into rates over the last refresh and sparklines
of the last minute. ``render`` draws one snapshot with rich; ``snapshot_json`` is the same
figures as one JSON object (``--json``: one line per refresh).
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvlog.analysis.figures import EngineFigures, EngineGauges
from kvlog.events import Event, Plan
from kvlog.log import LogReader, list_segments
from kvlog.log.manifest import log_num_bytes
from kvlog.reducers.tier_misses import MISS_REASONS, TierExplainer
from kvlog.runtime.fold import Fold, Lane
from kvlog.runtime.machine import Machine
from kvlog.util.units import format_bytes

__all__ = [
    "LogWatch",
    "Sampler",
    "TopSnapshot",
    "render",
    "snapshot_json",
    "tier_log_beside",
]

SPARKS = "▁▂▃▄▅▆▇█"
HISTORY = 60
"""Samples the sparklines keep (one per refresh: the last minute at 1 s)."""


def tier_log_beside(path: str) -> str | None:
    """The scheduler's tier log next to a workers' log, if there is one."""
    if os.path.isdir(path):
        candidate = os.path.join(path, "scheduler.kvlog")
    else:
        root, ext = os.path.splitext(path)
        candidate = f"{root}.scheduler{ext or '.kvlog'}"
    return candidate if os.path.isfile(candidate) and candidate != path else None


@dataclass
class RecorderView:
    """What the log says of its recorder."""

    records: int = 0
    checkpoints: int = 0
    log_bytes: int = 0
    segments: int = 0
    age_s: float = 0.0
    """Seconds since the log last changed on disk (a live writer's lag, at most)."""
    closed: bool = False
    detached: str = ""
    errno: int = 0
    retired: int = 0
    """Records retention removed before this view read them."""
    resyncs: int = 0
    """Times the view re-seated its state on the latest snapshot (a record it refused)."""


class LogWatch:
    """One log folded incrementally (module docstring); ``poll()`` reads what is new."""

    def __init__(self, path: str) -> None:
        self.path = path
        LogReader(path)  # refuses what is not a log (LogNotFound, CorruptLogError, ...)
        self.figures = EngineFigures()
        self.explainer = TierExplainer()
        self.lane = Lane(Machine(observers=[self.figures]))
        self.next_seq = -1
        self.last_event_seq = -1
        self.recorder = RecorderView()

    def poll(self) -> None:
        fold = Fold(self.path, [self.lane], verify=False)
        fold.on_event.append(self._tier)
        if self.next_seq < 0:
            if fold.reader.first_seq > 0:  # retention removed the start
                fold.start_from_snapshot(first=True)
        else:
            fold.start_at(self.lane.machine.state, self.last_event_seq, self.next_seq)
        fold.run()
        if fold.divergence is not None:  # the books lost the thread: from the latest snapshot
            fold = self._resync()
        if fold.seq >= 0:
            self.next_seq = max(self.next_seq, fold.seq + 1)
        elif self.next_seq < 0:
            self.next_seq = fold.start_seq
        self.last_event_seq = max(self.last_event_seq, fold.last_event_seq)
        self._note(fold)

    def _resync(self) -> Fold:
        """A record the view's state refused (seen on a log directory whose retention
        removed segments while it was read): seat the state on the log's latest snapshot
        and read on from there; the counters go on, the gap is counted."""
        self.recorder.resyncs += 1
        fold = Fold(self.path, [self.lane], verify=False)
        fold.on_event.append(self._tier)
        fold.start_from_snapshot()
        fold.run()
        return fold

    def _tier(self, seq: int, event: Event, plans: list[Plan]) -> None:
        self.explainer.feed(event)

    def _note(self, fold: Fold) -> None:
        rec, reader = self.recorder, fold.reader
        rec.records = self.next_seq
        rec.checkpoints += fold.num_checkpoints
        rec.retired += sum(last - first + 1 for first, last in fold.retired)
        rec.closed = reader.closed_cleanly  # a directory: its newest segment's header
        if reader.gaps:
            rec.detached, rec.errno = reader.gaps[-1][1].error, reader.gaps[-1][1].errno
        try:
            rec.log_bytes = log_num_bytes(self.path)
            if os.path.isdir(self.path):
                segments = list_segments(self.path)
                rec.segments = len(segments)
                newest = os.path.join(self.path, segments[-1].name) if segments else self.path
                rec.closed = bool(segments) and segments[-1].sealed and reader.closed_cleanly
            else:
                rec.segments, newest = 1, self.path
            rec.age_s = max(0.0, time.time() - os.path.getmtime(newest))
        except OSError:
            pass

    @property
    def gauges(self) -> EngineGauges:
        return self.figures.gauges(self.lane.machine.state)


@dataclass
class TopSnapshot:
    """The figures of one refresh (cumulative) and the rates since the one before."""

    path: str
    wall_s: float
    counters: dict[str, float]
    gauges: EngineGauges
    tier: dict[str, Any]
    recorder: RecorderView
    rates: dict[str, float] = field(default_factory=dict)
    sparks: dict[str, str] = field(default_factory=dict)


def _flat(figures: EngineFigures, explainer: TierExplainer, step: int) -> dict[str, float]:
    """The counters of a snapshot; ``steps`` from the state's step number where the log
    has one (exact across what retention removed), else the steps observed."""
    t = explainer.figures
    return {
        "steps": step + 1 if step >= 0 else figures.steps,
        "defrag_steps": figures.defrag_steps,
        "defrag_pairs": figures.defrag_pairs,
        "defrag_bytes": figures.defrag_bytes,
        "padded_pairs": figures.padded_pairs,
        "stores": figures.transfer_jobs["store"],
        "loads": figures.transfer_jobs["load"],
        "store_bytes": figures.transfer_bytes["store"],
        "load_bytes": figures.transfer_bytes["load"],
        "transfer_failures": sum(figures.transfer_failures.values()),
        "tier_lookups": t.lookups,
        "tier_hits": t.hits,
    }


RATED = ("steps", "defrag_pairs", "defrag_bytes", "stores", "loads", "store_bytes", "load_bytes")


class Sampler:
    """Snapshots of one or two watches (the log, and the tier log beside it), with rates
    over the last refresh and the last minute's sparklines."""

    def __init__(
        self,
        watch: LogWatch,
        tier: LogWatch | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.watch, self.tier, self.clock = watch, tier, clock
        self.history: collections.deque[tuple[float, dict[str, float]]] = collections.deque(
            maxlen=HISTORY + 1
        )

    def sample(self) -> TopSnapshot:
        self.watch.poll()
        explainer = self.watch.explainer
        if self.tier is not None:
            self.tier.poll()
            explainer = self.tier.explainer
        now = self.clock()
        counters = _flat(self.watch.figures, explainer, self.watch.lane.machine.state.step)
        snap = TopSnapshot(
            self.watch.path,
            now,
            counters,
            self.watch.gauges,
            explainer.figures.as_dict(),
            self.watch.recorder,
        )
        if self.history:
            then, before = self.history[-1]
            span = max(now - then, 1e-9)
            snap.rates = {k: (counters[k] - before[k]) / span for k in RATED}
        self.history.append((now, counters))
        snap.sparks = {
            k: _sparkline(self._series(k))
            for k in ("steps", "defrag_pairs", "store_bytes", "load_bytes")
        }
        return snap

    def _series(self, key: str) -> list[float]:
        items = list(self.history)
        return [
            (b[1][key] - a[1][key]) / max(b[0] - a[0], 1e-9) for a, b in itertools.pairwise(items)
        ]


def _sparkline(values: list[float]) -> str:
    if not values:
        return ""
    top = max(values)
    if top <= 0:
        return SPARKS[0] * len(values)
    return "".join(SPARKS[min(len(SPARKS) - 1, int(v / top * (len(SPARKS) - 1)))] for v in values)


def snapshot_json(snap: TopSnapshot) -> str:
    """One JSON line: every figure of the snapshot."""
    g, r = snap.gauges, snap.recorder
    out = {
        "path": snap.path,
        "counters": snap.counters,
        "rates": {k: round(v, 3) for k, v in snap.rates.items()},
        "used_blocks": g.used_blocks,
        "highest_used_id": g.highest_used_id,
        "fragmentation": round(g.fragmentation, 6),
        "jobs_in_flight": g.jobs_in_flight,
        "oldest_job_age_steps": g.oldest_job_age_steps,
        "pinned_blocks": g.pinned_blocks,
        "held_blocks": g.held_blocks,
        "tier": snap.tier,
        "recorder": {
            "records": r.records,
            "checkpoints": r.checkpoints,
            "log_bytes": r.log_bytes,
            "segments": r.segments,
            "age_s": round(r.age_s, 3),
            "status": _status(r),
            "errno": r.errno,
            "retired_unread": r.retired,
            "resyncs": r.resyncs,
        },
    }
    return json.dumps(out, sort_keys=True)


def _status(r: RecorderView) -> str:
    if r.detached:
        return f"detached ({r.detached})"
    return "closed" if r.closed else "writing"


def _gb(value: float) -> str:
    """Bytes per second in units (GB/s for the large, as the issue's figures read)."""
    if value >= 1e9:
        return f"{value / 1e9:.2f} GB/s"
    return f"{format_bytes(int(value))}/s"


def render(snap: TopSnapshot) -> Any:
    """The snapshot as a rich renderable (one screen)."""
    from rich.console import Group
    from rich.table import Table

    g, r, rates, sparks = snap.gauges, snap.recorder, snap.rates, snap.sparks
    c = snap.counters
    engine = Table(title=f"kvlog top  {snap.path}", show_header=False, expand=True)
    engine.add_column(ratio=2)
    engine.add_column(ratio=3)
    engine.add_column(ratio=3)
    engine.add_row(
        "steps", f"{c['steps']:,.0f}  ({rates.get('steps', 0):.1f}/s)", sparks.get("steps", "")
    )
    engine.add_row(
        "used blocks",
        f"{g.used_blocks:,} of {g.num_gpu_blocks:,}",
        f"highest id {g.highest_used_id:,}  fragmentation {g.fragmentation:.3f}",
    )
    engine.add_row(
        "defrag",
        f"{rates.get('defrag_pairs', 0):.1f} pairs/s  {_gb(rates.get('defrag_bytes', 0))}",
        f"{c['defrag_pairs']:,.0f} pairs on {c['defrag_steps']:,.0f} steps  "
        f"{sparks.get('defrag_pairs', '')}",
    )
    engine.add_row(
        "stores",
        f"{rates.get('stores', 0):.1f}/s  {_gb(rates.get('store_bytes', 0))}",
        f"{c['stores']:,.0f} jobs  {sparks.get('store_bytes', '')}",
    )
    engine.add_row(
        "loads",
        f"{rates.get('loads', 0):.1f}/s  {_gb(rates.get('load_bytes', 0))}",
        f"{c['loads']:,.0f} jobs  {sparks.get('load_bytes', '')}",
    )
    engine.add_row(
        "in flight",
        f"{g.jobs_in_flight['store']} stores, {g.jobs_in_flight['load']} loads",
        f"oldest {g.oldest_job_age_steps} steps; pinned {g.pinned_blocks}, "
        f"held {g.held_blocks}; failed {c['transfer_failures']:,.0f}",
    )
    t = snap.tier
    misses = ", ".join(f"{k} {t['misses'][k]:,}" for k in MISS_REASONS if t["misses"][k])
    engine.add_row(
        "CPU tier",
        f"{t['lookups']:,} lookups, hit rate {t['hit_rate']:.1%}",
        f"misses: {misses or '-'}",
    )
    engine.add_row(
        "",
        f"{t['resident']:,} resident, {t['unread']:,} unread",
        f"{t['never_read']:,} stored chunks left unread",
    )
    engine.add_row(
        "recorder",
        f"{_status(r)}  {r.records:,} records",
        f"{r.log_bytes / 1e6:,.1f} MB in {r.segments} segment(s); "
        f"last write {r.age_s:.1f} s ago"
        + (f"; {r.retired:,} records retired unread" if r.retired else "")
        + (f"; re-read from a snapshot {r.resyncs}x" if r.resyncs else ""),
    )
    return Group(engine)

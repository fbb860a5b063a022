"""What reporting kvlog's metrics costs the runner, measured in the real-vLLM harness.

    python bench/bench_metrics.py                 # 5 rounds of each variant, interleaved
    python bench/bench_metrics.py --rounds 3 --config nopc-bpc1-sync --requests 60

Runs in the vLLM virtualenv (the harness drives vLLM 0.33's scheduler and connector). One
harness configuration (``tests/vllm/harness``: vLLM's scheduler, kvlog's connector and
defragmenter, the fake Gaudi runner) is run under three variants, round-robin so that the
machine's drift hits them alike:

- ``off``: ``KVLOG_METRICS=0`` (no observer, no figures; the connector's stats calls return
  vLLM's alone): the baseline;
- ``1 s``: the default (``KVLOG_METRICS_INTERVAL_S=1``): the figures are kept every event,
  a payload is handed at most once a second;
- ``every step``: ``KVLOG_METRICS_INTERVAL_S=0``: a payload every step (what the harness
  test of the scrape uses).

In every variant the runner hands ``get_kv_connector_stats()`` of the worker connector to
the scheduler every step (as vLLM's GPU runner does), and the scheduler connector's
``get_kv_connector_stats()`` runs inside ``update_from_output``: both calls are timed into
kvlog's per-step time (the harness's ``kvlog us/step``: every call the runner makes into
kvlog, the tier log's appends included). Printed: the median of the rounds per variant and
its ratio to ``off``; the issue's bound is 1.02 for the default.

``--cpu-time`` times with the calling thread's CPU clock (``time.thread_time``) instead of
the wall clock, everywhere in the process (the harness's own timing included): on a machine
shared with other work, preemption then no longer lands in the figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

VARIANTS = {
    "off": {"KVLOG_METRICS": "0"},
    "1 s": {},
    "every step": {"KVLOG_METRICS_INTERVAL_S": "0"},
}


def _timed_run_class() -> Any:
    from tests import vllm_harness as harness

    class TimedRun(harness.Run):  # type: ignore[misc, name-defined]
        """The harness run, with both sides' ``get_kv_connector_stats`` in kvlog's time."""

        def _setup(self) -> None:
            super()._setup()
            connector = self.scheduler.connector
            inner = connector.get_kv_connector_stats

            def timed() -> Any:
                t0 = time.perf_counter()
                try:
                    return inner()
                finally:
                    spent = time.perf_counter() - t0
                    self.result.kvlog_s += spent
                    self.result.sched_s -= spent

            connector.get_kv_connector_stats = timed

        def _runner_output(self, so: Any, sampled: Any, kv_output: Any) -> Any:
            if kv_output is not None:
                kv_output.kv_connector_stats = self._kvlog(
                    "get_kv_connector_stats", self.connector.get_kv_connector_stats
                )
            return super()._runner_output(so, sampled, kv_output)

    return TimedRun, harness


class Attribution:
    """The time spent in the reporting code itself, from timing wrappers on its entry
    points (the Engine observer, the tier explainer, the reporter, kvlog's part of the
    connector's stats call): an over-estimate (each wrapper adds its own clock reads)."""

    def __init__(self) -> None:
        self.spent = 0.0
        self.calls = 0
        self._depth = 0
        self._undo: list[tuple[Any, str, Any]] = []

    def wrap(self, owner: Any, name: str, minus: bool = False) -> None:
        inner = getattr(owner, name)
        self._undo.append((owner, name, inner))
        sign = -1.0 if minus else 1.0

        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth and not minus:
                return inner(*args, **kwargs)
            self._depth += not minus
            self.calls += 1
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.spent += sign * (time.perf_counter() - t0)
                self._depth -= not minus

        setattr(owner, name, timed)

    def install(self) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
            OffloadingConnector,
        )

        from kvlog.analysis.figures import EngineFigures
        from kvlog.integrations.metrics import Reporter
        from kvlog.integrations.vllm import KvlogOffloadingConnector
        from kvlog.reducers.tier_misses import TierExplainer

        self.wrap(EngineFigures, "after")
        self.wrap(TierExplainer, "feed")
        self.wrap(Reporter, "note_finished")
        self.wrap(KvlogOffloadingConnector, "get_kv_connector_stats")
        self.wrap(OffloadingConnector, "get_kv_connector_stats", minus=True)  # vLLM's own

    def overhead_s(self) -> float:
        """What one wrapped call costs beyond the call itself (the wrapper's clock reads
        and bookkeeping), measured on a no-op: subtracted per call from ``spent``."""

        class Probe:
            def noop(self) -> None:
                return None

        probe = Attribution()
        probe.wrap(Probe, "noop")
        target, n = Probe(), 200_000
        t0 = time.perf_counter()
        for _ in range(n):
            target.noop()
        wrapped = time.perf_counter() - t0
        probe.remove()
        t0 = time.perf_counter()
        for _ in range(n):
            target.noop()
        bare = time.perf_counter() - t0
        return max(0.0, (wrapped - bare) / n)

    def remove(self) -> None:
        for owner, name, inner in reversed(self._undo):
            setattr(owner, name, inner)
        self._undo.clear()


def _one(variant: str, cfg: Any, attribution: Attribution | None = None) -> float:
    """kvlog's microseconds per step of one run of ``cfg`` under ``variant``; with an
    ``attribution``, the reporting code's own time goes there (seconds per step)."""
    run_cls, _ = _timed_run_class()
    saved = {k: os.environ.get(k) for k in ("KVLOG_METRICS", "KVLOG_METRICS_INTERVAL_S")}
    for key in saved:
        os.environ.pop(key, None)
    os.environ.update(VARIANTS[variant])
    if attribution is not None:
        attribution.install()
    try:
        with tempfile.TemporaryDirectory(prefix="kvlog-bench-metrics-") as tmp:
            result = run_cls(cfg, tmp).execute()
    finally:
        if attribution is not None:
            attribution.remove()
            spent = attribution.spent - attribution.calls * attribution.overhead_s()
            attribution.spent = max(0.0, spent) / max(1, result.steps)
        for key, value in saved.items():
            os.environ.pop(key, None)
            if value is not None:
                os.environ[key] = value
    if not result.ok:
        raise SystemExit(f"{variant}: the harness run failed: {result.summary()}")
    return result.kvlog_s / max(1, result.steps) * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default="pc-bpc2-async")
    p.add_argument("--requests", type=int, default=80)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--cpu-time", action="store_true", help="time with the thread's CPU clock")
    args = p.parse_args(argv)
    if args.cpu_time:
        time.perf_counter = time.thread_time
    import gc

    _, harness = _timed_run_class()
    cfg = dataclasses.replace(harness.CONFIGS[args.config], num_requests=args.requests)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    _one("off", cfg)  # warm-up: imports, numba, first allocations
    for r in range(args.rounds):
        order = list(VARIANTS) if r % 2 == 0 else list(reversed(VARIANTS))
        for variant in order:
            gc.collect()
            times[variant].append(_one(variant, cfg))
        print(f"round {r + 1}: " + ", ".join(f"{v} {times[v][-1]:.0f}" for v in VARIANTS))
    shares = []
    for _ in range(args.rounds):
        attribution = Attribution()
        per_step = _one("1 s", cfg, attribution)
        shares.append(attribution.spent * 1e6 / per_step)
    base = statistics.median(times["off"])
    print(f"\n{args.config}, {args.requests} requests, {args.rounds} rounds (kvlog us/step)")
    for variant, values in times.items():
        med = statistics.median(values)
        print(f"  {variant:<11} median {med:8.1f}  min {min(values):8.1f}  ratio {med / base:.3f}")
    print(
        "  the reporting code's own time, timed inside '1 s' runs: "
        f"median {statistics.median(shares):.2%} of kvlog's per-step time "
        f"(runs: {', '.join(f'{x:.2%}' for x in shares)})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

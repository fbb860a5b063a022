"""``kvlog synth``: record a realistic serving workload into a log, optionally on tensors.

``run_synth(config, out=...)`` builds an Engine for ``config`` (with an executor and canary
checks when ``execute``), drives it for ``config.steps`` steps and closes it. The same
config and seed always record the same events.
"""

from __future__ import annotations

import dataclasses
import json
import os

from kvlog.canary import CanaryTracker, make_canary_executor
from kvlog.engine import Engine
from kvlog.log import SyncMode
from kvlog.synth.driver import SynthResult, SynthRun
from kvlog.synth.pool import BlockPool, CpuCache
from kvlog.synth.workload import Request, SynthConfig, Workload

__all__ = [
    "BlockPool",
    "CpuCache",
    "Request",
    "SynthConfig",
    "SynthResult",
    "SynthRun",
    "Workload",
    "run_synth",
]


def run_synth(
    config: SynthConfig,
    out: str | os.PathLike[str] | None = None,
    *,
    execute: bool = False,
    backend: str = "cpu",
    sync: SyncMode = "step",
    checkpoint_every: int = 256,
    snapshot_every: int = 16,
) -> SynthResult:
    """Run one synthetic workload; with ``out``, record it to that (new) log file."""
    cache_config = config.cache_config()
    executor = None
    tracker: CanaryTracker | None = None
    if execute:
        executor, tracker = make_canary_executor(cache_config, backend)
    meta = {"workload": "kvlog synth", "synth": json.dumps(_jsonable(config), sort_keys=True)}
    try:
        engine = Engine(
            cache_config, out, executor, sync, checkpoint_every, snapshot_every, meta=meta
        )
        with engine:
            result = SynthRun(config, engine, tracker).run()
        result.num_events += 1  # the CacheConfigured the engine applied itself
    finally:
        if executor is not None:
            executor.shutdown()
    return result


def _jsonable(config: SynthConfig) -> dict[str, object]:
    out = dataclasses.asdict(config)
    out["pad_sizes"] = list(config.pad_sizes)
    return out

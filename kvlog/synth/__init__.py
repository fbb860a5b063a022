"""``kvlog synth``: record a realistic serving workload into a log, optionally on tensors.

``run_synth(config, out=...)`` builds an Engine for ``config`` (with an executor and canary
checks when ``execute``), drives it for ``config.steps`` steps and closes it. The same
config and seed always record the same events. ``run_trace(trace_config, requests,
out=...)`` does the same for a public request trace (``read_trace``) through a vLLM-like
scheduler and block pool (``serving.py``), until every request has finished.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from kvlog.analysis.canary import CanaryTracker, make_canary_executor
from kvlog.errors import ConfigError, TraceError
from kvlog.events import CacheConfigured
from kvlog.executors import Executor
from kvlog.log import SyncMode
from kvlog.runtime.engine import Engine
from kvlog.synth.driver import SynthResult, SynthRun, step_boundaries
from kvlog.synth.pool import BlockPool, CpuCache
from kvlog.synth.serving import (
    TRACE_DEFAULTS,
    TraceConfig,
    TraceRun,
    VllmBlockPool,
    bytes_per_token,
    trace_geometry,
)
from kvlog.synth.traces import TRACE_FORMATS, TraceRequest, read_trace
from kvlog.synth.workload import Request, SynthConfig, Workload

__all__ = [
    "BlockPool",
    "CpuCache",
    "Request",
    "SynthConfig",
    "SynthResult",
    "SynthRun",
    "TRACE_DEFAULTS",
    "TRACE_FORMATS",
    "TraceConfig",
    "TraceRequest",
    "TraceRun",
    "VllmBlockPool",
    "Workload",
    "bytes_per_token",
    "read_trace",
    "run_synth",
    "flat_meta",
    "read_meta",
    "run_trace",
    "trace_geometry",
]


def run_synth(
    config: SynthConfig,
    out: str | os.PathLike[str] | None = None,
    *,
    execute: bool = False,
    backend: str = "cpu",
    sync: SyncMode = "step",
    checkpoint_every: int = 256,
    snapshot_every: int | None = None,
    meta: dict[str, str] | None = None,
    log_options: dict[str, Any] | None = None,
) -> SynthResult:
    """Run one synthetic workload; with ``out``, record it to that (new) log file or log
    directory (``log_options``: the Engine's ``segment_bytes``, ``retain_bytes``,
    ``retain_seconds``, ``compress``).

    A config that cannot run (``SynthConfig.check``) is refused before the log exists;
    ``meta`` adds entries to the log header's."""
    config.check()
    meta = {**(meta or {}), "workload": "kvlog synth", **flat_meta("synth", _jsonable(config))}
    return _record(
        config.cache_config(),
        lambda engine, tracker: SynthRun(config, engine, tracker),
        out,
        meta,
        (execute, backend, sync, checkpoint_every, snapshot_every),
        log_options=log_options,
    )


def run_trace(
    config: TraceConfig,
    requests: Sequence[TraceRequest],
    out: str | os.PathLike[str] | None = None,
    *,
    execute: bool = False,
    backend: str = "cpu",
    sync: SyncMode = "step",
    checkpoint_every: int = 256,
    snapshot_every: int | None = None,
    source: str = "",
    scheduler: str = "kvlog",
    log_options: dict[str, Any] | None = None,
) -> SynthResult:
    """Serve ``requests`` (a trace) until all finished; with ``out``, record the log.

    ``scheduler="vllm"`` drives vLLM's own scheduler instead (``vllm_scheduler.py``; needs
    vLLM, no offload, no ``execute``). A run that cannot progress or end is refused
    before the log exists (``TraceConfig.check``), or, if it stalls anyway, when it does:
    then the partial log is removed."""
    config.check(requests)
    described = dataclasses.asdict(config)
    del described["synth"]
    described.update(source=source, num_requests=len(requests), scheduler=scheduler)
    meta = {
        "workload": "kvlog synth --trace",
        **flat_meta("trace", described),
        **flat_meta("synth", _jsonable(config.synth)),
    }
    make_run: Callable[[Engine, CanaryTracker | None], _Runs]
    if scheduler == "vllm":
        if execute or config.synth.num_cpu_blocks:
            raise ConfigError("scheduler", scheduler, "no --execute and no offload with vllm")
        from kvlog.synth.vllm_scheduler import VllmTraceRun, trace_scheduler

        vllm_scheduler = trace_scheduler(config)  # no vLLM: refused before the log exists
        make_run = lambda engine, tracker: VllmTraceRun(  # noqa: E731
            config, requests, engine, vllm_scheduler
        )
    elif scheduler == "kvlog":
        make_run = lambda engine, tracker: TraceRun(config, requests, engine, tracker)  # noqa: E731
    else:
        raise ConfigError("scheduler", scheduler, "kvlog or vllm")
    return _record(
        config.synth.cache_config(),
        make_run,
        out,
        meta,
        (execute, backend, sync, checkpoint_every, snapshot_every),
        deferrable=scheduler == "kvlog",
        log_options=log_options,
    )


class _Runs(Protocol):
    def run(self) -> SynthResult: ...


def _record(
    cache_config: CacheConfigured,
    make_run: Callable[[Engine, CanaryTracker | None], _Runs],
    out: str | os.PathLike[str] | None,
    meta: dict[str, str],
    options: tuple[bool, str, SyncMode, int, int | None],
    deferrable: bool = True,
    log_options: dict[str, Any] | None = None,
) -> SynthResult:
    """Build the Engine (and executor), run, close. ``deferrable``: the run's loop has step
    boundaries (``driver.step_boundaries``), so Ctrl-C is held off the whole Engine life
    and acted on at a step's end; vLLM's scheduler loop has none (interrupted at once)."""
    execute, backend = options[:2]
    executor = None
    tracker: CanaryTracker | None = None
    if execute:
        executor, tracker = make_canary_executor(cache_config, backend)
    try:
        region = step_boundaries() if deferrable else contextlib.nullcontext()
        with region:  # a SIGINT while the Engine is built, runs or closes: at a step's end
            result = _run_engine(
                cache_config, make_run, out, meta, options, executor, tracker, log_options or {}
            )
    finally:
        if executor is not None:
            executor.shutdown()
    return result


def _run_engine(
    cache_config: CacheConfigured,
    make_run: Callable[[Engine, CanaryTracker | None], _Runs],
    out: str | os.PathLike[str] | None,
    meta: dict[str, str],
    options: tuple[bool, str, SyncMode, int, int | None],
    executor: Executor | None,
    tracker: CanaryTracker | None,
    log_options: dict[str, Any],
) -> SynthResult:
    _, _, sync, checkpoint_every, snapshot_every = options
    engine = Engine(
        cache_config,
        out,
        executor,
        sync,
        checkpoint_every,
        snapshot_every,
        meta=meta,
        **log_options,
    )
    try:
        with engine:
            return make_run(engine, tracker).run()
    except TraceError:
        if out is not None:  # a stalled trace, refused: no partial log (ours)
            os.unlink(out)
        raise


def flat_meta(prefix: str, values: dict[str, object]) -> dict[str, str]:
    """Header ``meta`` entries ``prefix.name`` for each value: strings as they are, other
    values as their JSON (``8``, ``true``, ``[8, 16]``); sorted by name."""
    return {
        f"{prefix}.{name}": value if isinstance(value, str) else json.dumps(value)
        for name, value in sorted(values.items())
    }


def read_meta(meta: dict[str, str]) -> dict[str, object]:
    """A log header's ``meta`` with the run's settings as objects: ``{"workload": ...,
    "synth": {...}, "trace": {...}}``, from the ``prefix.name`` entries of
    :func:`flat_meta` and from the whole-JSON ``"synth"``/``"trace"`` entries older logs
    have (a trace's ``synth`` then sits inside its ``trace``)."""
    out: dict[str, object] = {}
    for key, value in meta.items():
        prefix, dot, name = key.partition(".")
        if dot and prefix in ("synth", "trace"):
            group = out.setdefault(prefix, {})
            assert isinstance(group, dict), "a settings group that is not a dict"
            group[name] = _json_or_text(value)
        elif key in ("synth", "trace"):
            out[key] = _json_or_text(value)
        else:
            out[key] = value
    return out


def _json_or_text(value: str) -> object:
    try:
        return json.loads(value)
    except ValueError:
        return value


def _jsonable(config: SynthConfig) -> dict[str, object]:
    out = dataclasses.asdict(config)
    out["pad_sizes"] = list(config.pad_sizes)
    return out

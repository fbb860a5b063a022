"""Sweeps and long replays on Ray against the same work done sequentially, in one run.

    python bench/bench_sweep.py              # both shared traces, 800 requests each
    python bench/bench_sweep.py --quick      # the test slices in tests/data
    python bench/bench_sweep.py --traces DIR --requests 4000 --workers 2

1. Records two logs from public traces (Mooncake with prefix caching, Azure with offload;
   ``--traces`` names the directory of the shared traces, else tests/data's slices).
2. The same sweep (both logs under seed thresholds 8/16/32, tail, budget and off) runs
   sequentially in this process and as Ray tasks on a running local Ray with ``--workers``
   CPUs (warm), in interleaved rounds; once more with the Ray start and stop counted (cold).
3. A long log (the whole Azure trace, ``--long-requests``, with a snapshot every 8
   checkpoints) replays sequentially (``kvlog.analysis.replay``), in ``--workers`` segments between
   its snapshots in this process, and in the same segments on Ray; all must give the same
   final digest, events and verified checkpoints.

Every time is the best of ``--repeat`` interleaved rounds; ratios are sequential time over
the other time (above 1: faster). Other load on the machine counts: compare on a quiet one.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from kvlog import replay
from kvlog.analysis.grid import policy_grid, run_sweep
from kvlog.analysis.parallel import replay_segments
from kvlog.synth import SynthConfig, TraceConfig, bytes_per_token, read_trace, run_trace

HERE = os.path.dirname(os.path.abspath(__file__))
SLICES = {
    "mooncake": os.path.join(
        HERE, "..", "tests", "data", "mooncake_synthetic_trace_3601-3800.jsonl"
    ),
    "azure": os.path.join(HERE, "..", "tests", "data", "AzureLLMInferenceTrace_conv_head300.csv"),
}
FULL = {"mooncake": "mooncake_synthetic_trace.jsonl", "azure": "AzureLLMInferenceTrace_conv.csv"}


def configs() -> dict[str, TraceConfig]:
    page = bytes_per_token() * 128
    mooncake = SynthConfig(
        num_gpu_blocks=4096,
        block_size=128,
        prefix_caching=True,
        page_size_bytes=page,
        max_num_seqs=64,
    )
    azure = SynthConfig(
        num_gpu_blocks=1024,
        block_size=128,
        num_cpu_blocks=2048,
        block_size_factor=2,
        page_size_bytes=page,
        max_num_seqs=64,
    )
    return {
        "mooncake": TraceConfig(mooncake, "mooncake"),
        "azure": TraceConfig(azure, "azure", time_scale=0.5),
    }


def record(directory: str, traces: str | None, requests: int) -> list[str]:
    paths = []
    for name, config in configs().items():
        source = os.path.join(traces, FULL[name]) if traces else SLICES[name]
        path = os.path.join(directory, f"{name}.kvlog")
        trace = read_trace(source, name, limit=requests)
        result = run_trace(config, trace, path, sync="none", checkpoint_every=64, snapshot_every=2)
        print(
            f"  {name}: {len(trace)} requests, {result.num_events:,} events, "
            f"{result.num_steps:,} steps ({result.elapsed_s:.1f} s)"
        )
        paths.append(path)
    return paths


def record_long(directory: str, traces: str | None, requests: int | None) -> str:
    source = os.path.join(traces, FULL["azure"]) if traces else SLICES["azure"]
    path = os.path.join(directory, "long.kvlog")
    trace = read_trace(source, "azure", limit=requests)
    result = run_trace(configs()["azure"], trace, path, sync="none", snapshot_every=8)
    events, took = result.num_events, result.elapsed_s
    print(f"  long log: {len(trace)} Azure requests, {events:,} events ({took:.1f} s)")
    return path


def best_of(repeat: int, fn: Callable[[], Any]) -> tuple[float, Any]:
    times, out = [], None
    for _ in range(repeat):
        started = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - started)
    return min(times), out


def interleaved(repeat: int, fns: list[Callable[[], Any]]) -> list[tuple[float, Any]]:
    """Best time and last result of each function, run in turn ``repeat`` rounds (so the
    machine's load changes hit every mode alike)."""
    best = [float("inf")] * len(fns)
    outs: list[Any] = [None] * len(fns)
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            started = time.perf_counter()
            outs[i] = fn()
            best[i] = min(best[i], time.perf_counter() - started)
    return list(zip(best, outs, strict=True))


def bench_sweep(paths: list[str], workers: int, repeat: int) -> None:
    import ray

    specs = policy_grid(("seed", "tail", "budget", "off"))
    tasks = len(paths) * len(specs)
    cold, _ = best_of(1, lambda: run_sweep(paths, specs, num_cpus=workers))
    ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False)
    try:
        run_sweep(paths, specs[:workers])  # start the workers
        (serial, rows), (warm, again) = interleaved(
            repeat,
            [lambda: run_sweep(paths, specs, use_ray=False), lambda: run_sweep(paths, specs)],
        )
    finally:
        ray.shutdown()
    same = [r.final_digest for r in rows] == [r.final_digest for r in again]
    print(
        f"\nsweep: {tasks} what-ifs ({len(paths)} logs x {len(specs)} policies), "
        f"same rows on Ray: {same}"
    )
    print(f"  sequential              {serial:8.2f} s   1.00")
    print(f"  Ray, {workers} workers (warm)   {warm:8.2f} s   {serial / warm:4.2f}x")
    ratio = serial / cold
    print(f"  Ray, {workers} workers (cold)   {cold:8.2f} s   {ratio:4.2f}x  (Ray start counted)")


def bench_segments(path: str, workers: int, repeat: int) -> None:
    import ray

    ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False)
    try:
        replay_segments(path, max_segments=workers)  # start the workers
        (sequential, whole), (here, split), (on_ray, parallel) = interleaved(
            repeat,
            [
                lambda: replay(path, series=False),
                lambda: replay_segments(path, use_ray=False, max_segments=workers),
                lambda: replay_segments(path, max_segments=workers),
            ],
        )
    finally:
        ray.shutdown()
    same = (parallel.final_digest, parallel.num_verified, parallel.num_events) == (
        whole.final_digest,
        whole.num_verified,
        whole.num_events,
    )
    print(
        f"\nreplay of {os.path.basename(path)}: {whole.num_events:,} events, "
        f"{whole.num_verified} checkpoints; segments agree with the sequential replay: "
        f"{same and split.ok}"
    )
    print(f"  sequential (kvlog.analysis.replay)           {sequential:8.2f} s   1.00")
    print(f"  {workers} segments, one process         {here:8.2f} s   {sequential / here:4.2f}x")
    print(
        f"  {workers} segments on Ray, {workers} workers   {on_ray:8.2f} s   "
        f"{sequential / on_ray:4.2f}x"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the test slices, one repeat")
    parser.add_argument("--traces", help="directory of the shared traces (full files)")
    parser.add_argument("--requests", type=int, default=800, help="requests per sweep log")
    parser.add_argument(
        "--long-requests", type=int, help="requests in the long log (default: the whole trace)"
    )
    parser.add_argument("--workers", type=int, default=2, help="Ray worker CPUs")
    parser.add_argument("--repeat", type=int, default=0, help="runs per mode (best is kept)")
    args = parser.parse_args(argv)
    traces = None if args.quick else args.traces or _shared_traces()
    repeat = args.repeat or (1 if args.quick else 3)
    with tempfile.TemporaryDirectory(prefix="kvlog-bench-sweep-") as tmp:
        print(f"recording logs from {traces or 'tests/data slices'}")
        paths = record(tmp, traces, args.requests)
        bench_sweep(paths, args.workers, repeat)
        long_log = record_long(tmp, traces, args.long_requests)
        bench_segments(long_log, args.workers, repeat)
    return 0


def _shared_traces() -> str | None:
    candidate = os.path.join(HERE, "..", "..", "shared", "traces")
    return candidate if os.path.exists(os.path.join(candidate, FULL["azure"])) else None


if __name__ == "__main__":
    sys.exit(main())

"""Replay speed on a large synthetic log: events per second, against a decode-only baseline.

    python bench/bench_replay.py            # ~100k+ events (records a log first, ~15 s)
    python bench/bench_replay.py --quick    # ~20k events
    python bench/bench_replay.py --fifo-blocks 32768 --events 60000  # the FIFO-pool trace
    python bench/bench_replay.py --fifo-blocks 32768 --whole-steps   # one record per step
    python bench/bench_replay.py --fifo-blocks 32768 --whole-steps --heavy --events 400000
        # the heavy trace's 32k log, as the runner's path records it (steps/s printed)

The log is recorded by ``kvlog synth`` (prefix caching, offload, defrag, memory pressure)
into a temporary directory (or ``--log PATH``, reused when it exists). Every mode reads the
same file; the baseline, measured in the same run, streams and decodes the records without
reducing them, so the ratios show what the reducers and the replay bookkeeping cost on top
of reading the log. "reducers only" feeds the events, decoded before its clock starts, to
one bare Machine through ``apply``, as a serving loop would (every event validated in full,
every plan listed). Replay takes the path of a log's own events instead
(``Machine.apply_decoded``: the types msgspec made exact are not checked again, and a lane
that only tallies its plans counts a step's defrag moves rather than listing them), so it
can beat "reducers only" even with the decode and the fold's own share (checkpoint
verification, the run's tally) on top.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kvlog import replay
from kvlog.events import STEP_EVENTS, Checkpoint, Event
from kvlog.log import read_log
from kvlog.runtime.machine import Machine
from kvlog.synth import SynthConfig, run_synth


def record(path: str, steps: int) -> int:
    config = SynthConfig(
        steps=steps,
        num_gpu_blocks=2048,
        num_cpu_blocks=1024,
        block_size_factor=2,
        prefix_caching=True,
        arrival_rate=0.5,
    )
    result = run_synth(config, path, sync="none")
    return result.num_events


def record_fifo(
    path: str, num_gpu_blocks: int, num_events: int, whole: bool = False, heavy: bool = False
) -> int:
    """A log of the FIFO-pool trace of ``bench_step.py`` (defrag firing every step): the
    trace's warm-up, then steps until ``num_events`` events (counted fine-grained);
    default checkpoints. ``whole``: each step logged as one ``StepScheduled``, as the
    runner's path records it."""
    from bench_step import THRESHOLD, HeavyTrace, Trace, as_steps

    from kvlog import Engine
    from kvlog.events import CacheConfigured

    config = CacheConfigured(num_gpu_blocks=num_gpu_blocks, block_size=16, threshold=THRESHOLD)
    kind = HeavyTrace if heavy else Trace
    trace = kind(num_gpu_blocks, seed=num_gpu_blocks + heavy)
    count = 0
    with Engine(config, log_path=path, sync="none") as engine:
        for event in trace.warm_up():
            engine.apply(event)
            count += 1
        step = 0
        while count < num_events:
            events = trace.step(step)
            count += len(events)
            for event in as_steps([events])[0] if whole else events:
                engine.apply(event)
            step += 1
    return count


def best_of(repeat: int, fn: Callable[[], int]) -> tuple[float, int]:
    """The fastest of ``repeat`` runs (seconds) and what the function counted."""
    times, count = [], 0
    for _ in range(repeat):
        started = time.perf_counter()
        count = fn()
        times.append(time.perf_counter() - started)
    return min(times), count


def decode_only(path: str) -> int:
    return sum(1 for _ in read_log(path))


def reducers_only(events: list[Event]) -> int:
    """The log's events, decoded before the clock starts, through one bare ``Machine``
    (check and change, no fold, no observers, no checkpoints): the reducers' share."""
    machine = Machine()
    for event in events:
        machine.apply(event)
    return len(events)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a ~20k-event log, one repeat")
    parser.add_argument("--log", help="log file to use (recorded there if missing)")
    parser.add_argument("--repeat", type=int, default=0, help="runs per mode (best is kept)")
    parser.add_argument(
        "--fifo-blocks",
        type=int,
        default=0,
        help="record bench_step's FIFO-pool trace at this many blocks instead of kvlog synth",
    )
    parser.add_argument("--events", type=int, default=60000, help="events of --fifo-blocks")
    parser.add_argument(
        "--whole-steps",
        action="store_true",
        help="with --fifo-blocks: log each step as one StepScheduled (the runner's path)",
    )
    parser.add_argument(
        "--heavy",
        action="store_true",
        help="with --fifo-blocks: bench_step's heavy trace (400-512 running requests, defrag "
        "on most steps) instead of its FIFO-pool trace",
    )
    args = parser.parse_args(argv)
    steps = 3000 if args.quick else 16000
    repeat = args.repeat or (1 if args.quick else 3)
    directory = tempfile.mkdtemp(prefix="kvlog-bench-")
    path = args.log or os.path.join(directory, "bench.kvlog")
    if not os.path.exists(path):
        started = time.perf_counter()
        if args.fifo_blocks:
            num = record_fifo(path, args.fifo_blocks, args.events, args.whole_steps, args.heavy)
        else:
            num = record(path, steps)
        print(f"recorded {num:,} events in {time.perf_counter() - started:.1f} s -> {path}")
    size = os.path.getsize(path)

    base_s, num_records = best_of(repeat, lambda: decode_only(path))
    events = [r for _, r in read_log(path) if not isinstance(r, Checkpoint)]
    num_steps = sum(type(r) in STEP_EVENTS for r in events)
    gc.collect()
    gc.freeze()  # the decoded events stand for the log file: no garbage to scan, for any mode
    modes: list[tuple[str, Callable[[], int]]] = [
        ("reducers only (decoded beforehand)", lambda: reducers_only(events)),
        ("replay, verify checkpoints", lambda: replay(path, series=False).num_events),
        ("replay, verify + per-step series", lambda: replay(path).num_events),
        ("resume state from latest snapshot", lambda: replay(path, from_snapshot=True).num_events),
        ("what-if --threshold 8 (two runs)", lambda: replay(path, threshold=8).num_events),
    ]
    print(f"log: {size / 1e6:.1f} MB, {num_records:,} records; best of {repeat}")
    print(f"{'mode':36} {'seconds':>8} {'events':>8} {'events/s':>12} {'time vs decode':>15}")
    name = "baseline: decode only (read_log)"
    print(f"{name:36} {base_s:8.3f} {num_records:8,} {num_records / base_s:12,.0f} {1.0:14.1f}x")
    for name, fn in modes:
        seconds, events = best_of(repeat, fn)
        rate = f"{events / seconds:12,.0f}" if events else f"{'-':>12}"
        print(f"{name:36} {seconds:8.3f} {events:8,} {rate} {seconds / base_s:14.1f}x")
    check = replay(path, series=False)
    print(f"verified {check.num_verified}/{check.num_checkpoints} checkpoints, ok={check.ok}")
    seconds, _ = best_of(repeat, lambda: replay(path, series=False).num_events)
    print(
        f"replay with verification: {num_steps:,} steps in {seconds:.3f} s, "
        f"{num_steps / seconds:,.0f} steps/s on one core ({seconds / base_s:.1f}x the bare "
        "decode's time)"
    )
    return 0 if check.ok else 1


if __name__ == "__main__":
    sys.exit(main())

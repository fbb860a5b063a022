"""Per-step cost of the vLLM Gaudi facade, with and without its log, next to the seed.

    python bench/bench_facade.py            # 1000 timed steps per variant, best of 3 rounds
    python bench/bench_facade.py --quick    # 300 timed steps, one pass (seconds)

One pre-generated runner trace (untimed): a 4096-block pool on tiny HPU-layout CPU tensors
(2 layers, key and value, block_size 16), ~80% full; every step 0-2 requests arrive (4-64
blocks), 8 live requests grow by one block, random requests finish while the pool is more
than 80% used; block ids come from a FIFO free list like vLLM's. A timed step is exactly
what the HPU model runner does per step::

    update_state(new | cached, finished); defragment(); resolve_all(block tables)

on every variant, with the same KV tensors (swaps really run):

- ``seed``: the plain restatement of the seed ``OnlineDefragmenter`` + ``CacheSwapUtils``
  (``tests/seed_reference.py``): the baseline;
- ``kvlog, no log``: the facade's Engine with no log;
- ``kvlog, log sync=none``: the log written, fsync only at close;
- ``kvlog, log sync=step``: an fsync at every ``StepEnded`` (group commit).

Printed: mean and p99 microseconds per step, the ratio to the seed and to the facade without
a log, and the log's bytes per step. The fsync figure depends on the disk under the temp dir.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from seed_reference import SeedDefragmenter, make_hpu_caches

from kvlog.integrations import OnlineDefragmenter

NUM_BLOCKS = 4096
BLOCK_SIZE = 16
THRESHOLD = 32


@dataclass
class Step:
    new_blocks: dict[str, list[int]]
    finished: list[str]
    tables: list[list[int]]


def make_trace(num_steps: int, seed: int = 0) -> tuple[list[Step], list[Step]]:
    """(warm-up steps that fill the pool, timed steps), from one FIFO-free-list scheduler."""
    rng = random.Random(seed)
    free: deque[int] = deque(range(1, NUM_BLOCKS))
    live: dict[str, list[int]] = {}
    steps: list[Step] = []
    serial = 0
    fill = int(0.8 * NUM_BLOCKS)
    num_warm = -1
    while num_warm < 0 or len(steps) < num_warm + num_steps:
        if num_warm < 0 and NUM_BLOCKS - len(free) >= fill:
            num_warm = len(steps)
        new: dict[str, list[int]] = {}
        finished = []
        while NUM_BLOCKS - len(free) > fill and live:
            req_id = rng.choice(sorted(live))
            free.extend(live.pop(req_id))
            finished.append(req_id)
        for req_id in rng.sample(sorted(live), min(8, len(live))):
            if free:
                block = free.popleft()
                live[req_id].append(block)
                new[req_id] = [block]
        filling = NUM_BLOCKS - len(free) < fill
        for _ in range(rng.randint(4, 8) if filling else rng.randint(0, 2)):
            n = rng.randint(4, 64)
            if len(free) > n:
                serial += 1
                req_id = f"req-{serial}"
                live[req_id] = [free.popleft() for _ in range(n)]
                new[req_id] = list(live[req_id])
        steps.append(Step(new, finished, [list(t) for t in live.values()]))
    return steps[:num_warm], steps[num_warm:]


Runner = Callable[[Step], None]


def seed_runner(threshold: int) -> tuple[Runner, Callable[[], None]]:
    defrag = SeedDefragmenter(threshold=threshold)
    defrag.initialize(make_hpu_caches(NUM_BLOCKS, BLOCK_SIZE), BLOCK_SIZE)

    def step(s: Step) -> None:
        defrag.update_state(s.new_blocks, s.finished)
        defrag.defragment()
        defrag.resolve_all(s.tables)

    return step, lambda: None


def facade_runner(
    threshold: int, log_path: str | None, sync: str
) -> tuple[Runner, Callable[[], None]]:
    env = {"VLLM_DEFRAG_THRESHOLD": str(threshold), "KVLOG_SYNC": sync}
    if log_path is not None:
        env["KVLOG_PATH"] = log_path
    defrag = OnlineDefragmenter(environ=env, backend="cpu")
    defrag.initialize(make_hpu_caches(NUM_BLOCKS, BLOCK_SIZE), BLOCK_SIZE)

    def step(s: Step) -> None:
        defrag.update_state(s.new_blocks, s.finished)
        defrag.defragment()
        defrag.resolve_all(s.tables)

    return step, defrag.close


def measure(
    make: Callable[[], tuple[Runner, Callable[[], None]]],
    warm: list[Step],
    timed: list[Step],
) -> list[float]:
    step, close = make()
    for s in warm:
        step(s)
    times = []
    for s in timed:
        start = time.perf_counter()
        step(s)
        times.append(time.perf_counter() - start)
    close()
    return times


def p99(values: list[float]) -> float:
    return sorted(values)[min(len(values) - 1, int(0.99 * len(values)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="300 steps, one pass")
    args = parser.parse_args()
    num_steps, repeats = (300, 1) if args.quick else (1000, 3)
    warm, timed = make_trace(num_steps)
    for threshold in (THRESHOLD, NUM_BLOCKS):
        what = "defrag fires" if threshold == THRESHOLD else "defrag never fires"
        print(f"\nthreshold {threshold} ({what}):")
        run_variants(threshold, warm, timed, repeats)


def run_variants(threshold: int, warm: list[Step], timed: list[Step], repeats: int) -> None:
    """Every variant once per round (rounds interleave them against machine noise)."""
    tmp = tempfile.mkdtemp(prefix="kvlog-bench-facade-")
    none_log, step_log = os.path.join(tmp, "none.kvlog"), os.path.join(tmp, "step.kvlog")
    variants: list[tuple[str, Callable[[], tuple[Runner, Callable[[], None]]], str | None]] = [
        ("seed (baseline)", lambda: seed_runner(threshold), None),
        ("kvlog, no log", lambda: facade_runner(threshold, None, "none"), None),
        ("kvlog, log sync=none", lambda: facade_runner(threshold, none_log, "none"), none_log),
        ("kvlog, log sync=step", lambda: facade_runner(threshold, step_log, "step"), step_log),
    ]
    runs: dict[str, list[list[float]]] = {name: [] for name, _, _ in variants}
    log_bytes: dict[str, int] = {}
    for _ in range(repeats):
        for name, make, path in variants:
            if path is not None and os.path.exists(path):
                os.remove(path)
            runs[name].append(measure(make, warm, timed))
            if path is not None:
                log_bytes[name] = os.path.getsize(path)
    results = {name: min(r, key=statistics.fmean) for name, r in runs.items()}
    report(results, log_bytes, len(warm) + len(timed), len(timed))


def report(
    results: dict[str, list[float]], log_bytes: dict[str, int], total_steps: int, num_steps: int
) -> None:
    seed = statistics.fmean(results["seed (baseline)"])
    bare = statistics.fmean(results["kvlog, no log"])
    warmup = total_steps - num_steps
    print(f"{NUM_BLOCKS} blocks, {num_steps} timed steps (after {warmup} warm-up steps)")
    print(f"{'variant':24} {'mean us':>9} {'p99 us':>9} {'vs seed':>8} {'vs no log':>10} B/step")
    for name, times in results.items():
        mean = statistics.fmean(times)
        per_step = log_bytes.get(name, 0) / total_steps
        print(
            f"{name:24} {mean * 1e6:9.1f} {p99(times) * 1e6:9.1f} {mean / seed:8.2f} "
            f"{mean / bare:10.2f} {per_step:6.0f}"
        )


if __name__ == "__main__":
    main()

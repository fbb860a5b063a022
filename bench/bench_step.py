"""Per-step cost of the whole Engine step with its log on, next to the seed, from 4k to 1M blocks.

    python bench/bench_step.py            # 4200 timed steps per size (a snapshot included)
    python bench/bench_step.py --quick    # 600 timed steps, 32k blocks and the 4k/1M pair only

A step is what the scheduler hands kvlog per step on a FIFO-pool trace with defrag firing:
finishes while the pool is above 80% full, 0-2 arrivals of 4-64 blocks, 8 live requests
growing by one block, then ``StepEnded`` (defrag at the seed's default threshold, 32). Each
step goes through ``Engine.apply`` with a log (``sync="none"``; ``"step"``, one fsync per step,
is printed beside it), default checkpoint and snapshot cadence, so checkpoints and snapshots
are inside the figures. The baseline, measured in the same run on the same steps (each kvlog
run followed by a seed run, so that a slow spell of the machine hits both), is the seed's
bookkeeping and ``defragment()`` (``tests/seed_model.py``: a ``max()`` and ``sorted()`` over
every used block each step); its pairs are checked equal to kvlog's. Printed: kvlog's mean us
per step and per event, the seed's, their ratio, and kvlog's per-event cost at each size over
the smallest size's.
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from seed_model import SeedDefragmenter

from kvlog import Engine
from kvlog.events import (
    BlocksAllocated,
    CacheConfigured,
    Event,
    RequestFinished,
    StepEnded,
    SwapPlan,
)

SIZES = (4096, 32768, 131072, 1 << 20)
SEED_SIZES = (4096, 32768, 131072)
ARRIVALS, GROWTHS, TARGET, THRESHOLD = (0, 0, 1, 1, 2), 8, 0.8, 32


class Trace:
    """The simulated scheduler: a FIFO free list (like vLLM's), live tables, seeded."""

    def __init__(self, num_gpu_blocks: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.num_gpu_blocks = num_gpu_blocks
        self.free = collections.deque(range(1, num_gpu_blocks))
        self.tables: dict[str, list[int]] = {}
        self.live: list[str] = []
        self.next_req = 0
        self.used = 0

    def _take(self, req_id: str, k: int) -> BlocksAllocated:
        blocks = [self.free.popleft() for _ in range(k)]
        self.tables.setdefault(req_id, []).extend(blocks)
        self.used += k
        return BlocksAllocated(req_id=req_id, block_ids=blocks)

    def _arrive(self) -> BlocksAllocated:
        req_id = f"req-{self.next_req}"
        self.next_req += 1
        self.live.append(req_id)
        return self._take(req_id, self.rng.randint(4, 64))

    def _finish(self) -> RequestFinished:
        i = self.rng.randrange(len(self.live))
        self.live[i], self.live[-1] = self.live[-1], self.live[i]
        req_id = self.live.pop()
        blocks = self.tables.pop(req_id)
        self.free.extend(blocks)
        self.used -= len(blocks)
        return RequestFinished(req_id=req_id)

    def warm_up(self) -> list[Event]:
        events: list[Event] = []
        while self.used < TARGET * self.num_gpu_blocks:
            events.append(self._arrive())
        return events

    def step(self, step: int) -> list[Event]:
        events: list[Event] = []
        while self.used > TARGET * self.num_gpu_blocks - max(ARRIVALS) * 64:
            events.append(self._finish())
        events.extend(self._arrive() for _ in range(self.rng.choice(ARRIVALS)))
        for _ in range(GROWTHS):
            events.append(self._take(self.rng.choice(self.live), 1))
        events.append(StepEnded(step=step))
        return events


def seed_apply(seed: SeedDefragmenter, event: Event) -> list[tuple[int, int]]:
    """One event on the seed side; the pairs of its ``defragment()`` at ``StepEnded``."""
    if isinstance(event, BlocksAllocated):
        seed.allocate(event.req_id, event.block_ids)
    elif isinstance(event, RequestFinished):
        seed.release(event.req_id)
    elif isinstance(event, StepEnded):
        return seed.defragment()
    return []


def seed_run(size: int, warm: list[Event], steps: list[list[Event]]) -> tuple[float, list]:
    """The seed's mean us per step, and its pairs per step."""
    seed = SeedDefragmenter(threshold=THRESHOLD)
    for event in warm:
        assert isinstance(event, BlocksAllocated)
        seed.allocate(event.req_id, event.block_ids)
    clock, total, pairs = time.perf_counter_ns, 0, []
    for events in steps:
        t0 = clock()
        got = [pair for event in events for pair in seed_apply(seed, event)]
        total += clock() - t0
        pairs.append(got)
    return total / 1e3 / len(steps), pairs


def kvlog_run(
    size: int, warm: list[Event], steps: list[list[Event]], sync: str, directory: str
) -> tuple[float, list]:
    """kvlog's mean us per step (log on, default checkpoints), and its pairs per step."""
    config = CacheConfigured(num_gpu_blocks=size, block_size=16, threshold=THRESHOLD)
    path = os.path.join(directory, f"{size}-{sync}.kvlog")
    engine = Engine(config, log_path=path, sync=sync)  # type: ignore[arg-type]
    for event in warm:
        engine.apply(event)
    engine.checkpoint()  # untimed: the warm-up's own checkpoint (hashes what it built)
    clock, total, pairs = time.perf_counter_ns, 0, []
    apply = engine.apply
    for events in steps:
        t0 = clock()
        plans = [plan for event in events for plan in apply(event)]
        total += clock() - t0
        pairs.append([pair for p in plans if type(p) is SwapPlan for pair in p.pairs])
    engine.close()
    os.unlink(path)
    return total / 1e3 / len(steps), pairs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="600 steps; 4k, 32k and 1M")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per size")
    parser.add_argument("--repeat", type=int, default=3, help="runs per side (best kept)")
    args = parser.parse_args(argv)
    num_steps = args.steps or (600 if args.quick else 4200)
    sizes = (4096, 32768, 1 << 20) if args.quick else SIZES
    print(f"{num_steps} steps per size, best of {args.repeat}, log on, default checkpoints")
    print(
        "blocks   events/step  defrag%  kvlog none us/step  us/event   step-sync us/step"
        "   seed us/step  seed/kvlog"
    )
    per_event: dict[int, float] = {}
    with tempfile.TemporaryDirectory() as directory:
        for size in sizes:
            trace = Trace(size, seed=size)
            warm = trace.warm_up()
            steps = [trace.step(s) for s in range(num_steps)]
            num_events = sum(len(s) for s in steps) / num_steps
            gc.collect()
            gc.freeze()  # the pre-built trace is no garbage to scan, on either side
            runs, seed_runs = [], []
            for _ in range(args.repeat):  # interleaved: a slow spell of the machine hits both
                runs.append(kvlog_run(size, warm, steps, "none", directory))
                if size in SEED_SIZES:
                    seed_runs.append(seed_run(size, warm, steps))
            none_us, ours = min(runs, key=lambda run: run[0])
            step_us, _ = kvlog_run(size, warm, steps, "step", directory)
            per_event[size] = none_us / num_events
            fired = 100 * sum(bool(p) for p in ours) / num_steps
            seed_text = "-"
            if seed_runs:
                seed_us, theirs = min(seed_runs, key=lambda run: run[0])
                assert ours == theirs, "kvlog and the seed disagree"
                seed_text = f"{seed_us:12.0f}  {seed_us / none_us:9.1f}x"
            print(
                f"{size:>8}  {num_events:10.1f}  {fired:6.1f}  {none_us:18.1f}  "
                f"{per_event[size]:8.2f}  {step_us:18.1f}   {seed_text}"
            )
            del warm, steps
            gc.unfreeze()
    small = min(per_event)
    for size in sorted(per_event):
        ratio = per_event[size] / per_event[small]
        print(f"per-event cost at {size} blocks / at {small}: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

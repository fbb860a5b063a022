"""Per-step cost of kvlog's reducers next to the plain seed algorithm, at 4k, 32k and 131k blocks.

    python bench/bench_reducers.py            # 1500 timed steps per size
    python bench/bench_reducers.py --quick    # 200 timed steps per size

One synthetic serving trace shape at every size: the pool is filled to ~80% (untimed), then
every step 0, 1 or 2 requests arrive (4..64 blocks each), 8 live requests grow by one block,
and random live requests finish while more than 80% of the pool is used (so the pool stays in a
70-90% band and finishes leave holes); block ids come from a FIFO free list, like vLLM's. Per-
step event volume is the same at every size; only the pool (and the live requests in it) grows.
Both sides get the same events, timed one side after the other; the seed side is the seed as
the plugin ships it (``tests/support/seed_reference.py`` without KV tensors: ``update_state`` per
scheduler input, ``defragment()`` with its ``max()`` and two ``sorted()`` over every used
block; see ``bench_step.py``). Their pairs are checked equal, step by step. A step is all
of its events plus its ``StepEnded``. Printed: mean and p99 in microseconds and seed/kvlog,
once with the seed's default threshold (defrag fires on most steps) and once with a threshold
no pool can exceed (the trigger is evaluated and never fires: the cost of a step without
defrag), and kvlog's no-defrag step cost at the largest size over the smallest.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_step import ARRIVALS, GROWTHS, Trace, shipped_apply
from seed_reference import SEED_PAD_SIZES
from seed_reference import SeedDefragmenter as SeedShipped

from kvlog.events import CacheConfigured, SwapPlan
from kvlog.reducers import initial_state, reduce

SIZES = (4096, 32768, 131072)


def run_size(num_gpu_blocks: int, num_steps: int, threshold: int) -> dict[str, list[float]]:
    """Time every step on both sides; returns per-step microseconds and defrag flags."""
    trace = Trace(num_gpu_blocks, seed=num_gpu_blocks)
    config = CacheConfigured(num_gpu_blocks=num_gpu_blocks, block_size=16, threshold=threshold)
    state, _ = reduce(initial_state(), config)
    assert config.max_swaps == SEED_PAD_SIZES[-1], "the shipped seed caps pairs at 512"
    seed = SeedShipped(threshold=config.threshold)
    for event in trace.warm_up():
        reduce(state, event)
        shipped_apply(seed, event)
    steps = [trace.step(s) for s in range(num_steps)]
    clock = time.perf_counter_ns
    kvlog_us, seed_us, ours, theirs = [], [], [], []
    for events in steps:  # one side at a time, so neither evicts the other from the caches
        t0 = clock()
        plans = [p for e in events for p in reduce(state, e)[1]]
        kvlog_us.append((clock() - t0) / 1e3)
        ours.append([pair for p in plans if isinstance(p, SwapPlan) for pair in p.pairs])
    for events in steps:
        t0 = clock()
        pairs = [pair for e in events for pair in shipped_apply(seed, e)]
        seed_us.append((clock() - t0) / 1e3)
        theirs.append(pairs)
    assert ours == theirs, "kvlog and the seed disagree"
    return {"kvlog": kvlog_us, "seed": seed_us, "defrag": [float(bool(p)) for p in ours]}


def p99(values: list[float]) -> float:
    return sorted(values)[min(len(values) - 1, int(0.99 * len(values)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="200 steps per size")
    parser.add_argument("--steps", type=int, default=None)
    args = parser.parse_args()
    num_steps = args.steps or (200 if args.quick else 1500)
    print(f"{num_steps} steps per size; per step: {ARRIVALS} arrivals, {GROWTHS} growths, finishes")
    header = "blocks  defrag%   kvlog mean / p99 us    seed mean / p99 us   seed/kvlog"
    quiet: dict[int, float] = {}
    for title, threshold in (("threshold 32 (seed default)", 32), ("no defrag fires", -1)):
        print(f"-- {title}\n{header}")
        for size in SIZES:
            r = run_size(size, num_steps, size if threshold < 0 else threshold)
            k_mean, s_mean = statistics.mean(r["kvlog"]), statistics.mean(r["seed"])
            if threshold < 0:
                assert not any(r["defrag"]), "the trigger cannot fire above the pool size"
                quiet[size] = k_mean
            print(
                f"{size:>6}  {100 * statistics.mean(r['defrag']):6.1f}  "
                f"{k_mean:9.1f} / {p99(r['kvlog']):8.1f}   {s_mean:9.1f} / {p99(r['seed']):8.1f}"
                f"   {s_mean / k_mean:8.1f}x"
            )
    small, large = SIZES[0], SIZES[-1]
    ratio = quiet[large] / quiet[small]
    print(f"kvlog step without defrag, {large} vs {small} blocks: {ratio:.2f}x")


if __name__ == "__main__":
    main()

"""LRU's and the optimum's whole hit-rate curves, one pass each, next to per-capacity replays.

    python bench/bench_tier_curve.py                  # the full Mooncake trace, 4096 chunks
    python bench/bench_tier_curve.py --requests 1000  # a prefix of it

The Mooncake synthetic trace (``../shared/traces``) as CPU tier accesses (512-token chunks,
16 keys a store batch): ``lru_curve`` and ``opt_curve`` give the hits at every capacity
0..N in one pass each; each replay (through the tier reducer for vLLM's LRU, through
``belady`` for the optimum) gives one capacity. Printed per curve: the pass's time (the
optimum's compiled pass after a warm-up call on a prefix, so no compile time is counted),
the time of one replay at each of four capacities (with the hit counts, equal to the
curve's), and the ratio of the N replays the curve stands for to the one pass (measured in
this run).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from kvlog.synth.traces import read_trace
from kvlog.tier.optimum import belady, lru_curve, opt_curve
from kvlog.tier.trace import TierAccess, accesses_from_trace
from kvlog.tier.variants import TierVariant
from kvlog.tier.whatif import run_variant

TRACE = os.path.join(
    os.path.dirname(__file__), "..", "..", "shared", "traces", "mooncake_synthetic_trace.jsonl"
)


def _compare(
    name: str,
    curve_of: Callable[[], npt.NDArray[np.int64]],
    replay: Callable[[int], int],
    max_chunks: int,
) -> None:
    started = time.perf_counter()
    curve = curve_of()
    pass_s = time.perf_counter() - started
    print(f"{name}: one pass, capacities 0..{max_chunks}: {pass_s:.3f} s")
    replay_s = []
    for num_chunks in (64, 256, 1024, max_chunks):
        started = time.perf_counter()
        hits = replay(num_chunks)
        replay_s.append(time.perf_counter() - started)
        same = "equal" if hits == curve[num_chunks] else f"DIFFERENT (curve {curve[num_chunks]})"
        print(f"  replay at {num_chunks:5d} chunks: {replay_s[-1]:.3f} s, {hits} hits, {same}")
    mean_s = sum(replay_s) / len(replay_s)
    print(
        f"  one replay / one pass: {mean_s / pass_s:.1f}x; the {max_chunks} replays the "
        f"curve stands for / one pass: {mean_s * max_chunks / pass_s:,.0f}x"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default=TRACE)
    p.add_argument("--requests", type=int)
    p.add_argument("--max-chunks", type=int, default=4096)
    args = p.parse_args()
    requests = read_trace(args.trace, limit=args.requests)
    accesses: Sequence[TierAccess] = accesses_from_trace(requests)
    asked = sum(len(a.keys) for a in accesses)
    print(f"{len(accesses)} requests, {asked} chunk asks")
    n = args.max_chunks
    _compare(
        "LRU",
        lambda: lru_curve(accesses, n),
        lambda c: run_variant(accesses, TierVariant("lru", c)).tally.blocks_hit,
        n,
    )
    opt_curve(accesses[:10], 16)  # compile (or read numba's cache) outside the timing
    _compare(
        "optimum",
        lambda: opt_curve(accesses, n),
        lambda c: belady(accesses, TierVariant("opt", c)).blocks_hit,
        n,
    )


if __name__ == "__main__":
    main()

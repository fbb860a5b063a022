"""LRU's whole hit-rate curve in one stack-distance pass, next to per-capacity replays.

    python bench/bench_tier_curve.py                  # the full Mooncake trace, 4096 chunks
    python bench/bench_tier_curve.py --requests 1000  # a prefix of it

The Mooncake synthetic trace (``../shared/traces``) as CPU tier accesses (512-token chunks):
``lru_curve`` gives the hits at every capacity 0..N in one pass; each replay through the
tier reducer (vLLM's LRU) gives one capacity. Printed: the pass's time, the time of one
replay at each of four capacities (and the four hit counts, equal to the curve's), and the
ratio of the N replays the curve stands for to the one pass (measured in this run).
"""

from __future__ import annotations

import argparse
import os
import time

from kvlog.synth.traces import read_trace
from kvlog.tier.optimum import lru_curve
from kvlog.tier.trace import accesses_from_trace
from kvlog.tier.whatif import TierVariant, run_variant

TRACE = os.path.join(
    os.path.dirname(__file__), "..", "..", "shared", "traces", "mooncake_synthetic_trace.jsonl"
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default=TRACE)
    p.add_argument("--requests", type=int)
    p.add_argument("--max-chunks", type=int, default=4096)
    args = p.parse_args()
    accesses = accesses_from_trace(read_trace(args.trace, limit=args.requests))
    asked = sum(len(a.keys) for a in accesses)
    print(f"{len(accesses)} requests, {asked} chunk asks")
    started = time.perf_counter()
    curve = lru_curve(accesses, args.max_chunks)
    pass_s = time.perf_counter() - started
    print(f"one pass, capacities 0..{args.max_chunks}: {pass_s:.3f} s")
    replay_s = []
    for num_chunks in (64, 256, 1024, args.max_chunks):
        started = time.perf_counter()
        hits = run_variant(accesses, TierVariant("lru", num_chunks)).tally.blocks_hit
        replay_s.append(time.perf_counter() - started)
        same = "equal" if hits == curve[num_chunks] else f"DIFFERENT (curve {curve[num_chunks]})"
        print(f"replay at {num_chunks:5d} chunks: {replay_s[-1]:.3f} s, {hits} hits, {same}")
    mean_s = sum(replay_s) / len(replay_s)
    print(
        f"one replay / one pass: {mean_s / pass_s:.1f}x; the {args.max_chunks} replays the "
        f"curve stands for / one pass: {mean_s * args.max_chunks / pass_s:,.0f}x"
    )


if __name__ == "__main__":
    main()

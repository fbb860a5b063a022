"""Synthesize a CPU tier log from a public trace (``python -m kvlog.tier.synth``).

The trace's requests become accesses (``trace.py``: Mooncake ``hash_ids`` as shared prefix
keys, preemption as a second ask), run through the tier reducer the way the connector's
scheduler side calls vLLM's manager, and every call is written with its answer, as
``TierRecorder`` writes a real run: ``CacheConfigured`` (the log's first event, a GPU pool
with defrag off), ``TierConfigured``, then the tier events. ``replay_tier`` replays it
exactly and ``kvlog sweep --cpu-bytes`` asks it what-ifs.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from kvlog.errors import ConfigError, KvlogError
from kvlog.events import CacheConfigured, TierEvent
from kvlog.runtime.engine import Engine
from kvlog.synth.traces import TRACE_FORMATS, read_trace
from kvlog.tier.trace import accesses_from_trace
from kvlog.tier.variants import TierTally, TierVariant
from kvlog.tier.whatif import replay_policy

__all__ = ["main", "synth_tier_log"]


def synth_tier_log(
    trace: str | os.PathLike[str],
    out: str | os.PathLike[str],
    variant: TierVariant,
    *,
    fmt: str | None = None,
    limit: int | None = None,
    gpu_tokens: int = 0,
) -> TierTally:
    """Write the tier log of ``trace`` under ``variant`` (``lru``/``arc``) to ``out``."""
    requests = read_trace(trace, fmt, limit=limit)
    accesses = accesses_from_trace(requests, variant.tokens_per_chunk, gpu_tokens)
    config = CacheConfigured(num_gpu_blocks=max(1, gpu_tokens // 16), block_size=16, defrag=False)
    with Engine(config, log_path=out, sync="none") as engine:

        def record(event: TierEvent) -> None:
            engine.apply(event)

        return replay_policy(accesses, variant, record)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvlog.tier.synth", description=__doc__)
    p.add_argument("trace")
    p.add_argument("--out", required=True)
    p.add_argument("--trace-format", choices=TRACE_FORMATS)
    p.add_argument("--requests", type=int, help="only the first N requests")
    p.add_argument("--num-chunks", type=int, default=1024)
    p.add_argument("--eviction", choices=("lru", "arc"), default="lru")
    p.add_argument("--store-threshold", type=int, default=0)
    p.add_argument("--tokens-per-chunk", type=int, default=512)
    p.add_argument("--bytes-per-token", type=int, default=131072)
    p.add_argument("--gpu-tokens", type=int, default=0, help="preemption model (0: none)")
    args = p.parse_args(argv)
    try:
        tally = _synth(args)
    except (KvlogError, OSError) as exc:  # one line, exit 2, as the kvlog commands do
        print(f"{p.prog}: {exc}", file=sys.stderr)
        return 2
    print(
        f"{args.out}: {tally.accesses} accesses, {tally.blocks_hit}/{tally.blocks_asked} "
        f"chunks hit, {tally.blocks_stored} stored, {tally.evictions} evicted"
    )
    return 0


def _synth(args: argparse.Namespace) -> TierTally:
    """Check the flags as ``kvlog sweep --cpu-bytes`` does (before anything is written),
    then write the log."""
    from kvlog.tier.variants import check_tier_values

    check_tier_values(
        evictions=[args.eviction],
        store_thresholds=[args.store_threshold],
        tokens_per_chunk=args.tokens_per_chunk,
        bytes_per_token=args.bytes_per_token,
        gpu_tokens=args.gpu_tokens,
    )
    for flag, value in (("--requests", args.requests), ("--num-chunks", args.num_chunks)):
        if value is not None and value < 1:
            raise ConfigError(flag, value, "an int >= 1")
    variant = TierVariant(
        args.eviction,
        args.num_chunks,
        args.store_threshold,
        args.tokens_per_chunk,
        args.tokens_per_chunk * args.bytes_per_token,
    )
    return synth_tier_log(
        args.trace,
        args.out,
        variant,
        fmt=args.trace_format,
        limit=args.requests,
        gpu_tokens=args.gpu_tokens,
    )


if __name__ == "__main__":
    sys.exit(main())

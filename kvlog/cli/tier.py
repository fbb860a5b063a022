"""``kvlog sweep --cpu-bytes``: the CPU tier's what-ifs at the command line, and the words
around a sweep (a deprecated spelling, a local Ray too small to be worth starting).

A LOG is a public trace (by its extension) or a kvlog log with tier events; a log is asked
in its own chunks (its ``TierConfigured``), one with no tier events is refused in one line
(exit 2), the defrag policy flags beside ``--cpu-bytes`` are refused (they would be
ignored), and a source no tier can serve says why its hit rates are 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from kvlog.analysis.cost import cost_model
from kvlog.cli.flags import check_tier_flags, ratio_text
from kvlog.errors import ConfigError
from kvlog.present.text import progress_bar, render_table, tier_table
from kvlog.tier.variants import TierVariant
from kvlog.util.units import plural, printable, size_label

__all__ = ["SMALL_RAY_CPUS", "cmd_tier_sweep", "deprecated_spellings", "ray_note"]

SMALL_RAY_CPUS = 2
"""A local Ray on this many CPUs or fewer costs more to start than it saves (on 2 shared
cores a 15-variant sweep took 23 s on Ray against 14 s with ``--serial``)."""
_DEFRAG_LISTS = {
    "policy": "--policy",
    "threshold": "--threshold",
    "ratio_limit": "--ratio-limit",
    "min_swaps": "--min-swaps",
    "budget": "--max-bytes-per-step",
    "max_swaps": "--max-swaps",
}
"""``kvlog sweep``'s defrag policy lists (dest: flag): a tier sweep does not use them."""


def cmd_tier_sweep(args: argparse.Namespace) -> int:
    """``kvlog sweep --cpu-bytes``: the CPU tier's what-ifs (``kvlog/tier/sweep.py``)."""
    from kvlog.present.pictures import write_tier_plot
    from kvlog.tier.sweep import run_tier_sweep, write_tier_csv

    _refuse_defrag_lists(args)
    check_tier_flags(args)
    cost = cost_model(args.hardware, args.hbm_tbps, args.link_gbps)
    plan = [(log, _tier_variants(args, log)) for log in args.logs]
    ray_note(args)
    started = time.perf_counter()
    with progress_bar("tier what-ifs") as update:
        rows, curves = run_tier_sweep(
            plan,
            args.prefill_us_per_token * 1e-6,
            cost,
            use_ray=not args.serial,
            address=args.address,
            num_cpus=args.num_cpus,
            progress=update,
            gpu_tokens=args.gpu_tokens,
        )
    print(render_table(tier_table(rows), header=True))
    os.makedirs(args.out, exist_ok=True)
    csv_path, png_path = os.path.join(args.out, "sweep.csv"), os.path.join(args.out, "sweep.png")
    write_tier_csv(csv_path, rows)
    write_tier_plot(png_path, rows, curves)
    for curve in curves:
        if curve.reasked == 0:
            print(f"\n{printable(os.path.basename(curve.log))}: {_why_no_hit(args, curve.log)}")
    print(f"\nwrote {csv_path} and {png_path} ({time.perf_counter() - started:.1f} s)")
    return 0


def _refuse_defrag_lists(args: argparse.Namespace) -> None:
    for name, flag in _DEFRAG_LISTS.items():
        values = getattr(args, name, None)
        if values is not None:
            why = "a CPU tier sweep tries tier variants, not defrag policies"
            raise ConfigError(flag, values, f"no --cpu-bytes with it: {why}",
                              shown=f"{flag} {_shown(name, values)}")  # fmt: skip


def _shown(name: str, values: Sequence[Any]) -> str:
    """A list flag's values as typed: ``8,16``, ``64MiB``, ``1.5``."""
    show = {"budget": size_label, "ratio_limit": ratio_text}.get(name, str)
    return ",".join(show(v) for v in values)


def _tier_variants(args: argparse.Namespace, log: str) -> list[TierVariant]:
    """The variants to try on ``log``: in its own chunks where it is a log (its
    ``TierConfigured``; refused if it has none), else in the flags' (512 tokens of 128 KiB
    by default). A flag the log contradicts is refused, not ignored."""
    from kvlog.tier.sweep import log_tier_config, tier_grid

    config = log_tier_config(log)
    tokens, per_token = args.tokens_per_chunk, args.bytes_per_token
    if config is None or not config.tokens_per_chunk:
        return tier_grid(args.cpu_bytes, args.eviction, args.store_threshold,
                         tokens or 512, per_token or 131072)  # fmt: skip
    if args.gpu_tokens:
        raise ConfigError("--gpu-tokens", args.gpu_tokens, "a trace to model preemption on: "
                          f"{printable(log)} is a log, its preemptions are its own")  # fmt: skip
    own = config.chunk_bytes or config.tokens_per_chunk * (per_token or 131072)
    for flag, given, mine in (
        ("--tokens-per-chunk", tokens, config.tokens_per_chunk),
        ("--bytes-per-token", per_token, own // config.tokens_per_chunk),
    ):
        if given is not None and given != mine:
            raise ConfigError(flag, given, f"{mine}, {printable(log)}'s own (its keys are its "
                              "chunks)")  # fmt: skip
    return tier_grid(args.cpu_bytes, args.eviction, args.store_threshold,
                     config.tokens_per_chunk, chunk_bytes=own)  # fmt: skip


def _why_no_hit(args: argparse.Namespace, log: str) -> str:
    """Why no tier serves anything on ``log``: no chunk is asked for twice, and what would
    make one be."""
    from kvlog.synth.traces import read_trace
    from kvlog.tier.sweep import NO_REASK, is_trace

    if not is_trace(log):
        return f"{NO_REASK} (the log's requests never ask for a chunk asked before)"
    shares = any(r.hash_ids for r in read_trace(log, limit=64))
    why = [] if shares else ["the trace has no prefix hashes (Azure: no request shares a chunk)"]
    if not args.gpu_tokens:
        why.append("--gpu-tokens 0 models no preemption (a preempted request asks again): "
                   "give --gpu-tokens N, the KV tokens the GPU holds")  # fmt: skip
    return f"{NO_REASK}: " + "; ".join(why or ["no request asks again in this trace"])


def ray_note(args: argparse.Namespace) -> None:
    """One line on stderr where a local Ray has too few CPUs to be worth starting."""
    if args.serial or args.address is not None:
        return
    cpus = args.num_cpus or os.cpu_count() or 1
    if cpus <= SMALL_RAY_CPUS:
        print(
            f"kvlog sweep: a local Ray on {plural(cpus, 'CPU')} costs more to start than it "
            "saves: --serial runs the variants here, one by one, and is likely faster",
            file=sys.stderr,
        )


def deprecated_spellings(args: argparse.Namespace) -> None:
    """``--budget`` is ``--max-bytes-per-step`` (replay's name for the same cap): taken,
    with one line on stderr; both at once are refused."""
    old = args.budget_deprecated
    if old is None:
        return
    if args.budget is not None:
        raise ConfigError("--budget", old, "--max-bytes-per-step alone (the same flag)")
    print(
        "kvlog sweep: --budget is deprecated: it is --max-bytes-per-step, as replay names it",
        file=sys.stderr,
    )
    args.budget = old

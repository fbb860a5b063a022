"""The command line for real traffic and what-ifs: ``synth --trace``, ``sweep``, ``replay
--parallel`` and the policy flags. It parses and prints: the defaults and checks of a trace
run are :mod:`kvlog.synth`'s, the tables, progress bars and pictures :mod:`kvlog.present`'s.

``kvlog.cli.entry`` builds the parser and calls in here; everything here takes parsed arguments.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from kvlog.analysis.cost import cost_model
from kvlog.cli.flags import (
    ListFlag,
    add_cost_flags,
    add_tier_flags,
    check_tier_flags,
    list_of,
    policy_name,
    ratio_pct,
    ratio_text,
    size_arg,
)
from kvlog.errors import ConfigError
from kvlog.present.text import (
    progress_bar,
    render_table,
    sweep_table,
    tier_table,
)
from kvlog.util.units import plural, size_label

__all__ = ["add_sweep", "check_sweep_flags", "cmd_sweep", "cmd_tier_sweep"]


def add_sweep(sub: Any, formatter: type[argparse.HelpFormatter] = argparse.HelpFormatter) -> None:
    from kvlog.analysis import grid as d

    p = sub.add_parser(
        "sweep",
        help="what-if replays of logs under many policies, on Ray",
        description="Replay every log under every policy variant (one Ray task each) and "
        "compare them: a table, DIR/sweep.csv and DIR/sweep.png.",
        formatter_class=formatter,
    )
    p.add_argument("logs", nargs="+", metavar="LOG")
    p.add_argument("--out", required=True, help="directory for sweep.csv and sweep.png")
    names = ", ".join(d.POLICY_NAMES)
    lists: tuple[ListFlag, ...] = (
        ("--policy", policy_name, "policy names", d.DEFAULT_POLICIES, f"of {names}", str),
        ("--threshold", int, "integers", d.DEFAULT_THRESHOLDS, "seed; budget: the least", str),
        ("--ratio-limit", ratio_pct, "ratios", d.DEFAULT_RATIOS_PCT, "tail: e.g. 1.25", ratio_text),
        ("--min-swaps", int, "integers", d.DEFAULT_MIN_SWAPS, "tail: skip fewer pairs", str),
        ("--budget", size_arg, "sizes", d.DEFAULT_BUDGETS, "budget: bytes per step", size_label),
    )  # fmt: skip
    for flag, kind, what, default, text, show in lists:
        shown = ",".join(show(v) for v in default)
        p.add_argument(
            flag,
            type=list_of(kind, what),
            default=list(default),
            help=f"{text} (default: {shown})",
        )
    p.add_argument("--max-swaps", type=list_of(int, "integers"), help="seed: caps per step")
    p.add_argument("--address", help="an existing Ray cluster (default: a local Ray)")
    p.add_argument("--num-cpus", type=int, help="local Ray: worker CPUs (default: all)")
    p.add_argument("--serial", action="store_true", help="no Ray: run here, one by one")
    add_cost_flags(p)
    add_tier_flags(p)


def cmd_tier_sweep(args: argparse.Namespace) -> int:
    """``kvlog sweep --cpu-bytes``: the CPU tier's what-ifs (``kvlog/tier/sweep.py``)."""
    from kvlog.present.pictures import write_tier_plot
    from kvlog.tier.sweep import run_tier_sweep, tier_grid, write_tier_csv

    check_tier_flags(args)
    cost = cost_model(args.hardware, args.hbm_tbps, args.link_gbps)
    variants = tier_grid(
        args.cpu_bytes,
        args.eviction,
        args.store_threshold,
        args.tokens_per_chunk,
        args.bytes_per_token,
    )
    started = time.perf_counter()
    with progress_bar("tier what-ifs") as update:
        rows, curves = run_tier_sweep(
            args.logs,
            variants,
            args.prefill_us_per_token * 1e-6,
            cost,
            use_ray=not args.serial,
            address=args.address,
            num_cpus=args.num_cpus,
            progress=update,
            gpu_tokens=args.gpu_tokens,
        )
    table = tier_table(rows)
    print(render_table(table, header=True))
    os.makedirs(args.out, exist_ok=True)
    csv_path, png_path = os.path.join(args.out, "sweep.csv"), os.path.join(args.out, "sweep.png")
    write_tier_csv(csv_path, rows)
    write_tier_plot(png_path, rows, curves)
    print(f"\nwrote {csv_path} and {png_path} ({time.perf_counter() - started:.1f} s)")
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from kvlog.analysis.grid import policy_grid, run_sweep, write_sweep_csv
    from kvlog.present.pictures import write_sweep_figure

    check_sweep_flags(args)
    if args.cpu_bytes:
        return cmd_tier_sweep(args)
    cost = cost_model(args.hardware, args.hbm_tbps, args.link_gbps)
    specs = policy_grid(
        args.policy,
        args.threshold,
        args.max_swaps or [None],
        args.ratio_limit,
        args.min_swaps,
        args.budget,
    )
    where = "here" if args.serial else (args.address or "a local Ray")
    print(
        f"kvlog sweep: {plural(len(args.logs), 'log')} x {plural(len(specs), 'policy', 'policies')}"
        f" on {where}; {cost.describe()}"
    )
    started = time.perf_counter()
    with progress_bar("what-ifs") as update:
        rows = run_sweep(
            args.logs,
            specs,
            cost,
            use_ray=not args.serial,
            address=args.address,
            num_cpus=args.num_cpus,
            progress=update,
        )
    print(render_table(sweep_table(rows), header=True))
    os.makedirs(args.out, exist_ok=True)
    csv_path, png_path = os.path.join(args.out, "sweep.csv"), os.path.join(args.out, "sweep.png")
    write_sweep_csv(csv_path, rows)
    write_sweep_figure(png_path, rows)
    print(f"\nwrote {csv_path} and {png_path} ({time.perf_counter() - started:.1f} s)")
    refused = [r for r in rows if r.rejected]
    if refused:
        print(f"{plural(len(refused), 'variant')} refused (named in the table and the picture)")
    return 1 if refused else 0


def check_sweep_flags(args: argparse.Namespace) -> None:
    """What ``kvlog sweep`` would fail on after its work, refused before it (ConfigError
    naming the flag, or MissingExtra): CPUs below 1, values no policy accepts, an ``--out``
    that cannot hold the CSV and the PNG, no matplotlib for the PNG, no Ray without
    ``--serial``."""
    from kvlog.analysis.pool import ray_module as _ray
    from kvlog.present.pictures import plt_module

    if args.num_cpus is not None and args.num_cpus < 1:
        raise ConfigError("--num-cpus", args.num_cpus, "an int >= 1")
    for flag, values, low in (
        ("--threshold", args.threshold, 0),
        ("--max-swaps", args.max_swaps or [], 1),
        ("--min-swaps", args.min_swaps, 1),
    ):
        if any(v < low for v in values):
            raise ConfigError(flag, values, f"ints >= {low}")
    out = os.path.abspath(args.out)
    parent = out if os.path.isdir(out) else os.path.dirname(out)
    if (os.path.exists(out) and not os.path.isdir(out)) or not os.access(parent, os.W_OK):
        raise ConfigError("--out", args.out, "a directory this user may write (or create)")
    plt_module("kvlog sweep's sweep.png")
    if not args.serial:
        _ray()

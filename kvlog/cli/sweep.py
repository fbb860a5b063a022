"""The command line for real traffic and what-ifs: ``synth --trace``, ``sweep``, ``replay
--parallel`` and the policy flags. It parses and prints: the defaults and checks of a trace
run are :mod:`kvlog.synth`'s, the tables, progress bars and pictures :mod:`kvlog.present`'s.

``kvlog.cli.entry`` builds the parser and calls in here; everything here takes parsed arguments.
"""

from __future__ import annotations

import argparse
import os
import time
from argparse import SUPPRESS
from collections.abc import Sequence
from typing import Any

import msgspec

from kvlog.analysis.cost import cost_model
from kvlog.analysis.policy import check_byte_budget
from kvlog.cli.flags import (
    ListFlag,
    add_cost_flags,
    add_tier_flags,
    list_of,
    policy_name,
    ratio_pct,
    ratio_text,
    recorded_config,
    size_arg,
)
from kvlog.cli.tier import cmd_tier_sweep, deprecated_spellings, ray_note
from kvlog.errors import ConfigError
from kvlog.present.text import progress_bar, render_table, sweep_table
from kvlog.util.units import plural, size_label

__all__ = ["add_sweep", "check_sweep_flags", "cmd_sweep"]


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
        ("--policy", policy_name, "policy names", d.DEFAULT_POLICIES,
         f"families to try, of {names}: seed and tail as replay's --policy, budget the seed "
         "under --max-bytes-per-step, off no defrag, recorded the log's own", str),
        ("--threshold", int, "integers", d.DEFAULT_THRESHOLDS, "seed; budget: the least", str),
        ("--ratio-limit", ratio_pct, "ratios", d.DEFAULT_RATIOS_PCT, "tail: e.g. 1.25", ratio_text),
        ("--min-swaps", int, "integers", d.DEFAULT_MIN_SWAPS, "tail: skip fewer pairs", str),
        ("--max-bytes-per-step", size_arg, "sizes", d.DEFAULT_BUDGETS,
         "budget: bytes one step's defrag may move, as replay's", size_label),
    )  # fmt: skip
    for flag, kind, what, default, text, show in lists:  # defaults: filled by cmd_sweep
        shown = ",".join(show(v) for v in default)
        dest = "budget" if flag == "--max-bytes-per-step" else None
        p.add_argument(
            flag,
            dest=dest,
            metavar=flag[2:].upper().replace("-", "_"),
            type=list_of(kind, what),
            help=f"{text} (default: {shown})",
        )
    p.add_argument(  # the old spelling: still taken, says it is deprecated
        "--budget", dest="budget_deprecated", type=list_of(size_arg, "sizes"), help=SUPPRESS
    )
    p.add_argument("--max-swaps", type=list_of(int, "integers"), help="seed: caps per step")
    p.add_argument("--address", help="an existing Ray cluster (default: a local Ray)")
    p.add_argument("--num-cpus", type=int, help="local Ray: worker CPUs (default: all)")
    p.add_argument("--serial", action="store_true", help="no Ray: run here, one by one")
    add_cost_flags(p)
    add_tier_flags(p)


def cmd_sweep(args: argparse.Namespace) -> int:
    from kvlog.analysis.grid import policy_grid, run_sweep, write_sweep_csv
    from kvlog.present.pictures import write_sweep_figure

    deprecated_spellings(args)
    if args.cpu_bytes:
        check_sweep_flags(args)
        return cmd_tier_sweep(args)
    _policy_defaults(args)
    check_sweep_flags(args)
    if "budget" in args.policy:
        _check_budgets(args.logs, args.budget)
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
    ray_note(args)
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
        ("--threshold", args.threshold or [], 0),
        ("--max-swaps", args.max_swaps or [], 1),
        ("--min-swaps", args.min_swaps or [], 1),
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


def _policy_defaults(args: argparse.Namespace) -> None:
    """The defrag policy lists not given take their defaults (``kvlog.analysis.grid``'s)."""
    from kvlog.analysis import grid as d

    defaults = {
        "policy": d.DEFAULT_POLICIES,
        "threshold": d.DEFAULT_THRESHOLDS,
        "ratio_limit": d.DEFAULT_RATIOS_PCT,
        "min_swaps": d.DEFAULT_MIN_SWAPS,
        "budget": d.DEFAULT_BUDGETS,
    }
    for name, default in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, list(default))


def _check_budgets(logs: Sequence[str], budgets: Sequence[int]) -> None:
    """A byte cap below one page of a log (it would move nothing: defrag off) is refused
    before any work, as synth and replay refuse it."""
    for log in logs:
        config = recorded_config(log)
        if config is None:
            continue
        for budget in budgets:
            capped = msgspec.structs.replace(config, defrag=True, max_bytes_per_step=budget)
            check_byte_budget(capped, "--max-bytes-per-step")

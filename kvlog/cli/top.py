"""``kvlog top LOG [--once] [--json]``: a live view of a log or log directory being written.

The view itself is ``kvlog.present.top`` (it only reads the log: no lock, nothing the writer
waits on). ``--once`` prints one snapshot and exits (a closed log: its summary); ``--json``
prints the same figures as JSON lines (one per refresh; one with ``--once``). A path that is
not a log is refused by ``kvlog``'s entry point before any work: one line, exit status 2.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from kvlog.errors import ConfigError
from kvlog.present.top import LogWatch, Sampler, render, snapshot_json, tier_log_beside

__all__ = ["add_top", "cmd_top"]


def add_top(sub: Any) -> None:
    p = sub.add_parser(
        "top",
        help="a live view of a log (or log directory) being written",
        description="A live view of a log or log directory being written (rich): steps/s, "
        "used blocks and fragmentation, defrag and transfer rates, jobs in flight, the CPU "
        "tier's hit rate and miss reasons, the recorder; --once: one snapshot; --json: JSON "
        "lines. It only reads the log.",
    )
    p.add_argument("log", help="a log file or log directory")
    p.add_argument("--once", action="store_true", help="print one snapshot and exit")
    p.add_argument("--json", action="store_true", help="JSON lines instead of the view")
    p.add_argument(
        "--interval", type=float, default=1.0, help="seconds between refreshes (live view)"
    )
    p.add_argument(
        "--count", type=int, default=0, help="refreshes before exiting (0: until Ctrl-C)"
    )


def cmd_top(args: argparse.Namespace) -> int:
    if not 0.05 <= args.interval <= 3600:
        raise ConfigError("--interval", args.interval, "seconds between 0.05 and 3600")
    if args.count < 0:
        raise ConfigError("--count", args.count, "a number of refreshes >= 0")
    watch = LogWatch(args.log)
    tier_path = tier_log_beside(args.log)
    sampler = Sampler(watch, None if tier_path is None else LogWatch(tier_path))
    if args.once:
        snap = sampler.sample()
        if args.json:
            print(snapshot_json(snap))
        else:
            from rich.console import Console

            Console().print(render(snap))
        return 0
    if args.json:
        return _json_lines(sampler, args.interval, args.count)
    return _live(sampler, args.interval, args.count)


def _json_lines(sampler: Sampler, interval: float, count: int) -> int:
    done = 0
    while True:
        print(snapshot_json(sampler.sample()), flush=True)
        done += 1
        if count and done >= count:
            return 0
        time.sleep(interval)


def _live(sampler: Sampler, interval: float, count: int) -> int:
    from rich.console import Console
    from rich.live import Live

    console = Console(file=sys.stdout)
    done = 0
    with Live(render(sampler.sample()), console=console, auto_refresh=False) as live:
        while not count or done < count:
            time.sleep(interval)
            live.update(render(sampler.sample()), refresh=True)
            done += 1
    return 0

"""The ``kvlog ranks`` subcommand: the logs of one server's ranks made the same decisions."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvlog.errors import ConfigError

__all__ = ["BEHIND_STATUS", "add_ranks", "cmd_ranks"]

BEHIND_STATUS = 3
"""``kvlog ranks``: the logs agree, but one ends before another (behind, not different)."""


def add_ranks(sub: Any) -> None:
    p = sub.add_parser(
        "ranks",
        help="check that the logs of one server's ranks made the same decisions",
        description="Read the logs (files or directories) of the tensor-parallel ranks of one "
        "server in lockstep: the same events modulo rank-local fields, the same digests at "
        "every checkpoint. Exit 1 naming the first step and event where one rank differs; exit 3 "
        "when they agree but one log ends before another (behind: logs still being written).",
    )
    p.add_argument("logs", nargs="+", metavar="LOG")


def cmd_ranks(args: argparse.Namespace) -> int:
    from kvlog.analysis.ranks import compare_ranks

    if len(args.logs) < 2:
        raise ConfigError("LOG", args.logs, "at least two logs (one per rank)")
    result = compare_ranks(args.logs)
    local = f"; rank-local fields normalized: {', '.join(result.normalized)}"
    if not result.ok:
        print(f"RANKS DIFFER: {result.difference}", file=sys.stdout)
        return 1
    counts = (
        f"{result.num_events:,} events, {result.num_checkpoints:,} checkpoints, "
        f"{result.num_steps:,} steps{local if result.normalized else ''}"
    )
    if result.behind:
        print(f"{len(args.logs)} ranks agree on every event they all hold ({counts}), but:")
        for behind in result.behind:
            print(f"  {behind}")
        return BEHIND_STATUS
    print(f"{len(args.logs)} ranks agree: {counts}")
    return 0

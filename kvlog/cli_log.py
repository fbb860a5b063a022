"""The ``kvlog ranks`` subcommand: the logs of one server's ranks made the same decisions."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvlog.errors import ConfigError

__all__ = ["add_ranks", "cmd_ranks"]


def add_ranks(sub: Any) -> None:
    p = sub.add_parser(
        "ranks",
        help="check that the logs of one server's ranks made the same decisions",
        description="Read the logs (files or directories) of the tensor-parallel ranks of one "
        "server in lockstep: the same events modulo rank-local fields, the same digests at "
        "every checkpoint. Exit 1 naming the first step and event where one rank differs.",
    )
    p.add_argument("logs", nargs="+", metavar="LOG")


def cmd_ranks(args: argparse.Namespace) -> int:
    from kvlog.ranks import compare_ranks

    if len(args.logs) < 2:
        raise ConfigError("LOG", args.logs, "at least two logs (one per rank)")
    result = compare_ranks(args.logs)
    local = f"; rank-local fields normalized: {', '.join(result.normalized)}"
    if result.ok:
        print(
            f"{len(args.logs)} ranks agree: {result.num_events:,} events, "
            f"{result.num_checkpoints:,} checkpoints, {result.num_steps:,} steps"
            f"{local if result.normalized else ''}"
        )
        return 0
    print(f"RANKS DIFFER: {result.difference}", file=sys.stdout)
    return 1

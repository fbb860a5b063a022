"""``kvlog replay``: verify a log, diff it against another, run a what-if, re-execute its
plans on canary tensors, salvage a damaged one, or replay it in parallel segments."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, TextIO

import msgspec

from kvlog.analysis.policy import check_byte_budget
from kvlog.analysis.replay import ReplayResult, replay
from kvlog.analysis.tally import Series
from kvlog.cli.flags import (
    PAST_DAMAGE_HINT,
    HelpFormatter,
    add_parallel_flags,
    add_policy_flags,
    add_salvage_flags,
    as_typed,
    check_policy_flags,
    check_salvage_flags,
    flag_of,
    policy_fields,
    recorded_config,
)
from kvlog.errors import ConfigError
from kvlog.log.manifest import log_num_bytes
from kvlog.present.report import report_path, write_report
from kvlog.present.text import (
    describe_overrides,
    progress_bar,
    replay_text,
    retired_text,
    segments_text,
    tier_explained_text,
)
from kvlog.tier.replay import explain_tier
from kvlog.util.units import printable

__all__ = ["add_replay", "check_replay_flags", "cmd_replay", "cmd_replay_parallel"]


def add_replay(sub: Any) -> None:
    p = sub.add_parser(
        "replay",
        help="verify a log, diff it, or run a what-if policy",
        description="Replay a log: verify every checkpoint, compare with another log "
        "(--against), re-run it under other policy settings (a what-if), re-apply its plans "
        "to canary-filled CPU tensors (--execute), or plot it (--report).",
        formatter_class=HelpFormatter,
    )
    p.add_argument("log")
    p.add_argument(
        "--no-verify",
        dest="verify",
        action="store_false",
        help="skip the checkpoints (checkpoints are verified unless given)",
    )
    p.add_argument("--against", help="compare event by event with a re-run of this log")
    p.add_argument(
        "--execute", action="store_true", help="apply plans to canary-filled CPU tensors"
    )
    p.add_argument("--backend", choices=("cpu", "fake"), default="cpu")
    p.add_argument("--from-snapshot", action="store_true", help="start at the latest snapshot")
    p.add_argument("--report", help="plot to FILE (.png or .svg, kvlog[plot]; .csv numbers)")
    add_salvage_flags(
        p, "the replay goes on from the next snapshot after it (not with --against or --execute)"
    )
    add_policy_flags(p, defaults=False)
    add_parallel_flags(p)


# -- replay ------------------------------------------------------------------------------
_PARALLEL_REFUSES = (
    ("against", "--against"),
    ("execute", "--execute"),
    ("report", "--report"),
    ("from_snapshot", "--from-snapshot"),
    ("salvage", "--salvage"),
    ("past_damage", "--past-damage"),
)


def check_replay_flags(args: argparse.Namespace) -> None:
    """Refuse a flag combination replay would ignore or fail on after the work: ``--parallel``
    verifies the recorded run only, ``--from-snapshot`` too, ``--report`` must be
    writable (checked first, not after the replay); ``--address``/``--num-cpus`` need
    ``--parallel``. Raises :class:`~kvlog.errors.ConfigError` naming the flag."""
    check_salvage_flags(args)
    whatif = policy_fields(args)
    if args.past_damage and (args.against or args.execute):
        flag = "--against" if args.against else "--execute"
        raise ConfigError("--past-damage", flag, "no --against or --execute (they need every "
                          "event)", shown=f"--past-damage with {flag}")  # fmt: skip
    if args.parallel:
        for name, flag in _PARALLEL_REFUSES:
            if getattr(args, name):
                raise ConfigError(flag, getattr(args, name), "no --parallel (it verifies only)")
        if whatif:
            flags = ", ".join(flag_of(n) for n in whatif)
            shown = " ".join(as_typed(n, v) for n, v in whatif.items())
            raise ConfigError(flags, whatif, "no --parallel (it replays the recorded policy)",
                              shown=shown)  # fmt: skip
        if args.num_cpus is not None and args.num_cpus < 1:
            raise ConfigError("--num-cpus", args.num_cpus, "an int >= 1")
    else:
        for name in ("address", "num_cpus"):
            if getattr(args, name) is not None:
                raise ConfigError(flag_of(name), getattr(args, name), "--parallel with it")
    if args.from_snapshot and (args.execute or args.against or whatif):
        flag = "--execute" if args.execute else "--against" if args.against else "a what-if"
        raise ConfigError("--from-snapshot", flag, "plain verification (no what-if, --against "
                          "or --execute)")  # fmt: skip
    if whatif:
        recorded = recorded_config(args.log)
        check_policy_flags(args, args.policy or (recorded.policy if recorded else "seed"))
        if recorded is not None:  # a cap below one page moves nothing: defrag off
            check_byte_budget(msgspec.structs.replace(recorded, **whatif), "--max-bytes-per-step")
    if args.report:
        report_path(args.report, log=args.log)


def cmd_replay(args: argparse.Namespace) -> int:
    check_replay_flags(args)
    if args.parallel:
        return cmd_replay_parallel(args, sys.stdout)
    total = max(log_num_bytes(args.log), 1)
    with progress_bar("replay") as update:
        result = replay(
            args.log,
            args.verify,
            against=args.against,
            execute=args.execute,
            backend=args.backend,
            from_snapshot=args.from_snapshot,
            series=bool(args.report),
            progress=lambda _records, done: update(min(done, total), total),
            salvage=args.salvage,
            past_damage=args.past_damage,
            **policy_fields(args),
        )
    print(replay_text(result))
    if any(name.startswith("Tier") for name in result.counts):  # a tier log: misses explained
        print(tier_explained_text(explain_tier(args.log)))
    for line in retired_text(result):
        print(f"kvlog replay: {line}", file=sys.stderr)
    for line in result.damaged:
        print(f"kvlog replay: went past damage: {line}", file=sys.stderr)
    if result.salvaged:
        what = "stopped at damage" if result.damaged else "salvaged the intact prefix"
        print(f"kvlog replay: {what}: {result.salvaged}", file=sys.stderr)
        if result.salvage_resume_seq >= 0 and not args.past_damage:
            print(f"kvlog replay: {PAST_DAMAGE_HINT}", file=sys.stderr)
    if result.salvaged or result.damaged:
        return 1
    if args.report:
        title = f"kvlog replay {printable(os.path.basename(args.log))}"
        config = result.recorded_config
        print(write_report(args.report, _series(result), title, config=config))
    if args.execute and (result.canary is None or result.canary.num_checked == 0):
        print("kvlog replay: --execute read no block: nothing was checked", file=sys.stderr)
        return 1
    return 0 if result.ok else 1


def _series(result: ReplayResult) -> list[Series]:
    out = []
    if result.recorded is not None and result.recorded.series is not None:
        out.append(result.recorded.series)
    if result.whatif is not None and result.whatif.whatif.series is not None:
        changed = describe_overrides(result.whatif.overrides)
        result.whatif.whatif.series.label = f"what-if: {changed}"
        out.append(result.whatif.whatif.series)
    return out


def cmd_replay_parallel(args: argparse.Namespace, out: TextIO) -> int:
    from kvlog.analysis.parallel import replay_segments

    started = time.perf_counter()
    with progress_bar("segments") as update:
        result = replay_segments(
            args.log, address=args.address, num_cpus=args.num_cpus, progress=update
        )
    out.write(segments_text(result, time.perf_counter() - started) + "\n")
    return 0 if result.ok else 1

"""``kvlog inspect``: a log's records as JSON lines."""

from __future__ import annotations

import argparse
import sys
import typing
from typing import Any

from kvlog.cli.flags import (
    PAST_DAMAGE_HINT,
    HelpFormatter,
    add_salvage_flags,
    check_salvage_flags,
)
from kvlog.errors import ConfigError
from kvlog.events import Checkpoint, Event, to_dict
from kvlog.log import LogReader
from kvlog.synth import (
    read_meta,
)
from kvlog.util.units import format_bytes

__all__ = ["add_inspect", "cmd_inspect"]

_EVENT_TYPES = (
    *(t.__name__ for t in typing.get_args(Event)),
    "Checkpoint",
)


def add_inspect(sub: Any) -> None:
    p = sub.add_parser(
        "inspect",
        help="print a log's records as JSON lines",
        description="Print a log's records as JSON lines, one per record, with its sequence "
        "number. A checkpoint's snapshot is summarised (its size) unless --snapshots.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("log")
    p.add_argument("--type", action="append", choices=_EVENT_TYPES, help="only these types")
    p.add_argument("--from", dest="start", type=int, default=0, help="first sequence number")
    p.add_argument("--to", dest="end", type=int, default=-1, help="last sequence number")
    p.add_argument("--no-checkpoints", action="store_true", help="leave Checkpoint records out")
    p.add_argument("--header", action="store_true", help="print the header first")
    p.add_argument(
        "--snapshots",
        action="store_true",
        help="print checkpoint snapshots whole (base64; megabytes for a large pool)",
    )
    add_salvage_flags(p, "every readable record is printed")


# -- inspect -----------------------------------------------------------------------------
def cmd_inspect(args: argparse.Namespace) -> int:
    import msgspec

    if args.start < 0:
        raise ConfigError("--from", args.start, "a sequence number >= 0")
    if args.end < -1:
        raise ConfigError("--to", args.end, "a sequence number >= 0 (or -1: the end)")
    check_salvage_flags(args)
    reader = LogReader(args.log, salvage=args.salvage, past_damage=args.past_damage)
    write = sys.stdout.write
    if args.header:
        header = msgspec.structs.asdict(reader.header)
        header["meta"] = read_meta(reader.header.meta)
        write(msgspec.json.encode(header).decode() + "\n")
    if reader.first_seq > args.start:  # a directory whose retention dropped the oldest
        print(
            f"kvlog inspect: the log starts at seq {reader.first_seq:,}: retention removed "
            "the records before it",
            file=sys.stderr,
        )
    wanted = set(args.type or ())
    encoder = msgspec.json.Encoder()
    for seq, record in reader.records(args.start):
        if 0 <= args.end < seq:
            break
        if args.no_checkpoints and type(record) is Checkpoint:
            continue
        if wanted and type(record).__name__ not in wanted:
            continue
        fields = to_dict(record)
        if type(record) is Checkpoint:  # its own ``seq`` field names the event it covers
            fields["covers_seq"] = fields.pop("seq")
            if record.snapshot and not args.snapshots:
                size = format_bytes(len(record.snapshot))
                fields["snapshot"] = f"<{size}: --snapshots shows it>"
        write(encoder.encode({"seq": seq, **fields}).decode() + "\n")
    if reader.tail is not None:
        print(f"kvlog inspect: torn tail (not modified): {reader.tail}", file=sys.stderr)
    for seq, gap in reader.gaps:
        print(f"kvlog inspect: the recorder detached at seq {seq}: {gap.error}", file=sys.stderr)
    for damage in reader.damaged:
        print(f"kvlog inspect: went past damage: {damage}", file=sys.stderr)
    if reader.stopped is not None:
        what = "stopped at damage" if reader.damaged else "salvaged the intact prefix"
        print(f"kvlog inspect: {what}: {reader.stopped}", file=sys.stderr)
        if reader.stopped.resume_seq >= 0 and not args.past_damage:
            print(f"kvlog inspect: {PAST_DAMAGE_HINT}", file=sys.stderr)
    return 1 if reader.stopped is not None or reader.damaged else 0

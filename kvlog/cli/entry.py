"""The ``kvlog`` command line: the parser, the dispatch to one module per subcommand
(``synth``, ``replay``, ``inspect``, ``demo``, ``sweep``, ``ranks``), Ctrl-C and the exit
status (:data:`EPILOG`). Each subcommand parses, calls the domain and prints what
:mod:`kvlog.present` renders."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import signal
import sys
import textwrap
import threading
from collections.abc import Iterator, Sequence
from types import FrameType

from kvlog._version import __version__
from kvlog.cli.demo import add_demo, cmd_demo
from kvlog.cli.flags import HelpFormatter
from kvlog.cli.inspect import add_inspect, cmd_inspect
from kvlog.cli.ranks import add_ranks, cmd_ranks
from kvlog.cli.replay import add_replay, cmd_replay
from kvlog.cli.sweep import (
    add_sweep,
    cmd_sweep,
)
from kvlog.cli.synth import add_synth, cmd_synth
from kvlog.cli.top import add_top, cmd_top
from kvlog.errors import KvlogError, LogExists
from kvlog.events import SCHEMA_VERSION
from kvlog.log import FORMAT_VERSION, check_log
from kvlog.synth.driver import defer_sigint

__all__ = ["DESCRIPTION", "EPILOG", "build_parser", "main"]

DESCRIPTION = (
    "kvlog keeps the books of an LLM serving engine's KV cache (defrag of accelerator "
    "blocks, offload to CPU) as a log of events that replays to the same decisions. "
    "Record a workload (synth), verify or re-run a log under another policy (replay), "
    "compare policies over logs (sweep), read a log's records (inspect), or see it all "
    "at once (demo)."
)
EPILOG = """exit status:
  0    everything checked out
  1    a replay diverged, a canary failed, --execute read no block, a sweep variant was refused
  2    bad arguments or a log that cannot be read, refused before anything is written
  3    kvlog ranks: the ranks agree, but one's log ends before another's (behind)
  130  interrupted (Ctrl-C); the log being written is closed first, so it replays

Run "kvlog COMMAND --help" for a command's flags and their defaults."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvlog",
        description=textwrap.fill(DESCRIPTION, 88),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"kvlog {__version__} (log schema {SCHEMA_VERSION}, format {FORMAT_VERSION})",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    add_synth(sub)
    add_replay(sub)
    add_inspect(sub)
    add_demo(sub)
    add_sweep(sub, HelpFormatter)
    add_ranks(sub)
    add_top(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvlog`` console script; returns the exit status.

    Ctrl-C: the command unwinds (an open Engine's ``close()`` runs, so the log it was
    writing ends on a checkpoint and replays), a later Ctrl-C is ignored while it does,
    one line goes to stderr and the status is 130, as a shell reports SIGINT."""
    args = build_parser().parse_args(argv)
    commands = {
        "synth": cmd_synth,
        "replay": cmd_replay,
        "inspect": cmd_inspect,
        "demo": cmd_demo,
        "sweep": cmd_sweep,
        "ranks": cmd_ranks,
        "top": cmd_top,
    }
    with _interruptible(), _paths_on_stdout():
        try:
            for path in _log_paths(args):
                check_log(path)  # one wording and status for a missing log, before any work
            return commands[args.command](args)
        except KeyboardInterrupt:
            print(f"kvlog {args.command}: interrupted", file=sys.stderr)
            return 130
        except BrokenPipeError:  # `kvlog inspect LOG | head`
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            return 0
        except LogExists as exc:
            hint = "" if "--out" in str(exc) else " (give another --out, or remove it)"
            print(f"kvlog {args.command}: {exc}{hint}", file=sys.stderr)
            return 2
        except (KvlogError, OSError) as exc:
            print(f"kvlog {args.command}: {exc}", file=sys.stderr)
            return 2


def _log_paths(args: argparse.Namespace) -> list[str]:
    """The logs a subcommand reads (``LOG`` arguments and ``--against``)."""
    paths = [getattr(args, name, None) for name in ("log", "against")]
    return [p for p in paths if p is not None] + list(getattr(args, "logs", None) or [])


@contextlib.contextmanager
def _interruptible() -> Iterator[None]:
    """Ctrl-C handling for one command: the first SIGINT raises ``KeyboardInterrupt`` (in a
    synth loop at the end of the current step, see ``kvlog.synth.driver.defer_sigint``,
    so no Engine call is cut in two); later ones are ignored, so the clean-up it starts
    (closing the log) is not cut short. Restored on exit; a no-op off the main thread or
    under a SIGINT handler that is not Python's default."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    interrupted = False

    def on_sigint(signum: int, frame: FrameType | None) -> None:
        nonlocal interrupted
        if interrupted:
            return
        interrupted = True
        if not defer_sigint():
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@contextlib.contextmanager
def _paths_on_stdout() -> Iterator[None]:
    """Any path the user gave prints: a file name that is not UTF-8 reaches Python as lone
    surrogates, which a strict stdout (a UTF-8 locale other than C) refuses after the work
    is done, so for one command stdout escapes them (``\\udcff``) as stderr always does."""
    out = sys.stdout
    if not isinstance(out, io.TextIOWrapper) or out.errors != "strict":
        yield
        return
    out.reconfigure(errors="backslashreplace")
    try:
        yield
    finally:
        out.reconfigure(errors="strict")


if __name__ == "__main__":
    sys.exit(main())

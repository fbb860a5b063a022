"""The ``kvlog`` command line: synth, replay, inspect, demo, sweep.

It parses arguments, calls the domain (``kvlog.synth``, ``kvlog.replay``, ``kvlog.sweep``)
and prints what ``kvlog.present`` renders. Exit status: :data:`EPILOG`.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import io
import os
import signal
import sys
import tempfile
import textwrap
import threading
import time
import typing
from collections.abc import Iterator, Sequence
from types import FrameType
from typing import Any

from kvlog import __version__, reducers
from kvlog.cli_log import add_ranks, cmd_ranks
from kvlog.cli_sweep import (
    add_parallel_flags,
    add_policy_flags,
    add_sweep,
    add_trace_flags,
    cmd_replay_parallel,
    cmd_sweep,
    log_options,
    policy_fields,
    run_trace_command,
    synth_geometry,
    trace_flags,
)
from kvlog.errors import ConfigError, KvlogError, LogExists, MissingExtra
from kvlog.events import SCHEMA_VERSION, Checkpoint, Event, to_dict
from kvlog.log import FORMAT_VERSION, SYNC_MODES, LogReader, check_log
from kvlog.log.manifest import log_num_bytes
from kvlog.policy import POLICY_FIELDS, check_tail_only, policy_field
from kvlog.present.text import (
    describe_overrides,
    progress_bar,
    replay_text,
    retired_text,
    synth_text,
)
from kvlog.present.units import format_bytes, printable
from kvlog.replay import ReplayResult, replay
from kvlog.report import Series, report_path, write_report
from kvlog.synth import SynthConfig, read_meta, run_synth
from kvlog.synth.driver import defer_sigint

__all__ = ["EPILOG", "build_parser", "main"]

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


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default after its help, unless there is none to show (None, a
    switch that is off), the help already says it, or it is a list (their help says it in
    the flag's own units)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if default is None or default is False or isinstance(default, list):
            return text
        return text if "default" in text else super()._get_help_string(action)


_POLICY_FIELD_NAMES = frozenset(row.name for row in POLICY_FIELDS)

_EVENT_TYPES = (
    *(t.__name__ for t in typing.get_args(Event)),
    "Checkpoint",
)


_WORKLOAD_FLAGS: tuple[tuple[str, str, type, str], ...] = (
    ("--seed", "seed", int, "seed of the synthetic workload"),
    ("--steps", "steps", int, "scheduler steps to run"),
    ("--num-cpu-blocks", "num_cpu_blocks", int, "CPU offload blocks (0: no offload)"),
    ("--block-size-factor", "block_size_factor", int, "GPU blocks per CPU block"),
    ("--arrival-rate", "arrival_rate", float, "requests per step"),
    ("--prompt-len-mean", "prompt_len_mean", float, "mean prompt tokens"),
    ("--output-len-mean", "output_len_mean", float, "mean output tokens"),
    ("--max-num-seqs", "max_num_seqs", int, "most requests running at once"),
    ("--num-prefixes", "num_prefixes", int, "distinct shared system prompts"),
    ("--prefix-share", "prefix_share", float, "share of requests that start with a shared prompt"),
    ("--failure-rate", "transfer_failure_rate", float, "share of simulated transfers that fail "
     "(without --execute)"),
)  # fmt: skip
"""``kvlog synth``'s workload flags: (flag, ``SynthConfig`` field for the default, type, help)."""


def _add_synth(sub: Any) -> None:
    p = sub.add_parser(
        "synth",
        help="record a synthetic serving workload (or a public trace) into a log",
        description="Record a seeded serving workload, or a public request trace with "
        "--trace, into a new log (arrivals, prefix sharing, preemption, stores and loads).",
        formatter_class=_HelpFormatter,
    )
    d = SynthConfig()
    p.add_argument("--out", required=True, help="log file to create (must not hold records)")
    for flag, name, kind, text in _WORKLOAD_FLAGS:
        p.add_argument(flag, type=kind, default=getattr(d, name), help=text)
    p.add_argument(
        "--num-gpu-blocks",
        type=int,
        help=f"GPU blocks in the pool (default {d.num_gpu_blocks}; 4096 with --trace)",
    )
    p.add_argument(
        "--block-size",
        type=int,
        help=f"tokens per block (default {d.block_size}; 128 with --trace)",
    )
    p.add_argument("--prefix-caching", action="store_true", help="share prompt prefix blocks")
    p.add_argument("--execute", action="store_true", help="run on CPU tensors with canary checks")
    p.add_argument(
        "--backend",
        choices=("cpu", "fake"),
        default="cpu",
        help="--execute: the executor's device",
    )
    p.add_argument(
        "--check-every", type=int, default=0, help="canary check every N steps (0: at the end)"
    )
    p.add_argument(
        "--sync",
        choices=SYNC_MODES,
        default="step",
        help="when the log is fsynced",
    )
    p.add_argument(
        "--checkpoint-every", type=int, default=256, help="steps between digest checkpoints"
    )
    add_policy_flags(p, defaults=True)
    add_trace_flags(p)


_SALVAGE_HELP = "read the intact prefix of a damaged log; say where and why it stops (exit 1)"


def _add_replay(sub: Any) -> None:
    p = sub.add_parser(
        "replay",
        help="verify a log, diff it, or run a what-if policy",
        description="Replay a log: verify every checkpoint, compare with another log "
        "(--against), re-run it under other policy settings (a what-if), re-apply its plans "
        "to canary-filled CPU tensors (--execute), or plot it (--report).",
        formatter_class=_HelpFormatter,
    )
    p.add_argument("log")
    p.add_argument("--no-verify", dest="verify", action="store_false", help="skip checkpoints")
    p.add_argument("--against", help="compare event by event with a re-run of this log")
    p.add_argument(
        "--execute", action="store_true", help="apply plans to canary-filled CPU tensors"
    )
    p.add_argument("--backend", choices=("cpu", "fake"), default="cpu")
    p.add_argument("--from-snapshot", action="store_true", help="start at the latest snapshot")
    p.add_argument("--report", help="plot to FILE (.png or .svg, kvlog[plot]; .csv numbers)")
    p.add_argument("--salvage", action="store_true", help=_SALVAGE_HELP)
    add_policy_flags(p, defaults=False)
    add_parallel_flags(p)


def _add_inspect(sub: Any) -> None:
    p = sub.add_parser(
        "inspect",
        help="print a log's records as JSON lines",
        description="Print a log's records as JSON lines, one per record, with its sequence "
        "number. A checkpoint's snapshot is summarised (its size) unless --snapshots.",
        formatter_class=_HelpFormatter,
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
    p.add_argument("--salvage", action="store_true", help=_SALVAGE_HELP)


def _add_demo(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="synth on CPU tensors (offload + defrag), replay, verify, what-ifs, report",
        formatter_class=_HelpFormatter,
    )
    p.add_argument(
        "--out", default=os.path.join("out", "demo"), help="directory for the log and report"
    )
    p.add_argument("--steps", type=int, default=1500, help="scheduler steps to record")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload")


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
    _add_synth(sub)
    _add_replay(sub)
    _add_inspect(sub)
    _add_demo(sub)
    add_sweep(sub, _HelpFormatter)
    add_ranks(sub)
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


# -- synth -------------------------------------------------------------------------------
def synth_config(args: argparse.Namespace) -> SynthConfig:
    return SynthConfig(
        seed=args.seed,
        steps=args.steps,
        num_cpu_blocks=args.num_cpu_blocks,
        block_size_factor=args.block_size_factor,
        prefix_caching=args.prefix_caching,
        arrival_rate=args.arrival_rate,
        prompt_len_mean=args.prompt_len_mean,
        output_len_mean=args.output_len_mean,
        max_num_seqs=args.max_num_seqs,
        num_prefixes=args.num_prefixes,
        prefix_share=args.prefix_share,
        transfer_failure_rate=args.failure_rate,
        check_every=args.check_every,
    ).replace(**synth_geometry(args), **policy_fields(args))


def cmd_synth(args: argparse.Namespace) -> int:
    check_policy_flags(args, args.policy)
    trace_flags(args)  # refuses trace-only flags without --trace
    config = synth_config(args)
    from kvlog.events import validate_event

    validate_event(config.cache_config())
    config.check()
    if args.trace:
        result = run_trace_command(args, config)
    else:
        result = run_synth(
            config,
            args.out,
            execute=args.execute,
            backend=args.backend,
            sync=args.sync,
            checkpoint_every=args.checkpoint_every,
            snapshot_every=args.snapshot_every,
            log_options=log_options(args),
        )
    print(synth_text(result))
    return 0 if result.canary_ok else 1


# -- replay ------------------------------------------------------------------------------
_PARALLEL_REFUSES = (
    ("against", "--against"),
    ("execute", "--execute"),
    ("report", "--report"),
    ("from_snapshot", "--from-snapshot"),
    ("salvage", "--salvage"),
)


def check_replay_flags(args: argparse.Namespace) -> None:
    """Refuse a flag combination replay would ignore or fail on after the work: ``--parallel``
    verifies the recorded run only, ``--from-snapshot`` too, ``--report`` must be
    writable (checked first, not after the replay); ``--address``/``--num-cpus`` need
    ``--parallel``. Raises :class:`~kvlog.errors.ConfigError` naming the flag."""
    whatif = policy_fields(args)
    if args.parallel:
        for name, flag in _PARALLEL_REFUSES:
            if getattr(args, name):
                raise ConfigError(flag, getattr(args, name), "no --parallel (it verifies only)")
        if whatif:
            flags = ", ".join(_flag_of(n) for n in whatif)
            raise ConfigError(flags, whatif, "no --parallel (it replays the recorded policy)")
        if args.num_cpus is not None and args.num_cpus < 1:
            raise ConfigError("--num-cpus", args.num_cpus, "an int >= 1")
    else:
        for name in ("address", "num_cpus"):
            if getattr(args, name) is not None:
                raise ConfigError(_flag_of(name), getattr(args, name), "--parallel with it")
    if args.from_snapshot and (args.execute or args.against or whatif):
        flag = "--execute" if args.execute else "--against" if args.against else "a what-if"
        raise ConfigError("--from-snapshot", flag, "plain verification (no what-if, --against "
                          "or --execute)")  # fmt: skip
    if whatif:
        check_policy_flags(args, args.policy or _recorded_policy(args.log))
    if args.report:
        report_path(args.report, log=args.log)


def _flag_of(name: str) -> str:
    if name in _POLICY_FIELD_NAMES:
        return policy_field(name).flag
    return "--" + name.replace("_", "-")


def _recorded_policy(path: str) -> str:
    """The defrag policy the log at ``path`` was recorded with (its first record, or the
    configuration in the opening snapshot of a log directory whose start is gone)."""
    for _, record in LogReader(path).records(0):
        if type(record) is Checkpoint and record.snapshot:
            return str(getattr(reducers.restore(record.snapshot).config, "policy", "seed"))
        return str(getattr(record, "policy", "seed"))
    return "seed"


def check_policy_flags(args: argparse.Namespace, policy: str) -> None:
    """``--ratio-limit`` and ``--min-swaps`` tune the tail policy only: refused under any
    other (they would be ignored)."""
    check_tail_only(vars(args), policy, _flag_of, "--policy tail with it")


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
            **policy_fields(args),
        )
    print(replay_text(result))
    for line in retired_text(result):
        print(f"kvlog replay: {line}", file=sys.stderr)
    if result.salvaged:
        print(f"kvlog replay: salvaged the intact prefix: {result.salvaged}", file=sys.stderr)
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


# -- inspect -----------------------------------------------------------------------------
def cmd_inspect(args: argparse.Namespace) -> int:
    import msgspec

    if args.start < 0:
        raise ConfigError("--from", args.start, "a sequence number >= 0")
    if args.end < -1:
        raise ConfigError("--to", args.end, "a sequence number >= 0 (or -1: the end)")
    reader = LogReader(args.log, salvage=args.salvage)
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
    if reader.stopped is not None:
        print(f"kvlog inspect: salvaged the intact prefix: {reader.stopped}", file=sys.stderr)
        return 1
    return 0


# -- demo --------------------------------------------------------------------------------
def _demo_dir(wanted: str) -> str:
    try:
        os.makedirs(wanted, exist_ok=True)
        probe = os.path.join(wanted, ".probe")
        with open(probe, "w"):
            pass
        os.unlink(probe)
        return wanted
    except OSError:
        return tempfile.mkdtemp(prefix="kvlog-demo-")


def demo_config(steps: int, seed: int) -> SynthConfig:
    """The demo workload: prefix caching with shared system prompts, offload with
    block_size_factor 2, defrag on, memory pressure."""
    return SynthConfig(
        seed=seed,
        steps=steps,
        num_gpu_blocks=1024,
        num_cpu_blocks=768,
        block_size_factor=2,
        prefix_caching=True,
        arrival_rate=0.2,
        check_every=250,
    )


_DEMO_MARK = {"kvlog_demo": "1"}
"""In the header of every log ``kvlog demo`` writes: only such a log is replaced."""


def _clear_demo_log(log_path: str) -> None:
    """Remove the previous demo's log at ``log_path``; refuse (``LogExists``) any other
    file there: a log ``kvlog demo`` did not write, or something that is not a log."""
    if not os.path.lexists(log_path):
        return
    try:
        meta = LogReader(log_path).header.meta
    except (KvlogError, OSError):
        meta = {}
    if meta.get("kvlog_demo") != "1":
        raise LogExists(
            errno.EEXIST,
            f"{log_path} exists and is not a log kvlog demo wrote: not replaced (pick another "
            "--out or remove it)",
            log_path,
        )
    os.unlink(log_path)


def cmd_demo(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    config = demo_config(args.steps, args.seed)
    config.check()
    directory = _demo_dir(args.out)
    log_path = os.path.join(directory, "demo.kvlog")
    _clear_demo_log(log_path)
    print(
        f"kvlog demo: {args.steps} scheduler steps on CPU tensors, prefix caching, offload "
        "and defrag on\n"
    )
    synth = run_synth(config, log_path, execute=True, sync="none", meta=_DEMO_MARK)
    print(synth_text(synth))
    print()
    result = replay(log_path, execute=True)
    print(replay_text(result))
    same = result.final_digest == synth.final_digest
    print(f"\nlive digest {'==' if same else '!='} replayed digest")
    series = _demo_whatifs(log_path)
    _demo_report(directory, series, result.recorded_config)
    ok = same and result.ok and synth.canary_ok
    print(f"\n{'OK' if ok else 'FAILED'}: log {log_path} ({time.perf_counter() - started:.1f} s)")
    return 0 if ok else 1


def _demo_whatifs(log_path: str) -> list[Series]:
    """What-ifs of the demo log: no defrag, and the tail policy; their series, labelled."""
    out: list[Series] = []
    for label, overrides in (
        ("--no-defrag", {"defrag": False}),
        ("--policy tail", {"policy": "tail"}),
    ):
        run = replay(log_path, **overrides)
        assert run.whatif is not None, "a what-if replay without its comparison"
        recorded, other = run.whatif.recorded, run.whatif.whatif
        print(
            f"what-if {label}: mean highest used id {recorded.mean_max_used:,.0f} -> "
            f"{other.mean_max_used:,.0f}, moved by defrag {format_bytes(recorded.swap_bytes)} "
            f"-> {format_bytes(other.swap_bytes)}"
        )
        for stats, name in ((recorded, "recorded (seed)"), (other, label)):
            if stats.series is not None and (name != "recorded (seed)" or not out):
                stats.series.label = name
                out.append(stats.series)
    return out


def _demo_report(directory: str, series: list[Series], config: Any) -> None:
    title = "kvlog demo: the recorded policy and two what-ifs"
    for ext in (".png", ".svg"):
        path = os.path.join(directory, "demo_report" + ext)
        try:
            print(write_report(path, series, title, config=config))
        except MissingExtra as exc:
            print(f"no picture: {exc}")
            return


if __name__ == "__main__":
    sys.exit(main())

"""The command line for real traffic and what-ifs: ``synth --trace``, ``sweep``, ``replay
--parallel`` and the policy flags. It parses and prints: the defaults and checks of a trace
run are :mod:`kvlog.synth`'s, the tables, progress bars and pictures :mod:`kvlog.present`'s.

``kvlog.cli`` builds the parser and calls in here; everything here takes parsed arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from kvlog.cost import HARDWARE, cost_model
from kvlog.errors import ConfigError
from kvlog.events import DEFRAG_POLICIES
from kvlog.policy import POLICY_FIELDS, parse_ratio_pct, parse_size
from kvlog.present.text import (
    progress_bar,
    render_table,
    segments_text,
    sweep_table,
    tier_table,
)
from kvlog.present.units import plural, size_label
from kvlog.synth import SynthConfig, SynthResult, TraceConfig, read_trace, trace_geometry
from kvlog.synth.traces import TRACE_FORMATS

__all__ = [
    "add_parallel_flags",
    "add_policy_flags",
    "add_sweep",
    "add_trace_flags",
    "check_tier_values",
    "cmd_replay_parallel",
    "cmd_sweep",
    "policy_fields",
    "run_trace_command",
    "size_arg",
    "trace_flags",
]


# -- argument types ------------------------------------------------------------------------
def arg_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse ``type`` from a parser of :mod:`kvlog.policy` (its ``ValueError`` becomes
    the usage error's message)."""

    def typed(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    typed.__name__ = parse.__name__
    return typed


size_arg = arg_type(parse_size)
"""Bytes from ``4096``, ``64MiB``, ``1G``, ``512k`` (binary units)."""
_ratio_pct = arg_type(parse_ratio_pct)


def _list_of(kind: Callable[[str], Any], what: str) -> Callable[[str], list[Any]]:
    def parse(text: str) -> list[Any]:
        try:
            values = [kind(x) for x in text.replace(" ", "").split(",") if x]
        except (ValueError, argparse.ArgumentTypeError) as exc:
            raise argparse.ArgumentTypeError(f"wants {what} like {text!r}: {exc}") from exc
        if not values:
            raise argparse.ArgumentTypeError(f"wants at least one of {what}")
        return values

    return parse


def _policy_name(text: str) -> str:
    from kvlog.sweep import POLICY_NAMES

    if text not in POLICY_NAMES:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(POLICY_NAMES)}")
    return text


# -- policy flags --------------------------------------------------------------------------
def add_policy_flags(p: argparse.ArgumentParser, defaults: bool) -> None:
    """A flag per policy field (:data:`kvlog.policy.POLICY_FIELDS`); for replay
    (``defaults=False``) an absent flag keeps the recording's value. The tail's parameters
    have no parser default (given under another policy, they are refused)."""
    for row in POLICY_FIELDS:
        default = row.default if defaults and not row.tail_only else None
        shown = f" (default {row.text(row.default)})" if defaults else " (default: the log's)"
        if row.name == "defrag":
            group = p.add_mutually_exclusive_group()
            group.add_argument(
                "--no-defrag",
                dest="defrag",
                action="store_false",
                default=default,
                help="turn defragmentation off",
            )
            if not defaults:
                group.add_argument(
                    "--defrag", dest="defrag", action="store_true", help="turn it on"
                )
            continue
        p.add_argument(
            row.flag,
            dest=row.name,
            type=arg_type(row.parse),
            choices=DEFRAG_POLICIES if row.name == "policy" else None,
            metavar=None if row.name == "policy" else row.flag[2:].upper().replace("-", "_"),
            default=default,
            help=row.help + shown,
        )


def policy_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The policy flags that were given (for synth, also those with a default)."""
    return {
        r.name: getattr(args, r.name)
        for r in POLICY_FIELDS
        if getattr(args, r.name, None) is not None
    }


# -- synth --trace -------------------------------------------------------------------------
_TRACE_CONFIG = {f.name: f.default for f in dataclasses.fields(TraceConfig)}
_TRACE_ONLY: dict[str, Any] = {
    "trace_format": None,
    "requests": None,
    **{n: _TRACE_CONFIG[n] for n in ("time_scale", "step_ms", "max_num_batched_tokens")},
    "max_model_len": _TRACE_CONFIG["max_model_len"],
    "scheduler": "kvlog",
}
"""The flags only ``--trace`` reads, and their values when not given (``TraceConfig``'s
defaults: ``run_trace`` from Python has the same)."""


def add_trace_flags(p: argparse.ArgumentParser) -> None:
    """The ``synth --trace`` flags; given without ``--trace`` they are refused (they would
    be ignored), so their parser default is None and :data:`_TRACE_ONLY` has the values."""
    d = _TRACE_ONLY
    p.add_argument("--trace", help="drive the serving loop from this public request trace")
    p.add_argument("--trace-format", choices=TRACE_FORMATS, help="default: by file extension")
    p.add_argument("--requests", type=int, help="only the first N requests of the trace")
    p.add_argument(
        "--time-scale",
        type=float,
        help=f"multiply the trace's clock (0.5: arrivals twice as fast; {d['time_scale']})",
    )
    p.add_argument("--step-ms", type=float, help=f"simulated time of one step ({d['step_ms']})")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        help=f"token budget of one step ({d['max_num_batched_tokens']})",
    )
    p.add_argument(
        "--max-model-len", type=int, help="clip longer requests (default 0: half the pool)"
    )
    p.add_argument(
        "--page-size-bytes",
        type=size_arg,
        help="bytes of one GPU block over all layers (default: 128 KiB per token)",
    )
    p.add_argument(
        "--snapshot-every",
        type=int,
        default=None,
        help="checkpoints per snapshot (default: 16, fewer for pools above 64k blocks)",
    )
    p.add_argument(
        "--segment-bytes",
        type=size_arg,
        help="--out DIR/: seal a segment at this size (e.g. 64MiB; default 256 MiB)",
    )
    p.add_argument(
        "--retain-bytes",
        type=size_arg,
        help="--out DIR/: drop the oldest sealed segments beyond this size (default: keep all)",
    )
    p.add_argument(
        "--compress",
        action="store_true",
        help="--out DIR/: zstd-compress sealed segments (the zstd extra)",
    )
    p.add_argument(
        "--scheduler",
        choices=("kvlog", "vllm"),
        help="--trace: kvlog's vLLM-like scheduler (default), or vLLM's own (where installed)",
    )


def trace_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The trace-only flags with their defaults filled in; refused without ``--trace``."""
    given = {n: getattr(args, n) for n in _TRACE_ONLY if getattr(args, n) is not None}
    if given and not args.trace:
        name = next(iter(given))
        raise ConfigError("--" + name.replace("_", "-"), given[name], "--trace with it")
    if given.get("requests", 1) < 1:
        raise ConfigError("--requests", given["requests"], "a count >= 1")
    return {**_TRACE_ONLY, **given}


def run_trace_command(args: argparse.Namespace, config: SynthConfig) -> SynthResult:
    """``kvlog synth --trace``: read the trace, serve it, record the log."""
    from kvlog.synth import run_trace

    flags = trace_flags(args)
    requests = read_trace(args.trace, flags["trace_format"], limit=flags["requests"])
    trace_config = TraceConfig(
        config,
        trace_format=flags["trace_format"] or "",
        time_scale=flags["time_scale"],
        step_ms=flags["step_ms"],
        max_num_batched_tokens=flags["max_num_batched_tokens"],
        max_model_len=flags["max_model_len"],
    )
    return run_trace(
        trace_config,
        requests,
        args.out,
        execute=args.execute,
        backend=args.backend,
        sync=args.sync,
        checkpoint_every=args.checkpoint_every,
        snapshot_every=args.snapshot_every,
        source=os.path.basename(args.trace),
        scheduler=flags["scheduler"],
        log_options=log_options(args),
    )


def log_options(args: argparse.Namespace) -> dict[str, Any]:
    """The Engine's log-directory options given on the command line (none: a plain log);
    the Engine refuses them for a log that is one file (``ConfigError``)."""
    given = {"segment_bytes": args.segment_bytes, "retain_bytes": args.retain_bytes}
    options: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
    if args.compress:
        options["compress"] = True
    return options


def synth_geometry(args: argparse.Namespace) -> dict[str, int]:
    """``num_gpu_blocks``, ``block_size``, ``page_size_bytes`` for synth: the flags given,
    else ``SynthConfig``'s defaults, or with ``--trace`` :func:`kvlog.synth.trace_geometry`'s."""
    page = getattr(args, "page_size_bytes", None)
    if getattr(args, "trace", None):
        return trace_geometry(args.num_gpu_blocks, args.block_size, page)
    d = SynthConfig()
    return {
        "num_gpu_blocks": d.num_gpu_blocks if args.num_gpu_blocks is None else args.num_gpu_blocks,
        "block_size": d.block_size if args.block_size is None else args.block_size,
        "page_size_bytes": d.page_size_bytes if page is None else page,
    }


# -- kvlog sweep ---------------------------------------------------------------------------
_ListFlag = tuple[str, Callable[[str], Any], str, Sequence[Any], str, Callable[[Any], str]]
"""A sweep flag that takes a list: flag, item parser, what the items are, defaults, help,
how the help shows a default."""


def _ratio(pct: int) -> str:
    return f"{pct / 100:g}"


def add_sweep(sub: Any, formatter: type[argparse.HelpFormatter] = argparse.HelpFormatter) -> None:
    from kvlog import sweep as d

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
    lists: tuple[_ListFlag, ...] = (
        ("--policy", _policy_name, "policy names", d.DEFAULT_POLICIES, f"of {names}", str),
        ("--threshold", int, "integers", d.DEFAULT_THRESHOLDS, "seed; budget: the least", str),
        ("--ratio-limit", _ratio_pct, "ratios", d.DEFAULT_RATIOS_PCT, "tail: e.g. 1.25", _ratio),
        ("--min-swaps", int, "integers", d.DEFAULT_MIN_SWAPS, "tail: skip fewer pairs", str),
        ("--budget", size_arg, "sizes", d.DEFAULT_BUDGETS, "budget: bytes per step", size_label),
    )  # fmt: skip
    for flag, kind, what, default, text, show in lists:
        shown = ",".join(show(v) for v in default)
        p.add_argument(
            flag,
            type=_list_of(kind, what),
            default=list(default),
            help=f"{text} (default: {shown})",
        )
    p.add_argument("--max-swaps", type=_list_of(int, "integers"), help="seed: caps per step")
    p.add_argument("--address", help="an existing Ray cluster (default: a local Ray)")
    p.add_argument("--num-cpus", type=int, help="local Ray: worker CPUs (default: all)")
    p.add_argument("--serial", action="store_true", help="no Ray: run here, one by one")
    add_cost_flags(p)
    add_tier_flags(p)


def add_tier_flags(p: argparse.ArgumentParser) -> None:
    """The CPU tier's what-ifs (issue 23): given ``--cpu-bytes``, the sweep is of the tier."""
    p.add_argument(
        "--cpu-bytes",
        type=_list_of(size_arg, "sizes"),
        help="CPU tier: host memory to try, e.g. 4GiB,16GiB,64GiB (LOG: a log or a trace)",
    )
    p.add_argument(
        "--eviction",
        type=_list_of(str, "names"),
        default=["lru", "arc", "opt"],
        help="CPU tier: eviction policies, from lru, arc, opt (the offline optimum)",
    )
    p.add_argument(
        "--store-threshold", type=_list_of(int, "integers"), default=[0], help="CPU tier"
    )
    p.add_argument("--tokens-per-chunk", type=int, default=512, help="CPU tier: chunk size")
    p.add_argument(
        "--bytes-per-token", type=int, default=131072, help="CPU tier: KV bytes of one token"
    )
    p.add_argument(
        "--gpu-tokens",
        type=int,
        default=0,
        help="CPU tier on a trace: KV tokens the GPU holds (preemption model; 0: none)",
    )
    p.add_argument(
        "--prefill-us-per-token",
        type=float,
        default=100.0,
        help="CPU tier: prefill time one token costs, to price hits",
    )


def cmd_tier_sweep(args: argparse.Namespace) -> int:
    """``kvlog sweep --cpu-bytes``: the CPU tier's what-ifs (``kvlog/tier/sweep.py``)."""
    from kvlog.tier.sweep import run_tier_sweep, tier_grid, write_tier_csv, write_tier_plot

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


def check_tier_flags(args: argparse.Namespace) -> None:
    """``kvlog sweep --cpu-bytes``'s tier flags, checked by :func:`check_tier_values`."""
    check_tier_values(
        evictions=args.eviction,
        store_thresholds=args.store_threshold,
        tokens_per_chunk=args.tokens_per_chunk,
        bytes_per_token=args.bytes_per_token,
        gpu_tokens=args.gpu_tokens,
        prefill_us_per_token=args.prefill_us_per_token,
    )


def check_tier_values(
    *,
    evictions: Sequence[str],
    store_thresholds: Sequence[int],
    tokens_per_chunk: int,
    bytes_per_token: int,
    gpu_tokens: int,
    prefill_us_per_token: float = 0.0,
) -> None:
    """The CPU tier flags no what-if can use, refused (ConfigError naming the flag) before
    any work, for ``kvlog sweep --cpu-bytes`` and ``python -m kvlog.tier.synth`` alike: a
    NaN or infinite prefill price would fill the table with ``nan s``, and a negative
    store threshold or GPU token count would run as if it were 0."""
    from kvlog.tier.whatif import EVICTIONS

    for name in evictions:
        if name not in EVICTIONS:
            raise ConfigError("--eviction", list(evictions), f"names from {list(EVICTIONS)}")
    if tokens_per_chunk < 1 or 512 % tokens_per_chunk:
        raise ConfigError("--tokens-per-chunk", tokens_per_chunk, "a divisor of 512")
    if not 0 <= prefill_us_per_token < math.inf:  # False for NaN too
        raise ConfigError("--prefill-us-per-token", prefill_us_per_token, "a time >= 0")
    if bytes_per_token < 1:
        raise ConfigError("--bytes-per-token", bytes_per_token, "an integer >= 1")
    if any(t < 0 for t in store_thresholds):
        shown = store_thresholds[0] if len(store_thresholds) == 1 else list(store_thresholds)
        raise ConfigError("--store-threshold", shown, "ints >= 0")
    if gpu_tokens < 0:
        raise ConfigError("--gpu-tokens", gpu_tokens, "an int >= 0 (0: no preemption)")


def add_cost_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--hardware",
        choices=sorted(HARDWARE),
        default="gaudi2",
        help="cost model preset (HBM bandwidth)",
    )
    p.add_argument("--hbm-tbps", type=float, help="override the HBM bandwidth, TB/s")
    p.add_argument("--link-gbps", type=float, help="override the host link, GB/s each way")


def cmd_sweep(args: argparse.Namespace) -> int:
    from kvlog.present.pictures import write_sweep_figure
    from kvlog.sweep import policy_grid, run_sweep, write_sweep_csv

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
    from kvlog.present.pictures import plt_module
    from kvlog.sweep import _ray

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


# -- kvlog replay --parallel ---------------------------------------------------------------
def add_parallel_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--parallel",
        action="store_true",
        help="replay segments between snapshots in parallel on Ray",
    )
    p.add_argument("--address", help="--parallel on an existing Ray cluster")
    p.add_argument("--num-cpus", type=int, help="--parallel on a local Ray with this many CPUs")


def cmd_replay_parallel(args: argparse.Namespace, out: TextIO) -> int:
    from kvlog.sweep import replay_segments

    started = time.perf_counter()
    with progress_bar("segments") as update:
        result = replay_segments(
            args.log, address=args.address, num_cpus=args.num_cpus, progress=update
        )
    out.write(segments_text(result, time.perf_counter() - started) + "\n")
    return 0 if result.ok else 1

"""The command line for real traffic and what-ifs: ``synth --trace``, ``sweep``, ``replay
--parallel``, the policy flags, and the tables and progress bars (rich) ``kvlog`` prints.

``kvlog.cli`` builds the parser and calls in here; everything here takes parsed arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TextIO

from kvlog.cost import HARDWARE, cost_model
from kvlog.errors import ConfigError
from kvlog.events import DEFRAG_POLICIES
from kvlog.synth import SynthConfig, SynthResult, TraceConfig, bytes_per_token, read_trace
from kvlog.synth.traces import TRACE_FORMATS, TraceRequest

__all__ = [
    "add_parallel_flags",
    "add_policy_flags",
    "add_sweep",
    "add_trace_flags",
    "cmd_replay_parallel",
    "cmd_sweep",
    "policy_fields",
    "progress_bar",
    "render_table",
    "run_trace_command",
    "size_arg",
    "trace_flags",
]

TRACE_DEFAULTS = {"num_gpu_blocks": 4096, "block_size": 128}
"""Geometry of trace runs when not given (real prompts are long: 128-token blocks)."""
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_MAX_SIZE = 1 << 50  # CacheConfigured's bound on max_bytes_per_step
_MAX_RATIO = 100.0


# -- argument types ------------------------------------------------------------------------
def size_arg(text: str) -> int:
    """Bytes from ``4096``, ``64MiB``, ``1G``, ``512k`` (binary units)."""
    raw = text.strip().lower().removesuffix("b").removesuffix("i")
    digits = raw.rstrip("kmgt")
    unit = raw[len(digits) :]
    try:
        value = float(digits)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 64MiB)") from exc
    if unit not in _SIZE_UNITS or not 0 <= value * _SIZE_UNITS[unit] <= _MAX_SIZE:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 64MiB, at most 1PiB)")
    return int(value * _SIZE_UNITS[unit])


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


def _ratio_pct(text: str) -> int:
    try:
        ratio = float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"a ratio like 1.5, not {text!r}") from exc
    if not 1.0 <= ratio <= _MAX_RATIO:
        raise argparse.ArgumentTypeError(
            f"a ratio of highest used id to used blocks in [1, {_MAX_RATIO:g}] like 1.5 "
            f"(not a percent), not {text!r}"
        )
    return round(ratio * 100)


def _policy_name(text: str) -> str:
    from kvlog.sweep import POLICY_NAMES

    if text not in POLICY_NAMES:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(POLICY_NAMES)}")
    return text


# -- policy flags --------------------------------------------------------------------------
def add_policy_flags(p: argparse.ArgumentParser, defaults: bool) -> None:
    """``--policy`` and its parameters; for replay (``defaults=False``) an absent flag keeps
    the recording's value."""
    d = SynthConfig()
    p.add_argument(
        "--policy",
        choices=DEFRAG_POLICIES,
        default=d.policy if defaults else None,
        help="defrag policy: seed (the plugin's rule) or tail (vllm-gaudi PR #376)",
    )
    p.add_argument(
        "--ratio-limit",
        dest="policy_ratio_pct",
        type=_ratio_pct,
        default=None,
        help=f"tail: defrag when highest used id / used blocks exceeds this "
        f"({d.policy_ratio_pct / 100:g})",
    )
    p.add_argument(
        "--min-swaps",
        dest="policy_min_swaps",
        type=int,
        default=None,
        help=f"tail: skip defrags of fewer pairs ({d.policy_min_swaps})",
    )
    p.add_argument(
        "--max-bytes-per-step",
        type=size_arg,
        default=d.max_bytes_per_step if defaults else None,
        help="any policy: bytes one step's defrag may move, e.g. 256MiB (0: no cap)",
    )


POLICY_FIELDS = ("policy", "policy_ratio_pct", "policy_min_swaps", "max_bytes_per_step")


def policy_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The policy flags that were given (all of them for synth, which has defaults)."""
    return {n: getattr(args, n) for n in POLICY_FIELDS if getattr(args, n, None) is not None}


# -- synth --trace -------------------------------------------------------------------------
_TRACE_ONLY = {
    "trace_format": None,
    "requests": None,
    "time_scale": 1.0,
    "step_ms": 50.0,
    "max_num_batched_tokens": 8192,
    "max_model_len": 0,
    "scheduler": "kvlog",
}
"""The flags only ``--trace`` reads, and their values when not given."""


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
    if given.get("requests", 0) < 0:
        raise ConfigError("--requests", given["requests"], "a count >= 0")
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
    _check_trace_config(trace_config, requests)
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
    )


def trace_geometry(args: argparse.Namespace) -> dict[str, int]:
    """``num_gpu_blocks``, ``block_size``, ``page_size_bytes`` for synth, trace or not."""
    d = SynthConfig()
    trace = bool(getattr(args, "trace", None))
    blocks = args.num_gpu_blocks
    if blocks is None:  # 0 is a value (refused by the validator), not "the default"
        blocks = TRACE_DEFAULTS["num_gpu_blocks"] if trace else d.num_gpu_blocks
    size = args.block_size
    if size is None:
        size = TRACE_DEFAULTS["block_size"] if trace else d.block_size
    page = getattr(args, "page_size_bytes", None)
    if page is None:
        page = bytes_per_token() * size if trace else d.page_size_bytes
    return {"num_gpu_blocks": blocks, "block_size": size, "page_size_bytes": page}


def _check_trace_config(config: TraceConfig, requests: Sequence[TraceRequest]) -> None:
    from kvlog.errors import TraceError

    if requests and requests[0].hash_ids and 512 % config.synth.block_size:
        raise TraceError(f"--block-size {config.synth.block_size} must divide 512 for hash_ids")
    config.check(requests)


# -- tables and progress -------------------------------------------------------------------
def render_table(rows: Sequence[tuple[str, ...]], header: bool = False) -> str:
    """Rows as aligned columns (rich): text left, figures right; ``header``: the first row
    is a header, underlined."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    if not rows:
        return ""
    width = max(len(r) for r in rows)
    table = Table(
        box=box.SIMPLE_HEAD if header else None,
        show_header=header,
        show_edge=False,
        pad_edge=False,
        padding=(0, 1),
    )
    first = rows[0] if header else ("",) * width
    for i in range(width):
        name = first[i] if i < len(first) else ""
        numeric = i > 0 and all(_figure(r[i]) for r in rows[1 if header else 0 :] if i < len(r))
        table.add_column(name, justify="right" if numeric else "left", no_wrap=True)
    for r in rows[1:] if header else rows:
        table.add_row(*(list(r) + [""] * (width - len(r))))
    buffer = io.StringIO()
    Console(file=buffer, width=400, color_system=None, legacy_windows=False).print(table)
    return "\n".join("  " + line.rstrip() for line in buffer.getvalue().splitlines())


def _figure(text: str) -> bool:
    stripped = text.replace(",", "").replace(".", "").replace("-", "").split(" ")[0]
    return stripped.isdigit() or not text


@contextlib.contextmanager
def progress_bar(
    description: str, stream: TextIO | None = None
) -> Iterator[Callable[[int, int], None]]:
    """A rich progress bar on stderr (drawn only on a terminal); yields ``update(done, total)``."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    console = Console(file=stream or sys.stderr)
    columns = (BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(
        *Progress.get_default_columns()[:1],
        *columns,
        console=console,
        transient=True,
        disable=not console.is_terminal,  # else rich leaves a blank line on stderr
    ) as bar:
        task = bar.add_task(description, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update


# -- kvlog sweep ---------------------------------------------------------------------------
def add_sweep(sub: Any) -> None:
    p = sub.add_parser("sweep", help="what-if replays of logs under many policies, on Ray")
    p.add_argument("logs", nargs="+", metavar="LOG")
    p.add_argument("--out", required=True, help="directory for sweep.csv and sweep.png")
    p.add_argument(
        "--policy",
        type=_list_of(_policy_name, "policy names"),
        default=["seed", "tail", "budget"],
        help="policies to try, from seed, tail, budget, off, recorded",
    )
    p.add_argument(
        "--threshold",
        type=_list_of(int, "integers"),
        default=[8, 16, 32],
        help="seed (and budget: the lowest) thresholds",
    )
    p.add_argument("--max-swaps", type=_list_of(int, "integers"), help="seed: caps per step")
    p.add_argument(
        "--ratio-limit",
        type=_list_of(_ratio_pct, "ratios"),
        default=[150],
        help="tail: ratio limits, e.g. 1.25,1.5",
    )
    p.add_argument("--min-swaps", type=_list_of(int, "integers"), default=[4], help="tail")
    p.add_argument(
        "--budget",
        type=_list_of(size_arg, "sizes"),
        default=[64 << 20],
        help="budget: bytes per step, e.g. 64MiB,256MiB",
    )
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
    from kvlog.tier.whatif import EVICTIONS

    for name in args.eviction:
        if name not in EVICTIONS:
            raise ConfigError("--eviction", args.eviction, f"names from {list(EVICTIONS)}")
    if args.tokens_per_chunk < 1 or 512 % args.tokens_per_chunk:
        raise ConfigError("--tokens-per-chunk", args.tokens_per_chunk, "a divisor of 512")
    if args.prefill_us_per_token < 0 or args.bytes_per_token < 1:
        raise ConfigError("--prefill-us-per-token", args.prefill_us_per_token, "a time >= 0")
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
    columns = (
        "log",
        "eviction",
        "cpu_bytes",
        "store_threshold",
        "hit_rate",
        "bytes_loaded",
        "bytes_stored",
        "evictions",
        "never_read",
        "prefill_saved_s",
        "load_s",
    )
    table = [columns] + [
        (os.path.basename(str(r["log"])), *(str(r[c]) for c in columns[1:])) for r in rows
    ]
    print(render_table(table, header=True))
    os.makedirs(args.out, exist_ok=True)
    csv_path, png_path = os.path.join(args.out, "sweep.csv"), os.path.join(args.out, "sweep.png")
    write_tier_csv(csv_path, rows)
    write_tier_plot(png_path, rows, curves)
    print(f"\nwrote {csv_path} and {png_path} ({time.perf_counter() - started:.1f} s)")
    return 0


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
    from kvlog.sweep import (
        policy_grid,
        run_sweep,
        sweep_table,
        write_sweep_csv,
        write_sweep_plot,
    )

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
        f"kvlog sweep: {len(args.logs)} logs x {len(specs)} policies on {where}; {cost.describe()}"
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
    write_sweep_plot(png_path, rows)
    print(f"\nwrote {csv_path} and {png_path} ({time.perf_counter() - started:.1f} s)")
    refused = [r for r in rows if r.rejected]
    return 1 if refused else 0


def check_sweep_flags(args: argparse.Namespace) -> None:
    """What ``kvlog sweep`` would fail on after its work, refused before it (ConfigError
    naming the flag, or MissingExtra): CPUs below 1, values no policy accepts, an ``--out``
    that cannot hold the CSV and the PNG, no matplotlib for the PNG, no Ray without
    ``--serial``."""
    from kvlog.report import plt_module
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
    rows: list[tuple[str, ...]] = [("segment", "records", "events", "verified", "digest", "")]
    for s in result.segments:
        stop = "end" if s.stop_seq < 0 else f"{s.stop_seq:,}"
        rows.append(
            (
                str(s.index),
                f"{s.start_seq:,}..{stop}",
                f"{s.num_events:,}",
                f"{s.num_verified:,}",
                s.final_digest[:16],
                s.divergence,
            )
        )
    out.write(render_table(rows, header=True) + "\n")
    out.write(
        f"\n{len(result.segments)} segments, {result.num_events:,} events, "
        f"{result.num_verified:,} checkpoints verified, final digest {result.final_digest} "
        f"({time.perf_counter() - started:.2f} s)\n"
    )
    out.write("no divergence\n" if result.ok else f"DIVERGENCE: {result.divergence}\n")
    return 0 if result.ok else 1

"""Flags and argument types shared by the subcommands: the help formatter, the policy
flags (one per ``CacheConfigured`` policy field), the trace, tier, cost and parallel flags, and
the log options they turn into."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from kvlog import reducers
from kvlog.analysis.cost import HARDWARE
from kvlog.analysis.policy import (
    POLICY_FIELDS,
    check_tail_only,
    parse_ratio_pct,
    parse_size,
    policy_field,
)
from kvlog.errors import ConfigError
from kvlog.events import DEFRAG_POLICIES, CacheConfigured, Checkpoint
from kvlog.log import LogReader
from kvlog.synth import (
    SynthConfig,
    TraceConfig,
    trace_geometry,
)
from kvlog.synth.traces import TRACE_FORMATS
from kvlog.tier.variants import check_tier_values

__all__ = [
    "HelpFormatter",
    "ListFlag",
    "POLICY_FIELD_NAMES",
    "PAST_DAMAGE_HELP",
    "PAST_DAMAGE_HINT",
    "SALVAGE_HELP",
    "TRACE_CONFIG",
    "TRACE_ONLY",
    "add_cost_flags",
    "add_parallel_flags",
    "add_policy_flags",
    "add_salvage_flags",
    "add_tier_flags",
    "add_trace_flags",
    "arg_type",
    "as_typed",
    "check_policy_flags",
    "check_salvage_flags",
    "check_tier_flags",
    "flag_of",
    "list_of",
    "log_options",
    "policy_fields",
    "policy_name",
    "ratio_pct",
    "ratio_text",
    "recorded_config",
    "recorded_policy",
    "size_arg",
    "synth_geometry",
    "trace_flags",
]


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default after its help, unless there is none to show (None), it is
    a switch's (``--no-verify``'s default True means "verify": its help says what holds
    without it), the help already says it, or it is a list (their help says it in the
    flag's own units)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if default is None or isinstance(default, bool | list):
            return text
        return text if "default" in text else super()._get_help_string(action)


POLICY_FIELD_NAMES = frozenset(row.name for row in POLICY_FIELDS)


SALVAGE_HELP = "read the intact prefix of a damaged log; say where and why it stops (exit 1)"
PAST_DAMAGE_HELP = (
    "with --salvage: go on past damage at the next valid record (or segment), one line per "
    "range not read"
)

PAST_DAMAGE_HINT = "valid records follow the damage: --past-damage goes on there"


def add_salvage_flags(parser: argparse.ArgumentParser, past_damage_help: str) -> None:
    """``--salvage`` and ``--past-damage`` (``check_salvage_flags`` refuses the second
    alone)."""
    parser.add_argument("--salvage", action="store_true", help=SALVAGE_HELP)
    parser.add_argument(
        "--past-damage", action="store_true", help=f"{PAST_DAMAGE_HELP}; {past_damage_help}"
    )


def check_salvage_flags(args: argparse.Namespace) -> None:
    """``ConfigError`` for ``--past-damage`` without ``--salvage``."""
    if args.past_damage and not args.salvage:
        raise ConfigError("--past-damage", True, "--salvage with it", shown="--past-damage")


# -- argument types ------------------------------------------------------------------------
def arg_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse ``type`` from a parser of :mod:`kvlog.analysis.policy` (its ``ValueError``
    becomes the usage error's message)."""

    def typed(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    typed.__name__ = parse.__name__
    return typed


size_arg = arg_type(parse_size)
"""Bytes from ``4096``, ``64MiB``, ``1G``, ``512k`` (binary units)."""


ratio_pct = arg_type(parse_ratio_pct)


def list_of(kind: Callable[[str], Any], what: str) -> Callable[[str], list[Any]]:
    def parse(text: str) -> list[Any]:
        try:
            values = [kind(x) for x in text.replace(" ", "").split(",") if x]
        except (ValueError, argparse.ArgumentTypeError) as exc:
            raise argparse.ArgumentTypeError(f"wants {what} like {text!r}: {exc}") from exc
        if not values:
            raise argparse.ArgumentTypeError(f"wants at least one of {what}")
        return values

    return parse


def policy_name(text: str) -> str:
    from kvlog.analysis.grid import POLICY_NAMES

    if text not in POLICY_NAMES:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(POLICY_NAMES)}")
    return text


# -- policy flags --------------------------------------------------------------------------
def add_policy_flags(p: argparse.ArgumentParser, defaults: bool) -> None:
    """A flag per policy field (:data:`kvlog.analysis.policy.POLICY_FIELDS`); for replay
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
                help="turn defragmentation off ("
                + ("defrag is on unless given)" if defaults else "default: the log's)"),
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
TRACE_CONFIG = {f.name: f.default for f in dataclasses.fields(TraceConfig)}


TRACE_ONLY: dict[str, Any] = {
    "trace_format": None,
    "requests": None,
    **{n: TRACE_CONFIG[n] for n in ("time_scale", "step_ms", "max_num_batched_tokens")},
    "max_model_len": TRACE_CONFIG["max_model_len"],
    "scheduler": "kvlog",
}
"""The flags only ``--trace`` reads, and their values when not given (``TraceConfig``'s
defaults: ``run_trace`` from Python has the same)."""


def add_trace_flags(p: argparse.ArgumentParser) -> None:
    """The ``synth --trace`` flags; given without ``--trace`` they are refused (they would
    be ignored), so their parser default is None and :data:`TRACE_ONLY` has the values."""
    d = TRACE_ONLY
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
    given = {n: getattr(args, n) for n in TRACE_ONLY if getattr(args, n) is not None}
    if given and not args.trace:
        name = next(iter(given))
        raise ConfigError("--" + name.replace("_", "-"), given[name], "--trace with it")
    if given.get("requests", 1) < 1:
        raise ConfigError("--requests", given["requests"], "a count >= 1")
    return {**TRACE_ONLY, **given}


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
ListFlag = tuple[str, Callable[[str], Any], str, Sequence[Any], str, Callable[[Any], str]]
"""A sweep flag that takes a list: flag, item parser, what the items are, defaults, help,
how the help shows a default."""


def ratio_text(pct: int) -> str:
    return f"{pct / 100:g}"


def add_tier_flags(p: argparse.ArgumentParser) -> None:
    """The CPU tier's what-ifs (issue 23): given ``--cpu-bytes``, the sweep is of the tier."""
    p.add_argument(
        "--cpu-bytes",
        type=list_of(size_arg, "sizes"),
        help="CPU tier: host memory to try, e.g. 4GiB,16GiB,64GiB (LOG: a log or a trace)",
    )
    p.add_argument(
        "--eviction",
        type=list_of(str, "names"),
        default=["lru", "arc", "opt"],
        help="CPU tier: eviction policies, from lru, arc, opt (the offline optimum)",
    )
    p.add_argument("--store-threshold", type=list_of(int, "integers"), default=[0], help="CPU tier")
    p.add_argument(
        "--tokens-per-chunk",
        type=int,
        help="CPU tier: chunk size (default: a log's own, 512 for a trace)",
    )
    p.add_argument(
        "--bytes-per-token",
        type=int,
        help="CPU tier: KV bytes of one token (default: a log's own, 131072 for a trace)",
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


def check_tier_flags(args: argparse.Namespace) -> None:
    """``kvlog sweep --cpu-bytes``'s tier flags, checked by :func:`check_tier_values`."""
    check_tier_values(
        evictions=args.eviction,
        store_thresholds=args.store_threshold,
        tokens_per_chunk=args.tokens_per_chunk or 512,
        bytes_per_token=args.bytes_per_token or 131072,
        gpu_tokens=args.gpu_tokens,
        prefill_us_per_token=args.prefill_us_per_token,
    )


def add_cost_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--hardware",
        choices=sorted(HARDWARE),
        default="gaudi2",
        help="cost model preset (HBM bandwidth)",
    )
    p.add_argument("--hbm-tbps", type=float, help="override the HBM bandwidth, TB/s")
    p.add_argument("--link-gbps", type=float, help="override the host link, GB/s each way")


# -- kvlog replay --parallel ---------------------------------------------------------------
def add_parallel_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--parallel",
        action="store_true",
        help="replay segments between snapshots in parallel on Ray",
    )
    p.add_argument("--address", help="--parallel on an existing Ray cluster")
    p.add_argument("--num-cpus", type=int, help="--parallel on a local Ray with this many CPUs")


def flag_of(name: str) -> str:
    if name in POLICY_FIELD_NAMES:
        return policy_field(name).flag
    return "--" + name.replace("_", "-")


def recorded_config(path: str) -> CacheConfigured | None:
    """The configuration the log at ``path`` was recorded with (its first record, or the
    configuration in the opening snapshot of a log directory whose start is gone)."""
    for _, record in LogReader(path).records(0):
        if type(record) is Checkpoint and record.snapshot:
            config = reducers.restore(record.snapshot).config
            return config if isinstance(config, CacheConfigured) else None
        return record if type(record) is CacheConfigured else None
    return None


def recorded_policy(path: str) -> str:
    """The defrag policy the log at ``path`` was recorded with (``seed`` where unknown)."""
    config = recorded_config(path)
    return "seed" if config is None else config.policy


def check_policy_flags(args: argparse.Namespace, policy: str) -> None:
    """``--ratio-limit`` and ``--min-swaps`` tune the tail policy only: refused under any
    other (they would be ignored), shown as typed (``--ratio-limit 2``)."""
    check_tail_only(vars(args), policy, flag_of, "--policy tail with it", as_typed=True)


def as_typed(name: str, value: Any) -> str:
    """A policy field's value as its flag takes it: ``--threshold 8``, ``--no-defrag``."""
    if name == "defrag":
        return "--defrag" if value else "--no-defrag"
    return f"{flag_of(name)} {policy_field(name).text(value)}"

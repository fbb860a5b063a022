"""``kvlog synth``: record a seeded serving workload, or a public trace, into a new log."""

from __future__ import annotations

import argparse
import os
from typing import Any

from kvlog.cli.flags import (
    HelpFormatter,
    add_policy_flags,
    add_trace_flags,
    check_policy_flags,
    log_options,
    policy_fields,
    synth_geometry,
    trace_flags,
)
from kvlog.log import SYNC_MODES
from kvlog.present.text import (
    synth_text,
)
from kvlog.synth import (
    SynthConfig,
    SynthResult,
    TraceConfig,
    read_trace,
    run_synth,
)

__all__ = ["add_synth", "cmd_synth", "run_trace_command", "synth_config"]

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


def add_synth(sub: Any) -> None:
    p = sub.add_parser(
        "synth",
        help="record a synthetic serving workload (or a public trace) into a log",
        description="Record a seeded serving workload, or a public request trace with "
        "--trace, into a new log (arrivals, prefix sharing, preemption, stores and loads).",
        formatter_class=HelpFormatter,
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

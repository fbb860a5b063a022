"""``kvlog demo``: synth on CPU tensors, replay, verify, what-ifs and a report, in one go."""

from __future__ import annotations

import argparse
import errno
import os
import tempfile
import time
from typing import Any

from kvlog.analysis.replay import replay
from kvlog.analysis.tally import Series
from kvlog.cli.flags import HelpFormatter
from kvlog.errors import KvlogError, LogExists, MissingExtra
from kvlog.log import LogReader
from kvlog.present.report import write_report
from kvlog.present.text import (
    replay_text,
    synth_text,
)
from kvlog.synth import (
    SynthConfig,
    run_synth,
)
from kvlog.util.units import format_bytes

__all__ = ["add_demo", "cmd_demo", "demo_config"]


def add_demo(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="synth on CPU tensors (offload + defrag), replay, verify, what-ifs, report",
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "--out", default=os.path.join("out", "demo"), help="directory for the log and report"
    )
    p.add_argument("--steps", type=int, default=1500, help="scheduler steps to record")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload")


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

"""What ``kvlog`` prints: aligned tables (rich), a progress bar, and the text of each
command's result (synth, replay and its what-if, sweep, segment replay). Every function
returns text; the command line prints it."""

from __future__ import annotations

import contextlib
import io
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TextIO

from kvlog.reducers.tier_misses import TierFigures
from kvlog.util.units import format_bytes, format_value, plural, size_label

if TYPE_CHECKING:
    from kvlog.analysis.grid import SweepRow
    from kvlog.analysis.parallel import SegmentedReplay
    from kvlog.analysis.replay import PolicyResult, ReplayResult, WhatIf
    from kvlog.synth import SynthResult

__all__ = [
    "progress_bar",
    "render_table",
    "replay_text",
    "retired_text",
    "unverified_text",
    "segments_text",
    "sweep_table",
    "synth_text",
    "tier_explained_text",
]


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


# -- synth ---------------------------------------------------------------------------------
def synth_text(r: SynthResult) -> str:
    """The summary ``kvlog synth`` and ``kvlog demo`` print."""
    rows = [
        ("log", f"{r.log_path} ({plural(r.num_events, 'event')}, {plural(r.num_steps, 'step')})"),
        (
            "requests",
            f"{r.num_requests:,} arrived, {r.num_finished:,} finished, "
            f"{plural(r.num_preemptions, 'preemption')}",
        ),
        ("prefix cache", _prefix_line(r)),
        (
            "offload",
            f"{plural(r.num_stores, 'store')}, {plural(r.num_loads, 'load')} "
            f"({plural(r.num_loaded_blocks, 'block')}), {r.num_failed_transfers:,} failed",
        ),
        (
            "defrag",
            f"{plural(r.num_swap_plans, 'swap plan')}, {r.num_swapped_blocks:,} blocks moved",
        ),
        ("peak highest used id", f"{r.peak_max_used:,}"),
        ("digest", r.final_digest),
        ("elapsed", f"{r.elapsed_s:.2f} s ({r.num_events / max(r.elapsed_s, 1e-9):,.0f} events/s)"),
    ]
    if r.simulated_s:
        rows.insert(2, ("trace", f"{r.simulated_s:,.1f} s served, {r.num_clipped:,} clipped"))
    if r.canary_checks:
        checked = sum(c.num_checked for c in r.canary_checks)
        failed = sum(c.num_failed for c in r.canary_checks)
        rows.append(
            (
                "canary",
                f"{plural(len(r.canary_checks), 'check')}, {plural(checked, 'block')} read, "
                f"{failed:,} wrong",
            )
        )
    return "synth\n" + render_table(rows)


def _prefix_line(r: SynthResult) -> str:
    if not r.config.prefix_caching:
        return "off"
    return (
        f"{r.num_prefix_hit_blocks:,} hit blocks of {r.num_prefix_query_blocks:,} looked up "
        f"(hit rate {r.prefix_hit_rate:.1%})"
    )


# -- replay --------------------------------------------------------------------------------
_STATS = (
    ("swap plans", "num_swap_plans"),
    ("blocks moved by defrag", "num_swapped_blocks"),
    ("bytes moved by defrag", "swap_bytes"),
    ("stores", "num_stores"),
    ("bytes stored", "store_bytes"),
    ("loads", "num_loads"),
    ("bytes loaded", "load_bytes"),
    ("bytes moved in all", "bytes_moved"),
    ("peak highest used id", "peak_max_used"),
    ("mean highest used id", "mean_max_used"),
)


def _stats_rows(result: ReplayResult) -> list[tuple[str, ...]]:
    rec = result.recorded
    if rec is None:
        return []
    runs: list[PolicyResult] = [rec]
    if result.whatif is not None:
        runs.append(result.whatif.whatif)
    rows: list[tuple[str, ...]] = [("", *("what-if" if r is not rec else r.label for r in runs))]
    for label, attr in _STATS:
        fmt = format_bytes if "bytes" in attr else format_value
        rows.append((label, *(fmt(getattr(r, attr)) for r in runs)))
    return rows


def describe_overrides(overrides: dict[str, Any], recorded: Any = None) -> str:
    """``threshold 64 (recorded 32), policy tail``: a what-if's settings in words."""
    parts = []
    for name, value in overrides.items():
        was = getattr(recorded, name, None)
        note = f" (recorded {_setting(name, was)})" if was is not None and was != value else ""
        parts.append(f"{name.replace('_', ' ')} {_setting(name, value)}{note}")
    return ", ".join(parts)


def _setting(name: str, value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if name == "max_bytes_per_step" and isinstance(value, int):
        return format_bytes(value) if value else "no cap"
    if isinstance(value, tuple | list):
        return ",".join(str(v) for v in value)
    return format_value(value)


def _whatif_text(w: WhatIf, config: Any) -> str:
    steps = w.recorded.num_steps
    out = [f"what-if: {describe_overrides(w.overrides, config)}"]
    out.append(
        "  the recorded events under these settings (the log's checkpoints are the recorded\n"
        "  run's, so they are checked against that run only)"
    )
    out.append(
        f"  highest used id: mean {w.recorded.mean_max_used:,.1f} -> "
        f"{w.whatif.mean_max_used:,.1f}, different on "
        f"{w.num_steps_max_used_differs:,} of {plural(steps, 'step')}"
    )
    out.append(
        f"  moved by defrag: {format_bytes(w.recorded.swap_bytes)} -> "
        f"{format_bytes(w.whatif.swap_bytes)} ({w.recorded.num_swapped_blocks:,} -> "
        f"{w.whatif.num_swapped_blocks:,} blocks)"
    )
    if w.whatif.rejected is not None:
        out.append(f"  the what-if stopped: {w.whatif.rejected.message}")
    return "\n".join(out)


def replay_text(result: ReplayResult) -> str:
    """The summary ``kvlog replay`` prints: the log, the figures of the recorded run (and
    of a what-if next to them), the canary, and whether the log verified."""
    rows = [
        ("log", f"{result.path}"),
        (
            "records",
            f"{result.num_records:,} ({plural(result.num_events, 'event')}, "
            f"{plural(result.num_checkpoints, 'checkpoint')}, {result.num_verified:,} verified)",
        ),
        ("final digest", result.final_digest),
        ("replay speed", f"{result.events_per_s:,.0f} events/s ({result.elapsed_s:.2f} s)"),
    ]
    if result.start_seq:
        rows.append(("started at", f"seq {result.start_seq:,} (snapshot)"))
    if result.tail:
        rows.append(("torn tail", result.tail))
    rows += [("gap", gap) for gap in result.gaps]  # the recorder detached (an I/O error)
    if result.damaged:
        count = plural(len(result.damaged), "damaged range")
        rows.append(("salvaged", f"went past {count} (each: stderr)"))
    if result.salvaged:
        what = "then stopped at damage" if result.damaged else "the intact prefix; the log"
        rows.append(("salvaged", f"{what} is damaged after it (why: stderr)"))
    rows += [("retired", text) for text in retired_text(result)]
    rows += [("not verified", text) for text in unverified_text(result)]
    rows += _directory_rows(result)
    parts = ["replay\n" + render_table(rows), render_table(_stats_rows(result), header=True)]
    if result.whatif is not None:
        parts.append(_whatif_text(result.whatif, result.recorded_config))
    if result.canary is not None:
        c = result.canary
        lines = [
            f"canary: {plural(c.num_checked, 'block')} read, {c.num_failed:,} wrong, "
            f"{c.num_skipped:,} not checkable"
        ]
        lines += [f"  {f}" for f in c.failures[:5]]
        parts.append("\n".join(lines))
    parts.append(_verdict(result))
    return "\n\n".join(parts)


def _not_read(count: int) -> str:
    if not count:
        return ""
    return f" ({plural(count, 'earlier segment')} not read)"


def retired_text(result: ReplayResult) -> list[str]:
    """One line per run of sequence numbers retention removed during the replay."""
    return [
        f"seq {first:,}-{last:,} removed by the log's retention during the read: not verified"
        for first, last in result.retired
    ]


def unverified_text(result: ReplayResult) -> list[str]:
    """One line per run of sequence numbers a replay went past damage over."""
    out = []
    for first, last in result.unverified:
        went_on = f"from the snapshot at seq {last + 1:,}" if last + 1 <= result.last_seq else ""
        until = f"went on {went_on}" if went_on else "no snapshot followed: replayed no further"
        out.append(f"seq {first:,}-{last:,} damaged or after damage: not verified ({until})")
    return out


_NOT_CLOSED = (
    "not closed: its writer never closed it (killed, crashed, or still writing); "
    "read to its last durable record"
)


def _directory_rows(result: ReplayResult) -> list[tuple[str, str]]:
    """How the log ended, and the files of a log directory its manifest does not list."""
    rows = []
    if not result.closed_cleanly:
        rows.append(("ended", _NOT_CLOSED))
    unlisted = result.unlisted
    if len(unlisted) > 3:  # no manifest, or one that lost its entries
        count = plural(len(unlisted), "segment")
        rows.append(
            (
                "unlisted",
                f"{count} ({unlisted[0]} to {unlisted[-1]}): not in the manifest, read "
                "without their SHA-256 checks",
            )
        )
    else:
        rows += [
            ("unlisted", f"{name}: not in the manifest, read without its SHA-256 check")
            for name in unlisted
        ]
    rows += [
        ("stray", f"{name}: not in the manifest and holds no log: not read")
        for name in result.strays
    ]
    return rows


def _verdict(result: ReplayResult) -> str:
    d = result.divergence
    checked = f"({result.num_verified:,} of {plural(result.num_checkpoints, 'checkpoint')} checked)"
    if d is None and result.from_snapshot and result.start_seq - 1 > result.first_seq:
        return (
            f"verified from the latest snapshot (seq {result.start_seq - 1:,}) on: the replay "
            f"agrees with the log there {checked}; seq {result.first_seq:,}-"
            f"{result.start_seq - 2:,} not replayed" + _not_read(result.segments_not_read)
        )
    if d is None and result.unverified:
        skipped = ", ".join(f"seq {first:,}-{last:,}" for first, last in result.unverified)
        return (
            f"verified where it was read: the replay agrees with the log outside the damage "
            f"{checked}; not read or not verified (damage): {skipped}"
        )
    if d is None:
        where = " where it was read" if result.retired else ""
        return f"verified: the replay agrees with the log{where} {checked}"
    agreed = f"last agreeing seq {d.after_seq}" if d.after_seq >= 0 else "nothing before it"
    lines = [f"DIVERGENCE ({d.kind}) at seq {d.seq} ({agreed}): {d.message}"]
    for label, value in (
        ("event", d.event),
        ("other event", d.other_event),
        ("expected digest", d.expected_digest),
        ("actual digest", d.actual_digest),
        ("expected plans", d.expected_plans),
        ("actual plans", d.actual_plans),
    ):
        if value:
            lines.append(f"  {label}: {value}")
    return "\n".join(lines)


# -- sweep ---------------------------------------------------------------------------------
SWEEP_COLUMNS = (
    "log",
    "policy",
    "mean top id",
    "peak top id",
    "blocks moved",
    "defrag bytes",
    "stored+loaded",
    "peak step defrag",
    "stores",
    "loads",
    "model ms/step",
    "p99 ms",
    "note",
)
"""The sweep table's columns: ``defrag bytes`` is what the sweep picture plots; transfers
are the same under every policy and have their own column."""


def sweep_table(rows: Sequence[SweepRow]) -> list[tuple[str, ...]]:
    """Header and one line per row: the figures a person compares."""
    out: list[tuple[str, ...]] = [SWEEP_COLUMNS]
    for r in rows:
        if r.rejected:
            blank = ("-",) * (len(SWEEP_COLUMNS) - 3)
            out.append((r.log, r.policy, *blank, "refused: " + r.rejected))
            continue
        out.append(
            (
                r.log,
                r.policy,
                f"{r.mean_max_used:,.1f}",
                f"{r.peak_max_used:,}",
                f"{r.blocks_moved:,}",
                format_bytes(r.swap_bytes),
                format_bytes(r.store_bytes + r.load_bytes),
                format_bytes(r.peak_step_swap_bytes),
                f"{r.stores:,}",
                f"{r.loads:,}",
                f"{r.modeled_ms_per_step:,.3f}",
                f"{r.p99_step_ms:,.2f}",
                "",
            )
        )
    return out


TIER_COLUMNS = (
    "log",
    "eviction",
    "host memory",
    "store threshold",
    "hit rate",
    "loaded",
    "stored",
    "evictions",
    "never read",
    "prefill saved",
    "load time",
    "misses by reason",
)
"""The CPU tier sweep's table (``kvlog sweep --cpu-bytes``): ``sweep.csv`` has the raw
numbers under the CSV's own column names."""


def tier_table(rows: Sequence[dict[str, Any]]) -> list[tuple[str, ...]]:
    """Header and one line per (log, variant) of the CPU tier sweep, in units."""
    out: list[tuple[str, ...]] = [TIER_COLUMNS]
    for r in rows:
        name = os.path.basename(str(r["log"]))
        out.append(
            (
                name,
                str(r["eviction"]),
                size_label(int(r["cpu_bytes"])),
                str(r["store_threshold"]),
                f"{float(r['hit_rate']):.2%}",
                format_bytes(int(r["bytes_loaded"])),
                format_bytes(int(r["bytes_stored"])),
                f"{int(r['evictions']):,}",
                f"{int(r['never_read']):,}",
                f"{float(r['prefill_saved_s']):,.1f} s",
                f"{float(r['load_s']):,.2f} s",
                miss_reasons(r),
            )
        )
    return out


def miss_reasons(row: dict[str, Any]) -> str:
    """A row's misses by reason (``miss_<reason>`` columns), the largest first; '-' for a
    variant with no reasons (``opt``)."""
    found = [(k[5:], v) for k, v in row.items() if k.startswith("miss_") and v != ""]
    if not found:
        return "-"
    found.sort(key=lambda kv: -int(kv[1]))
    return ", ".join(f"{k} {int(v):,}" for k, v in found if int(v)) or "none"


def tier_explained_text(figures: TierFigures) -> str:
    """``kvlog replay`` of a tier log: its lookups, hit rate and misses by reason (the code
    the connector's live metrics use)."""
    misses = sorted(figures.misses.items(), key=lambda kv: -kv[1])
    lines = [
        f"CPU tier: {figures.lookups:,} lookups, {figures.hits:,} hits "
        f"({figures.hit_rate:.2%}), {sum(figures.misses.values()):,} misses",
        "  misses by reason: " + (", ".join(f"{k} {v:,}" for k, v in misses if v) or "none"),
        f"  chunks stored {figures.chunks_stored:,}, loaded {figures.chunks_loaded:,}, "
        f"evicted {figures.chunks_evicted:,}; stores refused {figures.stores_refused:,}; "
        f"stored chunks never read {figures.never_read:,} (+{figures.unread:,} still resident)",
    ]
    return "\n".join(lines)


def segments_text(result: SegmentedReplay, elapsed_s: float) -> str:
    """``kvlog replay --parallel``: a line per segment, then the chained result."""
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
    verdict = (
        "verified: the segments agree with the log"
        if result.ok
        else f"DIVERGENCE: {result.divergence}"
    )
    ended = "" if result.closed_cleanly else f"ended: {_NOT_CLOSED}\n"
    return (
        render_table(rows, header=True)
        + f"\n\n{plural(len(result.segments), 'segment')}, {plural(result.num_events, 'event')}, "
        f"{plural(result.num_verified, 'checkpoint')} verified, final digest "
        f"{result.final_digest} ({elapsed_s:.2f} s)\n" + ended + verdict
    )

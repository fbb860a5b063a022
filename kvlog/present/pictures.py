"""The pictures: a replay's report (``kvlog replay --report``, ``kvlog demo``) and a sweep's
comparison (``kvlog sweep``), drawn so a performance engineer reads them at a glance.

Report: a table of summary figures per policy on top (mean and p99 modeled ms per step,
mean highest used id, bytes moved by defrag, bytes stored and loaded), then panels sharing
the step axis: used blocks (grey area) and each policy's highest used id, fragmentation
(only where enough ids are in use to mean something), the bytes defrag moved and the bytes
transferred as cumulative lines, and the modeled step time. Each policy has its own colour
and line style; per-step series are drawn faint with a rolling mean on top (above 2,000
steps, as a band of each bin's 10th to 90th percentile instead: a faint line per step would
fill the panel).

Sweep: a row of bar panels per log, one bar per variant in the order given (refused
variants keep their row, with the reason): modeled ms per step (mean, p99 written next to
it, the best one marked, or every variant within 1% of it marked as a tie), bytes moved by
defrag, mean highest used id. One colour per
policy family everywhere.

Tier sweep (``kvlog sweep --cpu-bytes``): one panel per log, the share of chunks served from
the CPU tier against its host memory: one-pass LRU and optimum curves, the replayed variants
as points.

matplotlib is the ``plot`` extra; without it :func:`plt_module` raises
:class:`~kvlog.errors.MissingExtra` naming it.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvlog.errors import MissingExtra
from kvlog.util.units import byte_unit, format_bytes, p99, printable

if TYPE_CHECKING:
    from kvlog.analysis.cost import CostModel
    from kvlog.analysis.grid import SweepRow
    from kvlog.analysis.tally import Series
    from kvlog.events import CacheConfigured
    from kvlog.tier.sweep import TierCurve

__all__ = [
    "FAMILY_COLORS",
    "MAX_FAINT_STEPS",
    "TIE_SHARE",
    "plt_module",
    "rolling_mean",
    "write_report_figure",
    "write_sweep_figure",
    "write_tier_plot",
]

COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")
LINESTYLES = ("-", "--", "-.", ":")
FAMILY_COLORS = {
    "seed": "tab:blue",
    "tail": "tab:orange",
    "budget": "tab:green",
    "off": "0.45",
    "recorded": "tab:purple",
}
MIN_FRAGMENTATION_IDS = 64
"""Fragmentation is drawn only at steps whose highest used id is at least this (and at
least 5% of the pool): over a handful of blocks a share of holes means nothing."""


def plt_module(purpose: str) -> Any:
    """``matplotlib.pyplot`` on the Agg backend, or ``MissingExtra`` naming ``kvlog[plot]``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise MissingExtra("matplotlib", "plot", purpose) from exc
    return plt


def rolling_mean(values: Sequence[float] | np.ndarray, window: int) -> np.ndarray:
    """The mean of the last ``window`` values at each point (fewer at the start); NaNs are
    left out of each mean, and a window of only NaNs gives NaN."""
    ys = np.asarray(values, dtype=np.float64)
    if window <= 1 or len(ys) == 0:
        return ys
    valid = ~np.isnan(ys)
    sums = np.cumsum(np.where(valid, ys, 0.0))
    counts = np.cumsum(valid)
    sums[window:] = sums[window:] - sums[:-window]
    counts[window:] = counts[window:] - counts[:-window]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)


def _window(num_steps: int) -> int:
    return max(1, min(250, num_steps // 40))


def _style(i: int) -> dict[str, Any]:
    return {"color": COLORS[i % len(COLORS)], "linestyle": LINESTYLES[i % len(LINESTYLES)]}


# -- the report ----------------------------------------------------------------------------
class _Drawn:
    """One series with what the report draws of it, computed once."""

    def __init__(
        self, s: Series, config: CacheConfigured | None, cost: CostModel | None, i: int
    ) -> None:
        self.label, self.style, self.series = s.label, _style(i), s
        paged = config is not None and config.page_size_bytes > 0
        self.swap = [
            float(v) for v in (s.swap_bytes(config) if paged and config else s.num_swapped)
        ]
        self.swap_unit = "bytes" if paged else "blocks"
        self.transfer = [float(v) for v in s.transfer_bytes]
        self.ms: list[float] | None = None
        if paged and config is not None:
            from kvlog.analysis.cost import CostModel

            self.ms = s.modeled_ms(config, cost or CostModel())

    def summary(self) -> list[str]:
        s = self.series
        mean_top = float(np.mean(s.max_used)) if len(s) else 0.0
        defrag = sum(self.swap)
        moved = format_bytes(defrag) if self.swap_unit == "bytes" else f"{defrag:,.0f} blocks"
        row = [self.label]
        if self.ms is not None:
            row += [f"{np.mean(self.ms) if self.ms else 0.0:.3f}", f"{p99(self.ms):.3f}"]
        return [*row, f"{mean_top:,.1f}", moved, format_bytes(sum(self.transfer))]


def write_report_figure(
    path: str,
    series: Sequence[Series],
    title: str,
    config: CacheConfigured | None = None,
    cost: CostModel | None = None,
) -> None:
    """The report of the module docstring, as PNG or SVG (by ``path``)."""
    plt = plt_module("a report picture")
    if not any(len(s) for s in series):
        _write_empty_figure(plt, path, title)
        return
    runs = [_Drawn(s, config, cost, i) for i, s in enumerate(series)]
    xs = np.asarray(series[0].step, dtype=np.float64)
    window = _window(len(xs))
    panels = [_blocks_panel, _fragmentation_panel, _moved_panel]
    if any(any(r.transfer) for r in runs):
        panels.append(_transfer_panel)
    if runs[0].ms is not None:
        panels.append(_ms_panel)
    heights = [0.5 + 0.28 * len(runs)] + [2.2] * len(panels)
    fig, axes = plt.subplots(
        len(panels) + 1, 1, figsize=(11, sum(heights) + 0.8), height_ratios=heights
    )
    _summary_table(axes[0], runs)
    for ax, panel in zip(axes[1:], panels, strict=True):
        _step_axis(ax)
        panel(ax, runs, xs, window, config)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    for ax in axes[2:]:
        ax.sharex(axes[1])
    axes[-1].set_xlabel("scheduler step")
    fig.suptitle(title, fontsize=12)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def _write_empty_figure(plt: Any, path: str, title: str) -> None:
    """A log with no scheduler step (a header, a configuration): one picture that says so,
    instead of empty panels whose legends matplotlib warns about."""
    fig, ax = plt.subplots(figsize=(11, 2.0))
    ax.axis("off")
    text = "the log holds no scheduler step: nothing to draw"
    ax.text(0.5, 0.5, text, ha="center", va="center", fontsize=12, transform=ax.transAxes)
    fig.suptitle(title, fontsize=12)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def _summary_table(ax: Any, runs: Sequence[_Drawn]) -> None:
    ax.axis("off")
    header = ["policy"]
    if runs[0].ms is not None:
        header += ["mean ms/step\n(modeled)", "p99 ms/step\n(modeled)"]
    header += ["mean highest\nused id", "moved by\ndefrag", "stored +\nloaded"]
    widths = [0.28] + [0.144] * (len(header) - 1)
    table = ax.table(
        cellText=[r.summary() for r in runs],
        colLabels=header,
        colWidths=widths,
        loc="center",
        cellLoc="right",
    )
    table.auto_set_font_size(False)
    table.set_fontsize(9)
    table.scale(1.0, 1.3)
    for j in range(len(header)):
        table[0, j].set_height(table[0, j].get_height() * 1.8)
    for i, run in enumerate(runs, start=1):
        cell = table[i, 0]
        cell.get_text().set_color(run.style["color"])
        cell.get_text().set_fontweight("bold")
        cell.set_text_props(ha="left")
    for j in range(len(header)):
        table[0, j].set_text_props(fontweight="bold")
        table[0, j].set_facecolor("0.92")


def _step_axis(ax: Any) -> None:
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(nbins=10, integer=True))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    ax.yaxis.set_major_locator(MaxNLocator(nbins=5))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.4g}"))
    ax.grid(True, alpha=0.3)


MAX_FAINT_STEPS = 2_000
"""Above this many steps a per-step series is not drawn step by step (at a picture's width
its faint line fills the panel as a solid wall): a band of its spread is drawn instead."""
SPREAD_BINS = 400


def _spread_bin(num_steps: int) -> int:
    """Steps per bin of the spread band (1: each step drawn)."""
    return 1 if num_steps <= MAX_FAINT_STEPS else -(-num_steps // SPREAD_BINS)


def _spread_words(num_steps: int) -> str:
    """How a panel's title names its faint part."""
    size = _spread_bin(num_steps)
    if size == 1:
        return "per step faint"
    return f"band: 10th to 90th percentile of each {size:,} steps"


def _faint_and_mean(ax: Any, xs: np.ndarray, ys: Sequence[float], run: _Drawn, window: int,
                    label: str, scale: float = 1.0) -> None:  # fmt: skip
    values = np.asarray(ys, dtype=np.float64) / scale
    size = _spread_bin(len(values))
    if size > 1:
        usable = len(values) // size * size
        binned = values[:usable].reshape(-1, size)
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a bin of only NaNs
            low, high = np.nanpercentile(binned, [10, 90], axis=1)
        centers = xs[:usable].reshape(-1, size).mean(axis=1)
        ax.fill_between(centers, low, high, color=run.style["color"], alpha=0.15, linewidth=0)
    elif window > 1:
        ax.plot(xs, values, color=run.style["color"], linewidth=0.5, alpha=0.18)
    ax.plot(xs, rolling_mean(values, window), label=label, linewidth=1.6, **run.style)


def _blocks_panel(ax: Any, runs: Sequence[_Drawn], xs: np.ndarray, window: int,
                  config: Any) -> None:  # fmt: skip
    if runs:
        used = np.asarray(runs[0].series.num_used, dtype=np.float64)
        ax.fill_between(xs, used, color="0.8", linewidth=0, label="used blocks (any policy)")
    for run in runs:
        _faint_and_mean(ax, xs, run.series.max_used, run, window, f"{run.label}")
    ax.set_ylabel("block id")
    ax.set_title(
        f"highest used block id per policy (rolling mean over {window} steps, "
        f"{_spread_words(len(xs))}); grey: blocks in use",
        fontsize=10,
        loc="left",
    )


def _fragmentation_panel(ax: Any, runs: Sequence[_Drawn], xs: np.ndarray, window: int,
                         config: Any) -> None:  # fmt: skip
    pool = config.num_gpu_blocks if config is not None else 0
    floor = max(MIN_FRAGMENTATION_IDS, pool // 20)
    for run in runs:
        top = np.asarray(run.series.max_used, dtype=np.float64)
        used = np.asarray(run.series.num_used, dtype=np.float64)
        with np.errstate(invalid="ignore", divide="ignore"):
            frag = np.where(top + 1 >= floor, 100.0 * (1.0 - used / (top + 1)), np.nan)
        ax.plot(xs, rolling_mean(frag, window), label=run.label, linewidth=1.6, **run.style)
    ax.set_ylabel("% of ids")
    ax.set_title(
        f"fragmentation: holes below the highest used id (rolling mean; blank where fewer "
        f"than {floor:,} ids are in use)",
        fontsize=10,
        loc="left",
    )


def _cumulative(ax: Any, runs: Sequence[_Drawn], xs: np.ndarray, values: list[list[float]],
                unit_kind: str, what: str) -> None:  # fmt: skip
    largest = max((sum(v) for v in values), default=0.0)
    name, size = byte_unit(largest) if unit_kind == "bytes" else ("blocks", 1)
    for run, v in zip(runs, values, strict=True):
        total = sum(v)
        shown = format_bytes(total) if unit_kind == "bytes" else f"{total:,.0f} blocks"
        ax.plot(xs, np.cumsum(v) / size, label=f"{run.label}: {shown}", linewidth=1.6, **run.style)
    ax.set_ylabel(name)
    ax.set_title(f"{what}, cumulative (total in the legend)", fontsize=10, loc="left")


def _moved_panel(ax: Any, runs: Sequence[_Drawn], xs: np.ndarray, window: int,
                 config: Any) -> None:  # fmt: skip
    kind = runs[0].swap_unit if runs else "bytes"
    _cumulative(ax, runs, xs, [r.swap for r in runs], kind, "moved by defrag")


def _transfer_panel(ax: Any, runs: Sequence[_Drawn], xs: np.ndarray, window: int,
                    config: Any) -> None:  # fmt: skip
    if all(r.transfer == runs[0].transfer for r in runs):
        every = _Drawn.__new__(_Drawn)
        every.label, every.style = "every policy", {"color": "0.3", "linestyle": "-"}
        _cumulative(ax, [every], xs, [runs[0].transfer], "bytes", "stored + loaded")
    else:
        _cumulative(ax, runs, xs, [r.transfer for r in runs], "bytes", "stored + loaded")


def _ms_panel(ax: Any, runs: Sequence[_Drawn], xs: np.ndarray, window: int,
              config: Any) -> None:  # fmt: skip
    top = 0.0
    for run in runs:
        assert run.ms is not None, "a modeled-time panel without modeled times"
        _faint_and_mean(ax, xs, run.ms, run, window, run.label)
        top = max(top, p99(run.ms))
    if top > 0:
        ax.set_ylim(top=top * 1.15)
    ax.set_ylabel("ms")
    ax.set_title(
        f"modeled step time (rolling mean over {window} steps, {_spread_words(len(xs))}; "
        "axis cut at the highest p99)",
        fontsize=10,
        loc="left",
    )


# -- the sweep -----------------------------------------------------------------------------
def _reason(rejected: str) -> str:
    """A refusal short enough for a bar's place: what was refused, not where."""
    return rejected.rsplit("rejected: ", 1)[-1][:60]


def _family(policy: str) -> str:
    return policy.split(" ")[0]


def write_sweep_figure(path: str, rows: Sequence[SweepRow], title: str = "kvlog sweep") -> None:
    """The sweep picture of the module docstring: a row of panels per log."""
    plt = plt_module("the sweep picture")
    logs = list(dict.fromkeys(r.log for r in rows)) or [""]
    per_log = max((sum(1 for r in rows if r.log == log) for log in logs), default=1)
    height = 0.9 + 0.3 * per_log
    fig, axes = plt.subplots(
        len(logs), 3, figsize=(15, height * len(logs) + 0.6), squeeze=False, sharey="row"
    )
    for row_axes, log in zip(axes, logs, strict=True):
        _sweep_row(row_axes, [r for r in rows if r.log == log], log)
    fig.suptitle(
        f"{title}: shorter bars are better (each bar one variant; * the best step time; "
        f"= variants within {TIE_SHARE:.0%} of the best: a tie)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


TIE_SHARE = 0.01
"""Variants whose modeled step time is within this share of the best one's tie with it:
the cost model is not that exact (the sweep picture marks them all, not one "best")."""


def _tied(ok: Sequence[SweepRow], best: SweepRow | None) -> set[int]:
    """The ids of the rows that tie with the best (itself among them); empty where the best
    wins alone."""
    if best is None:
        return set()
    limit = best.modeled_ms_per_step * (1 + TIE_SHARE)
    close = {id(r) for r in ok if r.modeled_ms_per_step <= limit}
    return close if len(close) > 1 else set()


def _sweep_row(axes: Any, rows: list[SweepRow], log: str) -> None:
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    ys = np.arange(len(rows))
    colors = [FAMILY_COLORS.get(_family(r.policy), "tab:red") for r in rows]
    ok = [r for r in rows if not r.rejected]
    best = min(ok, key=lambda r: r.modeled_ms_per_step) if ok else None
    tied = _tied(ok, best)
    unit, size = byte_unit(max((r.swap_bytes for r in ok), default=0))
    columns: tuple[tuple[str, str, float], ...] = (
        ("modeled ms/step (mean; p99 after it)", "modeled_ms_per_step", 1.0),
        (f"moved by defrag ({unit})", "swap_bytes", float(size)),
        ("mean highest used block id", "mean_max_used", 1.0),
    )
    for j, (ax, (name, attr, scale)) in enumerate(zip(axes, columns, strict=True)):
        widths = [0.0 if r.rejected else float(getattr(r, attr)) / scale for r in rows]
        ax.barh(ys, widths, color=colors, edgecolor="black", linewidth=0.4, height=0.7)
        peak = max(widths, default=0.0) or 1.0
        for y, r, w in zip(ys, rows, widths, strict=True):
            if r.rejected:
                if j == 0:
                    ax.text(peak * 0.02, y, f"refused: {_reason(r.rejected)}", va="center",
                            fontsize=7, color="tab:red")  # fmt: skip
                continue
            text = f"{w:,.3f}  (p99 {r.p99_step_ms:,.2f})" if j == 0 else f"{w:,.4g}"
            weight = "bold" if (r is best or id(r) in tied) and j == 0 else "normal"
            ax.text(w + peak * 0.01, y, text, va="center", fontsize=7, fontweight=weight)
        ax.set_xlim(0, peak * (1.45 if j == 0 else 1.2))
        ax.set_title(f"{log}: {name}" if j == 0 else name, fontsize=9, loc="left")
        ax.xaxis.set_major_locator(MaxNLocator(nbins=5))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.4g}"))
        ax.grid(True, axis="x", alpha=0.3)
    marks = {id(r): "= " for r in ok if id(r) in tied}
    if best is not None and not tied:
        marks[id(best)] = "* "
    labels = [marks.get(id(r), "") + r.policy for r in rows]
    axes[0].set_yticks(ys, labels, fontsize=8)
    for tick, r in zip(axes[0].get_yticklabels(), rows, strict=True):
        tick.set_color("tab:red" if r.rejected else "black")
        tick.set_fontweight("bold" if id(r) in marks else "normal")
    axes[0].invert_yaxis()


def write_tier_plot(
    path: str, rows: Sequence[dict[str, object]], curves: Sequence[TierCurve]
) -> None:
    """The tier sweep's picture: hit rate against host memory, one panel per log: each
    log's one-pass LRU and optimum curves, the replayed variants as points, and the largest
    request's size as a line."""
    plt = plt_module("kvlog sweep's sweep.png")
    fig, axes = plt.subplots(1, len(curves), figsize=(6 * len(curves), 4.5), squeeze=False)
    gib = float(1 << 30)
    for ax, curve in zip(axes[0], curves, strict=True):
        sizes = np.arange(1, len(curve.lru_hit_rate)) * curve.chunk_bytes / gib
        ax.plot(sizes, np.array(curve.lru_hit_rate[1:]) * 100, label="LRU (one pass)")
        exact = max(1, curve.largest_batch)
        opt = np.array(curve.opt_hit_rate[exact:]) * 100
        ax.plot(sizes[exact - 1 :], opt, "k--", label="optimum (Belady, one pass)")
        for eviction, marker in (("lru", "o"), ("arc", "s"), ("opt", "^")):
            mine = [r for r in rows if r["log"] == curve.log and r["eviction"] == eviction]
            if mine:
                xs = [int(str(r["cpu_bytes"])) / gib for r in mine]
                ys = [float(str(r["hit_rate"])) * 100 for r in mine]
                ax.scatter(xs, ys, marker=marker, zorder=3, label=f"{eviction} (replayed)")
        if curve.largest_request:
            ax.axvline(
                curve.largest_request * curve.chunk_bytes / gib,
                color="grey",
                linestyle=":",
                label="largest request",
            )
        _hit_rate_axis(ax, curve, rows)
        ax.set_xscale("log")
        ax.set_xlabel("host memory for the CPU tier (GiB)")
        ax.set_ylabel("chunks served from the tier (%)")
        ax.set_title(printable(os.path.basename(curve.log)))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _hit_rate_axis(ax: Any, curve: TierCurve, rows: Sequence[dict[str, object]]) -> None:
    """The hit-rate axis from 0 to at least 1% (a ceiling of 0.2% drawn as small as it
    is); where nothing hits, a word of why instead of an axis around 0."""
    from kvlog.tier.sweep import NO_REASK

    mine = [float(str(r["hit_rate"])) for r in rows if r["log"] == curve.log]
    highest = 100 * max([*curve.lru_hit_rate, *curve.opt_hit_rate, *mine, 0.0])
    ax.set_ylim(0.0, max(1.0, highest * 1.15))
    if highest == 0.0:
        why = NO_REASK if curve.reasked == 0 else "no hit at any capacity tried"
        ax.text(0.5, 0.5, why, ha="center", va="center", fontsize=9, transform=ax.transAxes)

"""Per-step series of a replay and their pictures (matplotlib, PNG or SVG) or numbers (CSV).

``write_report(path, series, title, config=..., cost=...)`` writes what the file name asks
for: ``.csv`` the raw numbers, ``.png`` or ``.svg`` a figure of stacked panels sharing the
step axis: fragmentation (%), the highest used block id and the used blocks, the bytes
defrag moved per step, the bytes stored and loaded per step and, with a ``config`` that has
a page size, the modeled step time (:mod:`kvlog.cost`). Byte axes are in MiB or GiB, the
time axis in ms, ticks are thousands-separated, legends sit outside the data on the right.
matplotlib is an optional extra (``kvlog[plot]``); without it a picture raises
:class:`kvlog.errors.MissingExtra` naming the extra. :func:`byte_unit` and
:func:`plt_module` serve the sweep plot too.
"""

from __future__ import annotations

import csv
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvlog.cost import CostModel
from kvlog.errors import ConfigError, MissingExtra
from kvlog.events import CacheConfigured

__all__ = [
    "PICTURE_FORMATS",
    "Series",
    "byte_unit",
    "plt_module",
    "report_path",
    "write_report",
]

PICTURE_FORMATS = (".png", ".svg")
_MAX_POINTS = 1500
USED_LABEL = "used blocks (any policy)"
_UNITS = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


@dataclass
class Series:
    """What one run of the reducers did, step by step (one entry per ``StepEnded``)."""

    label: str = "recorded"
    step: list[int] = field(default_factory=list)
    num_used: list[int] = field(default_factory=list)
    max_used: list[int] = field(default_factory=list)
    num_swapped: list[int] = field(default_factory=list)
    store_bytes: list[int] = field(default_factory=list)
    load_bytes: list[int] = field(default_factory=list)

    def add(
        self, step: int, num_used: int, max_used: int, swapped: int, store: int, load: int
    ) -> None:
        self.step.append(step)
        self.num_used.append(num_used)
        self.max_used.append(max_used)
        self.num_swapped.append(swapped)
        self.store_bytes.append(store)
        self.load_bytes.append(load)

    @property
    def fragmentation(self) -> list[float]:
        """Share of the ids up to the highest used one that are holes (0 = compact)."""
        return [
            1.0 - used / (top + 1) if top >= 0 else 0.0
            for used, top in zip(self.num_used, self.max_used, strict=True)
        ]

    @property
    def transfer_bytes(self) -> list[int]:
        return [a + b for a, b in zip(self.store_bytes, self.load_bytes, strict=True)]

    def swap_bytes(self, config: CacheConfigured) -> list[int]:
        """Bytes defrag moved per step (a ``"swap"`` pair moves two pages)."""
        per_pair = config.page_size_bytes * (2 if config.prefix_caching else 1)
        return [n * per_pair for n in self.num_swapped]

    def modeled_ms(self, config: CacheConfigured, cost: CostModel) -> list[float]:
        """The cost model's step time in ms (defrag counted without pad buckets)."""
        page, swap = config.page_size_bytes, config.prefix_caching
        return [
            1e3
            * (
                cost.decode_s(top, page)
                + cost.defrag_s(n, page, swap)
                + cost.transfer_s(store, load)
            )
            for top, n, store, load in zip(
                self.max_used, self.num_swapped, self.store_bytes, self.load_bytes, strict=True
            )
        ]

    def __len__(self) -> int:
        return len(self.step)


def _downsample(xs: Sequence[int], ys: Sequence[float]) -> tuple[list[float], list[float]]:
    """At most ``_MAX_POINTS`` points, keeping each bucket's maximum (peaks stay visible)."""
    n = len(xs)
    if n <= _MAX_POINTS:
        return [float(x) for x in xs], [float(y) for y in ys]
    width = -(-n // _MAX_POINTS)
    out_x, out_y = [], []
    for i in range(0, n, width):
        out_x.append(float(xs[i]))
        out_y.append(float(max(ys[i : i + width])))
    return out_x, out_y


def byte_unit(largest: float) -> tuple[str, int]:
    """The unit (name, bytes) that keeps ``largest`` readable: MiB up to GiB, and so on."""
    for name, size in _UNITS:
        if largest >= size:
            return name, size
    return "B", 1


def plt_module(purpose: str) -> Any:
    """``matplotlib.pyplot`` on the Agg backend, or ``MissingExtra`` naming ``kvlog[plot]``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise MissingExtra("matplotlib", "plot", purpose) from exc
    return plt


Panel = tuple[str, str, list[tuple[str, list[float]]]]
"""(title, y-axis kind: "pct" | "blocks" | "bytes" | "ms", lines)."""


def _panels(
    series: Sequence[Series], config: CacheConfigured | None, cost: CostModel | None
) -> list[Panel]:
    def lines(values: Callable[[Series], Sequence[float]]) -> list[tuple[str, list[float]]]:
        return [(s.label, [float(v) for v in values(s)]) for s in series]

    blocks = [(f"{s.label}: highest used id", [float(v) for v in s.max_used]) for s in series]
    if series:  # the same events use the same blocks under every policy: draw them once
        blocks.append((USED_LABEL, [float(v) for v in series[0].num_used]))
    panels: list[Panel] = [
        ("fragmentation: holes below the highest used block", "pct",
         lines(lambda s: [100.0 * f for f in s.fragmentation])),
        ("blocks", "blocks", blocks),
    ]  # fmt: skip
    if config is not None and config.page_size_bytes > 0:
        paged = config
        panels.append(("moved by defrag per step", "bytes", lines(lambda s: s.swap_bytes(paged))))
        _transfers(panels, series)
        model = cost or CostModel()
        modeled = lines(lambda s: s.modeled_ms(paged, model))
        panels.append((f"modeled step time ({model.describe()})", "ms", modeled))
    else:
        panels.append(("blocks moved by defrag per step", "blocks", lines(lambda s: s.num_swapped)))
        _transfers(panels, series)
    return panels


def _transfers(panels: list[Panel], series: Sequence[Series]) -> None:
    """The stored + loaded panel, if anything moved: one line when every run moved the same
    (the events decide transfers; a defrag policy does not)."""
    runs = [[float(v) for v in s.transfer_bytes] for s in series]
    if not any(any(r) for r in runs):
        return
    if all(r == runs[0] for r in runs):
        lines = [("any policy", runs[0])]
    else:
        lines = [(s.label, r) for s, r in zip(series, runs, strict=True)]
    panels.append(("stored + loaded per step", "bytes", lines))


def _axis(ax: Any, kind: str, lines: list[tuple[str, list[float]]]) -> Callable[[float], float]:
    """Label the y axis for ``kind``; returns the scale that maps values to axis units."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(nbins=10, integer=True))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    ax.yaxis.set_major_locator(MaxNLocator(nbins=5))
    ax.grid(True, alpha=0.3)
    if kind == "bytes":
        largest = max((max(ys) for _, ys in lines if ys), default=0.0)
        name, size = byte_unit(largest)
        ax.set_ylabel(name)
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.4g}"))
        return lambda v: v / size
    labels = {"pct": "% of ids", "blocks": "blocks", "ms": "ms"}
    ax.set_ylabel(labels[kind])
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.4g}"))
    return lambda v: v


def write_figure(
    path: str,
    series: Sequence[Series],
    title: str,
    config: CacheConfigured | None = None,
    cost: CostModel | None = None,
) -> None:
    """The stacked panels of the module docstring, as PNG or SVG (by ``path``)."""
    plt = plt_module("a report picture")
    panels = _panels(series, config, cost)
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 2.3 * len(panels)), sharex=True)
    xs = series[0].step if series else []
    for ax, (name, kind, lines) in zip(axes, panels, strict=True):
        scale = _axis(ax, kind, lines)
        for label, ys in lines:
            px, py = _downsample(xs, ys)
            style = {"color": "0.55", "linestyle": "--"} if label == USED_LABEL else {}
            ax.plot(px, [scale(y) for y in py], label=label, linewidth=0.9, **style)
        ax.set_ylim(bottom=0)
        ax.set_title(name, fontsize=10, loc="left")
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    axes[-1].set_xlabel("scheduler step")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def write_csv(path: str, series: Sequence[Series]) -> None:
    """One row per (series, step)."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(
            [
                "series",
                "step",
                "num_used",
                "max_used",
                "fragmentation",
                "num_swapped",
                "store_bytes",
                "load_bytes",
            ]
        )
        for s in series:
            frag = s.fragmentation
            for i in range(len(s)):
                w.writerow(
                    [
                        s.label,
                        s.step[i],
                        s.num_used[i],
                        s.max_used[i],
                        f"{frag[i]:.6f}",
                        s.num_swapped[i],
                        s.store_bytes[i],
                        s.load_bytes[i],
                    ]
                )


def report_path(path: str, *, flag: str = "--report", log: str | None = None) -> str:
    """The file :func:`write_report` would write for ``path``, checked before any work:
    ``.csv``, ``.png`` or ``.svg`` (no extension: ``.png`` appended), matplotlib present for
    a picture, a directory that exists and is writable, not a directory itself, and not
    the ``log`` being read. Raises :class:`~kvlog.errors.ConfigError` naming ``flag``, or
    :class:`~kvlog.errors.MissingExtra`."""
    if os.path.isdir(path) or path.endswith(os.sep):
        raise ConfigError(flag, path, "a file name, not a directory")
    ext = os.path.splitext(path)[1].lower()
    if ext == "":
        path += ".png"
    elif ext not in (".csv", *PICTURE_FORMATS):
        raise ConfigError(flag, path, "a .csv, .png or .svg file name")
    if not path.lower().endswith(".csv"):
        plt_module("a report picture")
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not os.path.isdir(directory):
        raise ConfigError(flag, path, "a file in an existing directory")
    if not _writable(path, directory):
        raise ConfigError(flag, path, "a file this user may write (on a writable filesystem)")
    if log is not None and os.path.exists(path) and os.path.samefile(path, log):
        raise ConfigError(flag, path, f"a file other than the log {log} it reports on")
    return path


def _writable(path: str, directory: str) -> bool:
    """Whether ``path`` can be written: opened for update if it exists (nothing changes),
    else a temporary file created and removed beside it (read-only filesystems, /proc,
    permissions: what ``os.access`` misses for root)."""
    try:
        if os.path.exists(path):
            with open(path, "r+b"):
                return True
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".kvlog-probe-"):
            return True
    except OSError:
        return False


def write_report(
    path: str,
    series: Sequence[Series],
    title: str = "kvlog replay",
    *,
    config: CacheConfigured | None = None,
    cost: CostModel | None = None,
) -> str:
    """Write the report in the format the file name asks for; returns what was written.

    ``.csv``: numbers; ``.png`` / ``.svg``: the figure (needs ``kvlog[plot]``); a name
    without an extension gets ``.png`` appended; any other extension is refused
    (:func:`report_path`).
    """
    path = report_path(path)
    if path.lower().endswith(".csv"):
        write_csv(path, series)
        return f"wrote CSV {path}"
    write_figure(path, series, title, config, cost)
    return f"wrote {os.path.splitext(path)[1][1:].upper()} {path}"

"""Per-step series of a replay and their plot (SVG written by hand, CSV, or PNG).

The SVG writer has no dependency, so ``kvlog replay --report out.svg`` always works; a
``.png`` report uses matplotlib (the optional ``plot`` extra) when it is installed and says
so otherwise; a ``.csv`` report writes the raw numbers.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from xml.sax.saxutils import escape

__all__ = ["Series", "write_report"]

_MAX_POINTS = 1500
_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd")


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


def _panels(series: Sequence[Series]) -> list[tuple[str, list[tuple[str, list[float]]]]]:
    panels: list[tuple[str, list[tuple[str, list[float]]]]] = []
    panels.append(("fragmentation", [(s.label, list(s.fragmentation)) for s in series]))
    used: list[tuple[str, list[float]]] = []
    for s in series:
        used.append((f"{s.label}: highest used id", [float(v) for v in s.max_used]))
        used.append((f"{s.label}: used blocks", [float(v) for v in s.num_used]))
    panels.append(("blocks", used))
    panels.append(
        ("swapped blocks per step", [(s.label, [float(v) for v in s.num_swapped]) for s in series])
    )
    panels.append(
        (
            "transfer bytes per step",
            [(s.label, [float(v) for v in s.transfer_bytes]) for s in series],
        )
    )
    return panels


def _svg_panel(
    out: list[str], top: float, title: str, xs: list[int], lines: list[tuple[str, list[float]]]
) -> None:
    left, width, height = 70.0, 760.0, 150.0
    out.append(f'<text x="{left}" y="{top - 6:.1f}" font-size="13">{escape(title)}</text>')
    out.append(
        f'<rect x="{left}" y="{top}" width="{width}" height="{height}" fill="none" stroke="#888"/>'
    )
    if not xs:
        return
    x0, x1 = xs[0], max(xs[-1], xs[0] + 1)
    y_max = max((max(ys) for _, ys in lines if ys), default=0.0) or 1.0
    out.append(
        f'<text x="{left - 4}" y="{top + 10}" font-size="10" text-anchor="end">{y_max:.4g}</text>'
    )
    out.append(f'<text x="{left - 4}" y="{top + height}" font-size="10" text-anchor="end">0</text>')
    out.append(f'<text x="{left}" y="{top + height + 12}" font-size="10">step {x0}</text>')
    end_x = left + width
    out.append(
        f'<text x="{end_x}" y="{top + height + 12}" font-size="10" text-anchor="end">{x1}</text>'
    )
    for i, (label, ys) in enumerate(lines):
        px, py = _downsample(xs, ys)
        pts = " ".join(
            f"{left + (x - x0) / (x1 - x0) * width:.1f},{top + height - y / y_max * height:.1f}"
            for x, y in zip(px, py, strict=True)
        )
        color = _COLORS[i % len(_COLORS)]
        out.append(f'<polyline fill="none" stroke="{color}" stroke-width="1" points="{pts}"/>')
        ly = top + 14 + 12 * i
        out.append(
            f'<text x="{end_x - 4}" y="{ly}" font-size="10" text-anchor="end" '
            f'fill="{color}">{escape(label)}</text>'
        )


def write_svg(path: str, series: Sequence[Series], title: str) -> None:
    """Four stacked panels: fragmentation, highest used id, swaps, transfer bytes."""
    panels = _panels(series)
    height = 40 + 190 * len(panels)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="860" height="{height}" '
        f'font-family="sans-serif">',
        '<rect width="100%" height="100%" fill="white"/>',
        f'<text x="70" y="20" font-size="15">{escape(title)}</text>',
    ]
    xs = series[0].step if series else []
    for i, (name, lines) in enumerate(panels):
        _svg_panel(out, 50.0 + 190 * i, name, xs, lines)
    out.append("</svg>")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(out) + "\n")


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


def write_png(path: str, series: Sequence[Series], title: str) -> None:
    """The same four panels with matplotlib (imported lazily: an optional extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = _panels(series)
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 2.4 * len(panels)), sharex=True)
    xs = series[0].step if series else []
    for ax, (name, lines) in zip(axes, panels, strict=True):
        for label, ys in lines:
            ax.plot(xs, ys, label=label, linewidth=0.8)
        ax.set_title(name, fontsize=10)
        ax.legend(fontsize=7, loc="upper right")
    axes[-1].set_xlabel("step")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(path: str, series: Sequence[Series], title: str = "kvlog replay") -> str:
    """Write the report in the format the file name asks for; returns what was written.

    ``.csv``: numbers; ``.png``: matplotlib if installed, else an SVG next to it (the
    returned message says so); anything else: SVG.
    """
    ext = os.path.splitext(path)[1].lower()
    if ext == ".csv":
        write_csv(path, series)
        return f"wrote CSV {path}"
    if ext == ".png":
        try:
            write_png(path, series, title)
            return f"wrote PNG {path}"
        except ImportError:
            svg = os.path.splitext(path)[0] + ".svg"
            write_svg(svg, series, title)
            return f"matplotlib is not installed (pip install kvlog[plot]); wrote SVG {svg} instead"
    write_svg(path, series, title)
    return f"wrote SVG {path}"

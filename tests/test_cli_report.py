"""The replay report (SVG, CSV, PNG fallback) and the progress bar of ``kvlog replay``."""

from __future__ import annotations

import io
import os
import sys

import pytest

from kvlog.cli import _ProgressBar, format_table
from kvlog.report import Series, _downsample, write_report


def series(label: str, steps: int) -> Series:
    s = Series(label)
    for step in range(steps):
        s.add(
            step,
            num_used=10 + step % 7,
            max_used=30 - step % 5,
            swapped=step % 3,
            store=100 * (step % 2),
            load=50,
        )
    return s


def test_fragmentation_is_the_share_of_holes_below_the_top() -> None:
    s = Series()
    s.add(0, num_used=3, max_used=3, swapped=0, store=0, load=0)  # ids 0..3, 3 used
    s.add(1, num_used=0, max_used=-1, swapped=0, store=0, load=0)
    assert s.fragmentation == [0.25, 0.0]
    assert s.transfer_bytes == [0, 0]


def test_downsampling_keeps_peaks() -> None:
    xs = list(range(10_000))
    ys = [0.0] * 10_000
    ys[4321] = 99.0
    px, py = _downsample(xs, ys)
    assert len(px) <= 1500 and max(py) == 99.0


def test_svg_and_csv(tmp_path: str) -> None:
    svg = os.path.join(tmp_path, "r.svg")
    assert write_report(svg, [series("a", 50), series("b", 50)]) == f"wrote SVG {svg}"
    with open(svg, encoding="utf-8") as f:
        text = f.read()
    assert text.startswith("<svg") and text.rstrip().endswith("</svg>")
    assert text.count("<polyline") == 10  # fragmentation 2, blocks 4, swaps 2, bytes 2
    csv_path = os.path.join(tmp_path, "r.csv")
    write_report(csv_path, [series("a", 5)])
    with open(csv_path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    assert len(lines) == 6 and lines[1].startswith("a,0,10,30,")


def test_png_falls_back_to_svg_without_matplotlib(
    tmp_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    png = os.path.join(tmp_path, "r.png")
    message = write_report(png, [series("a", 20)])
    assert "matplotlib is not installed" in message
    assert os.path.exists(os.path.join(tmp_path, "r.svg")) and not os.path.exists(png)


def test_progress_bar_draws_one_line() -> None:
    out = io.StringIO()
    bar = _ProgressBar(total_bytes=1000, stream=out)
    bar(4096, 500)
    assert out.getvalue().startswith("\rreplay [###############---------------]  50% 4,096 records")
    bar.close()
    assert out.getvalue().endswith("\r")


def test_format_table_aligns_columns() -> None:
    text = format_table([("", "a", "bb"), ("swaps", "1", "1,000")])
    assert text.splitlines() == ["         a     bb", "  swaps  1  1,000"]

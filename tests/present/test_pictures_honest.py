"""Pictures that do not mislead (issue 34 item 15): a long replay's per-step series is not
drawn as a solid wall, the tier's hit-rate axis starts at 0 (never below it, also where
nothing hits), and a sweep whose best variant wins by a hair says they tie."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvlog.analysis.grid import SweepRow
from kvlog.events import CacheConfigured
from kvlog.present.pictures import write_report_figure, write_sweep_figure, write_tier_plot
from kvlog.present.report import Series
from kvlog.tier.sweep import TierCurve

pytest.importorskip("matplotlib")


@pytest.fixture
def figures(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every figure saved while the test runs (as drawn, before it is closed)."""
    from matplotlib.figure import Figure

    saved: list[Any] = []
    save = Figure.savefig

    def keep(self: Figure, *args: Any, **kwargs: Any) -> None:
        saved.append(self)
        save(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    return saved


def _long_series(num_steps: int) -> Series:
    rng = np.random.default_rng(0)
    s = Series()
    for step in range(num_steps):
        swapped = int(rng.integers(0, 64)) if rng.random() < 0.4 else 0
        s.add(step, 600, 700 + int(rng.integers(0, 300)), swapped, 0, 0)
    return s


def test_a_long_replay_is_not_drawn_step_by_step(tmp_path: Path, figures: list[Any]) -> None:
    config = CacheConfigured(num_gpu_blocks=1024, block_size=16, page_size_bytes=2 << 20)
    write_report_figure(str(tmp_path / "r.png"), [_long_series(20_000)], "long", config)
    (fig,) = figures
    faint = [
        line
        for ax in fig.axes
        for line in ax.get_lines()
        if (line.get_alpha() or 1.0) < 0.5 and len(line.get_xdata()) > 2_000
    ]
    assert faint == []  # a faint line per step over 20,000 steps is a wall
    titles = " ".join(ax.get_title(loc="left") for ax in fig.axes)
    assert "percentile" in titles  # the band says what it is


def test_a_short_replay_keeps_its_per_step_series(tmp_path: Path, figures: list[Any]) -> None:
    config = CacheConfigured(num_gpu_blocks=1024, block_size=16, page_size_bytes=2 << 20)
    write_report_figure(str(tmp_path / "r.png"), [_long_series(800)], "short", config)
    (fig,) = figures
    faint = [ln for ax in fig.axes for ln in ax.get_lines() if (ln.get_alpha() or 1.0) < 0.5]
    assert faint and all(len(line.get_xdata()) == 800 for line in faint)


def _tier_rows(log: str, rate: float) -> list[dict[str, object]]:
    return [
        {"log": log, "eviction": e, "cpu_bytes": size << 30, "hit_rate": rate}
        for e in ("lru", "opt")
        for size in (4, 16)
    ]


@pytest.mark.parametrize("rate", [0.0, 0.00225])
def test_the_tier_axis_starts_at_zero(tmp_path: Path, figures: list[Any], rate: float) -> None:
    chunk = 64 << 20
    curve = list(np.linspace(rate / 5, rate, 300))
    reasked = 0 if rate == 0 else 10  # asks of a chunk asked before
    curves = [TierCurve("t.csv", chunk, [0.0, *curve], [0.0, *curve], 3, 3, reasked)]
    write_tier_plot(str(tmp_path / "s.png"), _tier_rows("t.csv", rate), curves)
    (fig,) = figures
    bottom, top = fig.axes[0].get_ylim()
    assert bottom == 0.0
    assert top >= 1.0  # percent: a ceiling of 0.2% is drawn as small as it is
    if rate == 0:
        said = " ".join(t.get_text() for t in fig.axes[0].texts)
        assert "no chunk is asked for twice" in said


def _row(policy: str, ms: float) -> SweepRow:
    return SweepRow(log="a", policy=policy, steps=100, modeled_ms_per_step=ms, p99_step_ms=ms)


def test_a_sweep_best_by_a_hair_is_called_a_tie(tmp_path: Path, figures: list[Any]) -> None:
    rows = [_row("seed t=8", 0.6375), _row("seed t=16", 0.6370), _row("tail r=1.5", 0.684)]
    write_sweep_figure(str(tmp_path / "w.png"), rows)
    (fig,) = figures
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert labels[0].startswith("=") and labels[1].startswith("=")
    assert not labels[2].startswith(("=", "*"))
    assert "tie" in fig._suptitle.get_text()


def test_a_sweep_best_by_a_margin_is_marked_alone(tmp_path: Path, figures: list[Any]) -> None:
    rows = [_row("seed t=8", 0.70), _row("seed t=16", 0.60), _row("tail r=1.5", 0.684)]
    write_sweep_figure(str(tmp_path / "w.png"), rows)
    (fig,) = figures
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert [label.startswith("* ") for label in labels] == [False, True, False]

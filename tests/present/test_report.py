"""Reports people read: the replay figure (matplotlib, PNG and SVG) with units, the CSV, the
cost model, the rich tables and progress bar of the command line."""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path

import pytest

from kvlog.analysis.cost import (
    GAUDI2_HBM_BYTES_PER_S,
    GAUDI3_HBM_BYTES_PER_S,
    PCIE_GEN5_X16_BYTES_PER_S,
    CostModel,
    cost_model,
)
from kvlog.analysis.tally import Series
from kvlog.cli import main as cli_main
from kvlog.cli.flags import size_arg
from kvlog.errors import ConfigError, MissingExtra
from kvlog.events import CacheConfigured
from kvlog.present.pictures import rolling_mean
from kvlog.present.report import write_report
from kvlog.present.text import progress_bar, render_table
from kvlog.util.units import byte_unit, format_bytes, p99, parse_size, plural

CONFIG = CacheConfigured(num_gpu_blocks=64, block_size=16, page_size_bytes=2 << 20)


def series(label: str, steps: int) -> Series:
    s = Series(label)
    for step in range(steps):
        s.add(
            step,
            num_used=10 + step % 7,
            max_used=30 - step % 5,
            swapped=step % 3,
            store=100 << 20 if step % 2 else 0,
            load=50 << 20,
        )
    return s


def test_fragmentation_is_the_share_of_holes_below_the_top() -> None:
    s = Series()
    s.add(0, num_used=3, max_used=3, swapped=0, store=0, load=0)  # ids 0..3, 3 used
    s.add(1, num_used=0, max_used=-1, swapped=0, store=0, load=0)
    assert s.fragmentation == [0.25, 0.0]
    assert s.transfer_bytes == [0, 0]


def test_rolling_mean_averages_the_last_window_and_skips_gaps() -> None:
    assert rolling_mean([1.0, 3.0, 5.0, 7.0], 2).tolist() == [1.0, 2.0, 4.0, 6.0]
    gappy = rolling_mean([float("nan"), 2.0, float("nan"), float("nan")], 2)
    assert gappy[1] == 2.0 and gappy[2] == 2.0 and gappy[3] != gappy[3]  # NaN: nothing to average
    assert rolling_mean([4.0, 8.0], 1).tolist() == [4.0, 8.0]


def test_byte_units_keep_numbers_readable() -> None:
    assert byte_unit(3 << 30) == ("GiB", 1 << 30)
    assert byte_unit(5 << 20) == ("MiB", 1 << 20)
    assert byte_unit(100) == ("B", 1)
    assert format_bytes(3 << 30) == "3.0 GiB" and format_bytes(0) == "0 B"
    assert parse_size("64MiB") == 64 << 20 and parse_size("1.5k") == 1536
    with pytest.raises(ValueError, match="not a size"):
        parse_size("2PiB")


def test_plurals_and_p99() -> None:
    assert plural(1, "log") == "1 log" and plural(2, "policy", "policies") == "2 policies"
    assert plural(1500, "step") == "1,500 steps"
    assert p99([]) == 0.0 and p99(list(range(1, 101))) == 100.0  # a value of the series
    assert p99([5.0] * 10 + [9.0]) == 9.0


def test_png_and_svg_figures(tmp_path: str) -> None:
    data = [series("recorded", 3000), series("what-if", 3000)]
    png = os.path.join(tmp_path, "r.png")
    assert write_report(png, data, config=CONFIG) == f"wrote PNG {png}"
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    svg = os.path.join(tmp_path, "r.svg")
    assert write_report(svg, data, "t", config=CONFIG) == f"wrote SVG {svg}"
    with open(svg, encoding="utf-8") as f:
        text = f.read()
    assert "<svg" in text and text.rstrip().endswith("</svg>")
    for words in (
        "scheduler step",
        "GiB",
        "ms/step",
        "what-if",
        "used blocks",
        "p99",
        "cumulative",
        "rolling mean",
        "every policy",
    ):
        assert words in text, words  # axes carry units; legends and the table name every run
    other = os.path.join(tmp_path, "report")
    assert write_report(other, data) == f"wrote PNG {other}.png"


def test_csv_holds_the_numbers(tmp_path: str) -> None:
    csv_path = os.path.join(tmp_path, "r.csv")
    write_report(csv_path, [series("a", 5)])
    with open(csv_path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    assert len(lines) == 6 and lines[1].startswith("a,0,10,30,")


def test_pictures_without_matplotlib_name_the_extra(
    tmp_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    with pytest.raises(MissingExtra, match=r"pip install 'kvlog\[plot\]'"):
        write_report(os.path.join(tmp_path, "r.png"), [series("a", 20)])
    assert not os.listdir(tmp_path)


def test_cost_model_constants_and_formulas() -> None:
    assert GAUDI2_HBM_BYTES_PER_S == 2.46e12 and GAUDI3_HBM_BYTES_PER_S == 3.67e12
    assert PCIE_GEN5_X16_BYTES_PER_S == 63e9
    model = CostModel()
    page = 16 << 20
    assert model.decode_s(99, page) == pytest.approx(100 * page / 2.46e12)
    assert model.defrag_s(8, page, swap=True) == pytest.approx(2 * model.defrag_s(8, page, False))
    assert model.transfer_s(63 * 10**9, 10) == pytest.approx(1.0)
    faster = cost_model("gaudi3", link_gb_per_s=126)
    assert faster.hbm_bytes_per_s == 3.67e12 and faster.link_bytes_per_s == 126e9
    with pytest.raises(ConfigError):
        cost_model("tpu")
    with pytest.raises(ConfigError):
        cost_model(hbm_tb_per_s=0)
    series_ms = series("a", 4).modeled_ms(CONFIG, model)
    assert len(series_ms) == 4 and all(ms > 0 for ms in series_ms)


def test_tables_align_labels_left_and_figures_right() -> None:
    text = render_table([("swaps", "1"), ("bytes moved", "1,000")])
    assert text.splitlines() == ["  swaps            1", "  bytes moved  1,000"]
    table = render_table([("log", "policy", "moved"), ("m", "seed t=8", "1.5 GiB")], header=True)
    lines = table.splitlines()
    assert "log" in lines[0] and "moved" in lines[0] and set(lines[1].strip()) == {"─"}
    assert lines[2].rstrip().endswith("1.5 GiB")


def test_progress_bar_reports_and_sizes_parse() -> None:
    out = io.StringIO()
    with progress_bar("what-ifs", out) as update:
        update(1, 4)
        update(4, 4)
    assert size_arg("64MiB") == 64 << 20 and size_arg("1G") == 1 << 30 and size_arg("512") == 512
    with pytest.raises(Exception, match="not a size"):
        size_arg("lots")


def test_the_sweep_shows_every_variant_and_names_the_refused(tmp_path: str) -> None:
    from kvlog.analysis.grid import SweepRow
    from kvlog.present.pictures import write_sweep_figure
    from kvlog.present.text import SWEEP_COLUMNS, sweep_table

    rows = [
        SweepRow("m", "seed t=8", steps=10, mean_max_used=40.0, swap_bytes=3 << 30,
                 store_bytes=1 << 30, modeled_ms_per_step=1.5, p99_step_ms=2.0),
        SweepRow("m", "seed t=8 m=1024", rejected="seq 0: CacheConfigured rejected: max_swaps"),
        SweepRow("m", "off", steps=10, mean_max_used=60.0, modeled_ms_per_step=2.5),
    ]  # fmt: skip
    table = sweep_table(rows)
    assert table[0] == SWEEP_COLUMNS and "defrag bytes" in SWEEP_COLUMNS
    assert table[1][5:7] == ("3.0 GiB", "1.0 GiB")  # defrag and transfers apart
    assert table[2][2] == "-" and table[2][-1].startswith("refused: ")
    svg = os.path.join(tmp_path, "sweep.svg")
    write_sweep_figure(svg, rows)
    with open(svg, encoding="utf-8") as f:
        text = f.read()
    for words in ("seed t=8 m=1024", "refused: max_swaps", "off", "ms/step", "p99", "GiB"):
        assert words in text, words


@pytest.mark.parametrize("suffix", [".png", ".svg"])
def test_a_header_only_log_reports_without_a_matplotlib_warning(
    suffix: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import warnings

    from kvlog.log import LogWriter

    log = tmp_path / "empty.kvlog"
    LogWriter(log, new=True).close()
    report = tmp_path / f"r{suffix}"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib's "No artists with labels" included
        assert cli_main(["replay", str(log), "--report", str(report)]) == 0
        assert cli_main(["replay", str(log), "--threshold", "4", "--report", str(report)]) == 0
    assert report.stat().st_size > 0
    assert capsys.readouterr().err == ""

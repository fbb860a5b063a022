"""A log whose file name is not UTF-8 (POSIX allows any bytes; Python hands them over as
lone surrogates): every command reads it, and what kvlog writes about it (a figure's
title, a CSV's log column, stdout) names it with escapes where the bytes were, never a
UnicodeEncodeError traceback. pytest's capsys stdout is strict, as a UTF-8 locale's is."""

from __future__ import annotations

import csv
import os
import shutil
from pathlib import Path

import pytest

from kvlog.cli import main
from kvlog.util.units import printable

SMALL = ["--steps", "120", "--num-gpu-blocks", "128", "--sync", "none"]
BAD_NAME = os.fsdecode(b"bad\xff\xfe")  # 'bad\udcff\udcfe'


@pytest.fixture(scope="module")
def bad_log(tmp_path_factory: pytest.TempPathFactory) -> str:
    where = tmp_path_factory.mktemp("names")
    good = str(where / "good.kvlog")
    assert main(["synth", "--out", good, "--num-cpu-blocks", "16", *SMALL]) == 0
    bad = str(where / f"{BAD_NAME}.kvlog")
    shutil.copyfile(good, bad)
    return bad


def test_printable_replaces_undecodable_bytes_and_keeps_the_rest() -> None:
    assert printable(BAD_NAME) == "bad\\xff\\xfe"
    assert printable(os.fsdecode(b"bad\xfe\xff")) != printable(BAD_NAME)  # two names stay two
    assert printable("ok-é.kvlog") == "ok-é.kvlog"
    assert printable("lone\ud800") == "lone\\ud800"  # not from a file name, still encodable


def test_replay_and_synth_print_a_non_utf8_path_on_a_strict_stdout(
    bad_log: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["replay", bad_log]) == 0
    assert "bad\\udcff\\udcfe.kvlog" in capsys.readouterr().out
    out = str(tmp_path / f"{BAD_NAME}.kvlog")
    assert main(["synth", "--out", out, *SMALL]) == 0
    assert "bad\\udcff\\udcfe.kvlog" in capsys.readouterr().out
    assert main(["replay", out]) == 0


@pytest.mark.parametrize("ext", [".png", ".svg"])
def test_replay_report_of_a_non_utf8_log_is_drawn(
    bad_log: str, tmp_path: Path, ext: str, capsys: pytest.CaptureFixture[str]
) -> None:
    report = tmp_path / f"r{ext}"
    assert main(["replay", bad_log, "--report", str(report)]) == 0
    assert report.stat().st_size > 0
    assert "Traceback" not in capsys.readouterr().err


def _read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, encoding="utf-8", newline="") as f:
        return list(csv.DictReader(f))


def test_sweep_of_a_non_utf8_log_writes_its_csv_and_png(bad_log: str, tmp_path: Path) -> None:
    out = tmp_path / "sw"
    assert main(["sweep", bad_log, "--out", str(out), "--serial", "--threshold", "8"]) == 0
    rows = _read_csv(out / "sweep.csv")
    assert {r["log"] for r in rows} == {"bad\\xff\\xfe"}
    assert (out / "sweep.png").stat().st_size > 0


def test_tier_sweep_of_a_non_utf8_log_writes_its_csv_and_png(bad_log: str, tmp_path: Path) -> None:
    out = tmp_path / "tier"
    argv = ["sweep", bad_log, "--out", str(out), "--serial", "--cpu-bytes", "64MiB"]
    assert main([*argv, "--eviction", "lru"]) == 0
    rows = _read_csv(out / "sweep.csv")
    assert [r["log"] for r in rows] == [printable(bad_log)]
    assert (out / "sweep.png").stat().st_size > 0

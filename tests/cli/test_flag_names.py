"""One flag, one name; long runs say how far they are (issue 34 items 11 and 14).

replay's ``--max-bytes-per-step`` is sweep's too (``--budget`` stays as a hidden, deprecated
spelling that says so); the tier table says "store threshold"; ``synth`` draws a progress
bar; a local Ray on two CPUs says that ``--serial`` is likely faster."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from kvlog.cli import build_parser, main

DATA = Path(__file__).resolve().parents[1] / "data"
MOONCAKE = str(DATA / "mooncake_synthetic_trace_3601-3800.jsonl")


@pytest.fixture(scope="module")
def log(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = str(tmp_path_factory.mktemp("names") / "a.kvlog")
    assert main(["synth", "--steps", "150", "--sync", "none", "--out", out]) == 0
    return out


def _help(command: str) -> str:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return str(sub.choices[command].format_help())  # type: ignore[union-attr]


def _budgets(out: Path) -> list[str]:
    with open(out / "sweep.csv", encoding="utf-8") as f:
        return [r["policy"] for r in csv.DictReader(f)]


def test_sweep_takes_max_bytes_per_step_as_replay_does(
    log: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sw"
    argv = ["sweep", log, "--policy", "budget", "--out", str(out), "--serial"]
    assert main([*argv, "--max-bytes-per-step", "4MiB,64MiB"]) == 0
    assert _budgets(out) == ["budget 4MiB t=8", "budget 64MiB t=8"]
    assert capsys.readouterr().err == ""
    assert "--max-bytes-per-step" in _help("sweep") and "--budget" not in _help("sweep")


def test_sweep_budget_is_a_deprecated_spelling_that_says_so(
    log: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sw"
    argv = ["sweep", log, "--policy", "budget", "--out", str(out), "--serial"]
    assert main([*argv, "--budget", "4MiB"]) == 0
    assert _budgets(out) == ["budget 4MiB t=8"]
    err = capsys.readouterr().err
    assert "--budget" in err and "--max-bytes-per-step" in err and "deprecated" in err


def test_the_tier_table_says_store_threshold(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["sweep", MOONCAKE, "--cpu-bytes", "1GiB", "--eviction", "lru", "--serial"]
    assert main([*argv, "--out", str(tmp_path / "sw")]) == 0
    header = next(line for line in capsys.readouterr().out.splitlines() if "eviction" in line)
    assert "store threshold" in header


def test_synth_draws_a_progress_bar(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FORCE_COLOR", "1")  # rich draws as on a terminal
    out = str(tmp_path / "p.kvlog")
    assert main(["synth", "--steps", "300", "--sync", "none", "--out", out]) == 0
    err = capsys.readouterr().err
    assert "synth" in err and "300" in err  # the bar: its name and its total


def test_a_local_ray_on_two_cpus_says_serial_is_likely_faster(
    log: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("ray")
    out = tmp_path / "sw"
    argv = ["sweep", log, "--policy", "off", "--num-cpus", "2", "--out", str(out)]
    assert main(argv) == 0
    said = capsys.readouterr()
    assert "--serial" in said.out + said.err

"""Issue 31: ``kvlog top LOG`` (``kvlog/present/top.py``, ``kvlog top``'s CLI).

A closed log's snapshot equals the replay's figures; a log directory written by a live
``kvlog synth`` under segment rotation and retention is followed (JSON lines, steps that
grow, the retired records counted); rates come from successive snapshots; a path that is not
a log is refused in one line with exit status 2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvlog.analysis.figures import figures_of_log
from kvlog.cli import main
from kvlog.present.top import LogWatch, Sampler, render, snapshot_json


@pytest.fixture(scope="module")
def closed_log(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("top") / "a.kvlog")
    assert main(["synth", "--out", path, "--steps", "300", "--num-cpu-blocks", "64"]) == 0
    return path


def test_once_json_of_a_closed_log_is_its_replay(
    closed_log: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["top", closed_log, "--once", "--json"]) == 0
    line = capsys.readouterr().out.strip()
    assert "\n" not in line
    got = json.loads(line)
    want = figures_of_log(closed_log)
    assert got["counters"]["steps"] == want.figures.steps == 300
    assert got["counters"]["defrag_pairs"] == want.figures.defrag_pairs
    assert got["counters"]["stores"] == want.figures.transfer_jobs["store"]
    assert got["used_blocks"] == want.gauges.used_blocks
    assert got["highest_used_id"] == want.gauges.highest_used_id
    assert got["recorder"]["status"] == "closed"
    assert got["recorder"]["records"] == want.last_seq + 1


def test_once_view_prints_one_screen(closed_log: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["top", closed_log, "--once"]) == 0
    out = capsys.readouterr().out
    for word in ("steps", "used blocks", "defrag", "stores", "loads", "CPU tier", "recorder"):
        assert word in out


@pytest.mark.parametrize("what", ["text", "dir", "missing"])
def test_not_a_log_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], what: str
) -> None:
    path = tmp_path / "x"
    if what == "text":
        path.write_text("hello\n")
    elif what == "dir":
        path.mkdir()
    assert main(["top", str(path), "--once"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvlog top: ")


def test_rates_from_successive_snapshots(closed_log: str) -> None:
    now = [100.0]
    sampler = Sampler(LogWatch(closed_log), clock=lambda: now[0])
    first = sampler.sample()
    assert first.rates == {}
    now[0] += 2.0
    second = sampler.sample()
    assert second.rates["steps"] == 0.0  # a closed log does not grow
    assert set(second.sparks) >= {"steps", "defrag_pairs"}
    json.loads(snapshot_json(second))
    render(second)


def test_follows_a_live_log_directory_under_retention(tmp_path: Path) -> None:
    """``kvlog synth`` writes a log directory (small segments, retention) while ``kvlog top
    --json`` follows it: one JSON line per refresh, steps that grow, retired records
    counted, and the writer never waits on the viewer (it runs to its end)."""
    out = str(tmp_path / "live") + "/"
    synth = subprocess.Popen(
        [sys.executable, "-m", "kvlog.cli", "synth", "--out", out, "--steps", "60000",
         "--num-cpu-blocks", "64", "--segment-bytes", "65536", "--retain-bytes", "300000",
         "--sync", "background"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(out, "MANIFEST.json")):
            assert time.monotonic() < deadline, "synth wrote no log"
            time.sleep(0.2)
        top = subprocess.run(
            [sys.executable, "-m", "kvlog.cli", "top", out, "--json", "--count", "4",
             "--interval", "0.5"],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    finally:
        synth.wait(timeout=600)
    assert synth.returncode == 0
    assert top.returncode == 0, top.stderr
    lines = [json.loads(line) for line in top.stdout.splitlines()]
    assert len(lines) == 4
    steps = [line["counters"]["steps"] for line in lines]
    assert steps == sorted(steps) and steps[-1] > steps[0] > 0
    assert lines[-1]["recorder"]["segments"] >= 1
    once = subprocess.run(
        [sys.executable, "-m", "kvlog.cli", "top", out, "--once", "--json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    final = json.loads(once.stdout)
    assert final["counters"]["steps"] == 60000  # the state's step number: exact after retention

"""The log benchmark runs end to end (a smoke test: figures come from running it)."""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import bench_log

from kvlog.events import CacheConfigured, StepEnded


def test_record_mix_is_realistic() -> None:
    records = bench_log.make_records(3000)
    assert records == bench_log.make_records(3000)  # deterministic
    assert isinstance(records[0], CacheConfigured)
    steps = [i for i, record in enumerate(records) if isinstance(record, StepEnded)]
    gaps = [b - a for a, b in itertools.pairwise(steps)]
    assert 8 <= sum(gaps) / len(gaps) <= 21
    kinds = {type(record).__name__ for record in records}
    assert {"BlocksAllocated", "RequestFinished", "StoreRequested", "Checkpoint"} <= kinds


def test_bench_prints_a_table(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(os, "fdatasync", lambda fd: None)  # a smoke test, not a measurement
    monkeypatch.setattr(os, "fsync", lambda fd: None)
    assert bench_log.main(["--quick", "--records", "400", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for row in ("append sync=none", "append sync=step", "append sync=always", "read all"):
        assert row in out
    assert "append sync=background" in out
    assert "sync=background: step-ending append" in out
    assert out.count("x\n") == 7  # a ratio on every kvlog row

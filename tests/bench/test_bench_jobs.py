"""The per-job benchmark runs end to end (a smoke test: figures come from running it)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import bench_jobs


def test_jobs_take_blocks_from_live_tables_and_fresh_cpu_blocks() -> None:
    shape = bench_jobs.Shape(jobs=3, blocks=8)
    jobs = bench_jobs.job_specs(shape, 5)
    assert [job_id for job_id, _, _ in jobs] == [16, 17, 18]  # one counter, never reused
    for _, gpu, cpu in jobs:
        assert len(gpu) == len(cpu) == 8
        assert min(gpu) >= 1 and max(gpu) <= shape.num_gpu_blocks // 2  # inside live tables
        assert min(cpu) >= 0 and max(cpu) < shape.num_gpu_blocks


def test_bench_prints_each_phase_and_the_ratio(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert bench_jobs.main(["--steps", "40", "--rounds", "1", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for phase in bench_jobs.PHASES:
        assert re.search(rf"kvlog {phase}\s+\d+\.\d", out)
    assert re.search(r"plain copy of its bytes\s+\d+\.\d", out)
    assert re.search(r"kvlog / plain \d+\.\dx", out)
    assert list(tmp_path.iterdir()) == []  # the logs went with the temp dir

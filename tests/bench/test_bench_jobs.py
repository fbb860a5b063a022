"""The per-job benchmark runs end to end (a smoke test: figures come from running it)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import bench_jobs

from kvlog.events import TransferBatch
from kvlog.log import read_log


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
    assert re.search(r"the design's floor, inline\s+\d+\.\d", out)
    # a difference of two timings: in a 40-step smoke run on a loaded machine the plain copy
    # can take longer than kvlog's whole job, and the bench prints the negative figure it got
    assert re.search(r"kvlog's bookkeeping / the floor -?\d+\.\dx", out)
    assert list(tmp_path.iterdir()) == []  # the logs went with the temp dir


def test_the_floor_keeps_the_records_kvlog_logs_for_the_same_jobs(tmp_path: Path) -> None:
    """The floor baseline encodes exactly the records kvlog's worker logs for a step."""
    shape = bench_jobs.Shape(jobs=2, blocks=8)
    bench_jobs.kvlog_round(shape, 3, str(tmp_path))
    (log,) = tmp_path.iterdir()
    batches = [r for _, r in read_log(log) if type(r) is TransferBatch]
    expected = [
        b for step in range(3) for b in bench_jobs.step_records(bench_jobs.job_specs(shape, step))
    ]
    assert batches == expected
    assert bench_jobs.floor_round(shape, 3) > 0.0

"""The step benchmark's two sides agree pair for pair (a smoke test: figures come from
running ``bench/bench_step.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import bench_step


def test_kvlog_with_its_log_and_the_seed_make_the_same_pairs(tmp_path: Path) -> None:
    trace = bench_step.Trace(4096, seed=7)
    warm = trace.warm_up()
    steps = [trace.step(s) for s in range(300)]
    _, ours = bench_step.kvlog_run(4096, warm, steps, "none", str(tmp_path))
    _, theirs = bench_step.seed_run(4096, warm, steps)
    assert ours == theirs
    assert sum(bool(p) for p in ours) > 250  # defrag fires on most steps

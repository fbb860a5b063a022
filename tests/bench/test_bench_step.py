"""The step benchmark's three sides agree pair for pair (a smoke test: figures come from
running ``bench/bench_step.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import bench_step


def test_kvlog_with_its_log_and_both_seeds_make_the_same_pairs(tmp_path: Path) -> None:
    trace = bench_step.Trace(4096, seed=7)
    warm = trace.warm_up()
    steps = [trace.step(s) for s in range(300)]
    ours = bench_step.kvlog_run(4096, warm, steps, "none", str(tmp_path)).pairs
    shipped = bench_step.seed_run(4096, warm, steps, shipped=True).pairs
    restated = bench_step.seed_run(4096, warm, steps, shipped=False).pairs
    assert ours == shipped == restated
    assert sum(bool(p) for p in ours) > 250  # defrag fires on most steps


def test_the_baseline_sorts_like_the_seed_it_stands_for() -> None:
    """The shipped side's free-block generator walks a sort of the used blocks, as the
    seed's does: the baseline pays for the seed's second sort, not a cheaper stand-in."""
    seed = bench_step.SeedShipped(threshold=0)
    seed.update_state({"a": [5, 2, 9]}, ())
    assert list(zip(range(4), seed._free_blocks(), strict=False)) == [
        (0, 1),
        (1, 3),
        (2, 4),
        (3, 6),
    ]
    assert seed.defragment() == [(9, 1), (5, 3)]

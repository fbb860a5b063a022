"""The step benchmark's three sides agree pair for pair (a smoke test: figures come from
running ``bench/bench_step.py``)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

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


def test_the_heavy_trace_runs_hundreds_of_requests_and_fires_defrag_in_most_steps(
    tmp_path: Path,
) -> None:
    """The heavy trace keeps hundreds of requests running in its id space, and
    kvlog's whole steps in a pool of the trace's size and in a 1M pool make the seed's
    pairs."""
    trace = bench_step.HeavyTrace(4096, seed=3)
    warm = trace.warm_up()
    steps = [trace.step(s) for s in range(200)]
    assert len(trace.live) >= 350
    ids = {b for events in steps for e in events for b in getattr(e, "block_ids", [])}
    assert max(ids) < 4096
    whole = bench_step.as_steps(steps)
    own = bench_step.kvlog_run(4096, warm, whole, "none", str(tmp_path)).pairs
    big = bench_step.kvlog_run(bench_step.BIG_POOL, warm, whole, "none", str(tmp_path)).pairs
    shipped = bench_step.seed_run(4096, warm, steps, shipped=True).pairs
    assert own == big == shipped
    assert sum(bool(p) for p in own) > 150  # defrag fires on most steps


def test_the_split_clocks_every_piece_and_puts_each_back(tmp_path: Path) -> None:
    """``--split`` times each piece of the step on the same decisions (the same pairs as
    the unclocked run), every piece runs in the timed steps, they add up to less than the
    step, and the originals are back afterwards."""
    trace = bench_step.HeavyTrace(4096, seed=5)
    warm = trace.warm_up()
    whole = bench_step.as_steps([trace.step(s) for s in range(120)])
    owners = []
    for module_name, name, _ in bench_step.SPLIT:
        owner: Any = importlib.import_module(module_name)
        if "." in name:
            class_name, name = name.split(".")
            owner = getattr(owner, class_name)
        owners.append((owner, name, getattr(owner, name)))
    run, pieces = bench_step.split_run(4096, warm, whole, str(tmp_path))
    assert run.pairs == bench_step.kvlog_run(4096, warm, whole, "none", str(tmp_path)).pairs
    assert set(pieces) == {label for _, _, label in bench_step.SPLIT}
    assert all(us > 0 for us in pieces.values()), pieces
    assert sum(pieces.values()) < run.mean_us
    assert all(getattr(owner, name) is original for owner, name, original in owners)

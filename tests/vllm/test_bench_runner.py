"""``bench/bench_runner.py`` at a toy scale (a smoke test: figures come from running the
script at serving scale): the run makes every call of the runner's step, splits kvlog's
time by call, and its log replays to the live digest."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the real-vLLM stage runs this (its own virtualenv)")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import bench_runner


@pytest.mark.parametrize(
    ("prefix_caching", "switch"), [(False, False), (True, False), (False, True)]
)
def test_the_serving_scale_bench_runs_at_a_toy_scale(prefix_caching: bool, switch: bool) -> None:
    scale = bench_runner.Scale(
        blocks=512, block_size=16, seqs=16, batched_tokens=256, prompt=120, output_min=8,
        output_max=40, cpu_blocks=512, max_waiting=8, threshold=4, switch=switch,
    )  # fmt: skip
    figs, _ = bench_runner.measure(scale, prefix_caching, steps=60, warmup=20, replay=True)
    assert figs.errors == [] and figs.replay == "ok"
    assert figs.steps == 60
    if switch:  # the switch's call site, and its decode hook instead of the runner's resolves
        calls = ("run_defragmenter", "resolve_table", "resolve", "bind_connector_metadata")
        assert figs.mean["resolve_all"] == 0 and figs.mean["update_state"] == 0
    else:
        calls = ("update_state", "defragment", "resolve_all", "resolve", "bind_connector_metadata")
        assert figs.mean["resolve_table"] == 0
    for call in calls:
        assert figs.mean[call] > 0, call
    assert figs.mean["seed"] > 0 and figs.mean["scheduler"] > 0
    assert figs.mean["plain"] > 0  # vLLM's plain worker got the connector's calls too
    assert "plain" not in bench_runner.CALLS  # and its time is not kvlog's
    assert figs.mean["kvlog"] >= sum(figs.mean[c] for c in calls)
    assert figs.counts["stores"] > 0
    bulk, of = (int(n) for n in figs.bulk.split(" of "))  # whole steps logged packed
    assert of == 80 and 0 < bulk <= of

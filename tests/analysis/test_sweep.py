"""Policy sweeps on Ray: the two trace logs under seed thresholds and the new policies, the
CSV and the PNG checked, what-ifs against kvlog.analysis.replay, and segment-parallel replay against
the sequential one. Ray runs locally with 2 CPUs and no dashboard (CI has 2 cores)."""

from __future__ import annotations

import csv
import os
import sys
from collections.abc import Iterator

import pytest

from kvlog import replay
from kvlog.analysis.cost import CostModel
from kvlog.analysis.grid import PolicySpec, policy_grid, run_sweep, whatif
from kvlog.analysis.parallel import replay_segments
from kvlog.cli import main
from kvlog.errors import ConfigError
from kvlog.synth import SynthConfig, TraceConfig, bytes_per_token, read_trace, run_trace

DATA = os.path.join(os.path.dirname(__file__), "..", "data")


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """A Mooncake log (prefix caching, swap mode) and an Azure log (offload, move mode)."""
    root = tmp_path_factory.mktemp("sweep")
    page = bytes_per_token() * 128
    mooncake = TraceConfig(
        SynthConfig(
            num_gpu_blocks=2048,
            block_size=128,
            prefix_caching=True,
            page_size_bytes=page,
            max_num_seqs=32,
        )
    )
    azure = TraceConfig(
        SynthConfig(
            num_gpu_blocks=384,
            block_size=128,
            num_cpu_blocks=512,
            block_size_factor=2,
            page_size_bytes=page,
            max_num_seqs=48,
        ),
        "azure",
        time_scale=0.5,
    )
    paths = []
    for name, config, trace in (
        ("mooncake", mooncake, "mooncake_synthetic_trace_3601-3800.jsonl"),
        ("azure", azure, "AzureLLMInferenceTrace_conv_head300.csv"),
    ):
        path = str(root / f"{name}.kvlog")
        requests = read_trace(os.path.join(DATA, trace), limit=150)
        run_trace(config, requests, path, sync="none", checkpoint_every=16, snapshot_every=2)
        paths.append(path)
    yield paths


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    """One local Ray for the module (2 CPUs, no dashboard); the sweep code reuses it."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


def test_policy_grid_names_every_variant() -> None:
    specs = policy_grid(("seed", "tail", "budget", "off", "recorded"), (8, 32), (None, 64))
    labels = [s.label for s in specs]
    assert labels == [
        "seed t=8",
        "seed t=8 m=64",
        "seed t=32",
        "seed t=32 m=64",
        "tail r=1.5 min=4",
        "budget 64MiB t=8",
        "off",
        "recorded",
    ]
    assert specs[4].as_dict() == {
        "defrag": True,
        "policy": "tail",
        "policy_ratio_pct": 150,
        "policy_min_swaps": 4,
    }
    with pytest.raises(ConfigError, match="policy='best'"):  # also a ValueError
        policy_grid(("best",))


def test_a_whatif_row_agrees_with_replay(logs: list[str]) -> None:
    path = logs[0]
    spec = PolicySpec("tail", (("policy", "tail"), ("policy_ratio_pct", 120)))
    row = whatif(path, spec, CostModel())
    other = replay(path, policy="tail", policy_ratio_pct=120)
    assert other.whatif is not None and not row.rejected
    stats = other.whatif.whatif
    assert row.final_digest == stats.final_digest
    assert (row.blocks_moved, row.swap_bytes) == (stats.num_swapped_blocks, stats.swap_bytes)
    assert (row.stores, row.loads, row.steps) == (
        stats.num_stores,
        stats.num_loads,
        stats.num_steps,
    )
    assert row.mean_max_used == pytest.approx(stats.mean_max_used)
    assert row.modeled_s == pytest.approx(row.decode_s + row.defrag_s + row.transfer_s)
    recorded = whatif(path, PolicySpec("recorded"), CostModel())
    assert recorded.final_digest == replay(path).final_digest


def test_sweep_on_ray_writes_the_csv_and_the_png(
    logs: list[str], local_ray: None, tmp_path: str, capsys: pytest.CaptureFixture[str]
) -> None:
    out = os.path.join(tmp_path, "sweep")
    argv = ["sweep", *logs, "--threshold", "8,16,32", "--policy", "seed,tail,budget,off"]
    argv += ["--budget", "64MiB", "--out", out, "--num-cpus", "2"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "2 logs x 6 policies on a local Ray" in printed and "tail r=1.5 min=4" in printed
    with open(os.path.join(out, "sweep.csv"), encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 12 and {r["log"] for r in rows} == {"mooncake", "azure"}
    assert not any(r["rejected"] for r in rows)
    by = {(r["log"], r["policy"]): r for r in rows}
    for log in ("mooncake", "azure"):
        off, seed = by[(log, "off")], by[(log, "seed t=8")]
        assert int(off["blocks_moved"]) == 0 and int(seed["blocks_moved"]) > 0
        assert float(seed["mean_max_used"]) < float(off["mean_max_used"])
        assert float(seed["modeled_s"]) > 0 and int(seed["steps"]) > 100
    assert int(by[("azure", "off")]["stores"]) > 0  # the offload log stores
    serial = run_sweep(logs, policy_grid(("seed", "tail"), (8,)), use_ray=False)
    for row in serial:
        assert by[(row.log, row.policy)]["final_digest"] == row.final_digest
    with open(os.path.join(out, "sweep.png"), "rb") as f:
        png = f.read()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000


def test_segment_replay_equals_the_sequential_replay(logs: list[str], local_ray: None) -> None:
    for path in logs:
        sequential = replay(path)
        here = replay_segments(path, use_ray=False, max_segments=5)
        assert here.ok and len(here.segments) == 5
        for result in (here,):
            assert result.final_digest == sequential.final_digest
            assert result.num_events == sequential.num_events
            assert result.num_verified == sequential.num_verified
    on_ray = replay_segments(logs[1], num_cpus=2, max_segments=3)
    assert on_ray.ok and on_ray.final_digest == replay(logs[1]).final_digest
    assert next(s.start_seq for s in on_ray.segments) == 0


def test_segment_replay_finds_a_damaged_snapshot(logs: list[str], tmp_path: str) -> None:
    import msgspec

    from kvlog.events import Checkpoint
    from kvlog.log import LogReader, LogWriter

    bad = os.path.join(tmp_path, "bad.kvlog")
    reader = LogReader(logs[1])
    flipped = False
    with LogWriter(bad, sync="none", meta=dict(reader.header.meta)) as writer:
        for _, record in reader.records():
            if isinstance(record, Checkpoint) and record.snapshot and not flipped:
                record = msgspec.structs.replace(record, digest="0" * 64)
                flipped = True
            writer.append(record)
    result = replay_segments(bad, use_ray=False, max_segments=4)
    assert not result.ok and "does not verify" in result.divergence


def test_sweep_without_ray_names_the_extra(
    logs: list[str],
    tmp_path: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import fails
    assert main(["sweep", logs[0], "--out", os.path.join(tmp_path, "s")]) == 2
    assert "pip install 'kvlog[sweep]'" in capsys.readouterr().err
    assert main(["sweep", logs[0], "--serial", "--out", os.path.join(tmp_path, "s")]) == 0


def test_a_remote_cluster_gets_the_log_as_bytes(logs: list[str]) -> None:
    """What a task on another machine does with the bytes ``--address`` ships."""
    from kvlog.analysis.grid import _whatif_task
    from kvlog.analysis.parallel import _plan_segments, _replay_segment

    with open(logs[1], "rb") as f:
        blob = f.read()
    spec = PolicySpec("tail", (("policy", "tail"),))
    shipped = _whatif_task(blob, "azure", spec, CostModel())
    assert shipped == whatif(logs[1], spec, CostModel(), "azure")
    segments = _plan_segments(logs[1], 3)
    assert [_replay_segment(blob, s) for s in segments] == [
        _replay_segment(logs[1], s) for s in segments
    ]


def test_the_report_series_charges_defrag_as_the_sweep_does(logs: list[str]) -> None:
    """The demo picture's modeled ms/step (``Series.modeled_ms``) and the sweep's are one
    figure: both charge a swap plan its padded pairs (``SwapPlan.padded_to``)."""
    cost = CostModel()
    padded = 0
    for path in logs:
        result = replay(path)
        series = result.recorded.series
        assert series is not None
        config = result.recorded.config
        row = whatif(path, PolicySpec("recorded"), cost)
        modeled = series.modeled_ms(config, cost)
        assert sum(modeled) / len(modeled) == pytest.approx(row.modeled_ms_per_step)
        assert sum(series.num_padded) >= sum(series.num_swapped)
        padded += sum(series.num_padded) - sum(series.num_swapped)
    assert padded > 0, "the logs have pad buckets: the two charges differ without them"

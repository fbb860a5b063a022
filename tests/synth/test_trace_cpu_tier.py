"""``kvlog synth --trace ... --num-cpu-blocks N`` records the CPU tier (issue 34, item 1).

The trace loop's CPU cache is the tier: vLLM's manager as the tier reducer answers it
(``kvlog.synth.tier``), wrapped in the connector's recorder (``TierRecorder``), so the log
holds every call with its answer and ``kvlog sweep LOG --cpu-bytes`` asks it what-ifs. A log
with no tier events is refused by ``sweep --cpu-bytes`` (one line, exit 2), the defrag
policy flags beside ``--cpu-bytes`` are refused (they would be ignored), and a source no
tier can serve says why its hit rates are 0.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path

import pytest

from kvlog import replay
from kvlog.cli import main
from kvlog.events import TierConfigured, TierLoadPrepared, TierStorePrepared
from kvlog.tier.replay import replay_tier, tier_events
from kvlog.tier.trace import accesses_from_log

DATA = Path(__file__).resolve().parents[1] / "data"
MOONCAKE = str(DATA / "mooncake_synthetic_trace_3601-3800.jsonl")
AZURE = str(DATA / "AzureLLMInferenceTrace_conv_head300.csv")
SYNTH = ["--prefix-caching", "--sync", "none", "--num-gpu-blocks", "1024"]


@pytest.fixture(scope="module")
def tier_log(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = str(tmp_path_factory.mktemp("tier") / "m.kvlog")
    argv = ["synth", "--trace", MOONCAKE, *SYNTH, "--num-cpu-blocks", "512", "--out", out]
    assert main(argv) == 0
    return out


def test_a_trace_run_with_a_cpu_tier_records_its_calls_through_the_recorder(
    tier_log: str,
) -> None:
    events = list(tier_events(tier_log))
    config = events[0]
    assert type(config) is TierConfigured and config.num_chunks == 512
    assert config.tokens_per_chunk == 128 and config.chunk_bytes == 128 * 131072
    stores = [e for e in events if type(e) is TierStorePrepared and e.keys_to_store]
    loads = [e for e in events if type(e) is TierLoadPrepared]
    assert stores and loads  # the slice's shared prefixes come back from the tier
    tier = replay_tier(tier_log)
    assert tier.exact and tier.compared > 1000 and tier.lookup_hits > 0
    assert len(accesses_from_log(tier_log)) >= 200  # one per request (and its resumptions)
    result = replay(tier_log)
    assert result.ok and result.num_verified == result.num_checkpoints > 0


def test_the_loops_loads_are_the_tiers_chunks(tier_log: str) -> None:
    """The CPU blocks a load reads are the chunks the tier answered for its keys."""
    from kvlog.events import LoadRequested, unbatched
    from kvlog.log import read_log

    records = list(unbatched(record for _, record in read_log(tier_log)))
    tier_loads = [e.chunk_ids for e in records if type(e) is TierLoadPrepared]
    loop_loads = [e.cpu_block_ids for e in records if type(e) is LoadRequested]
    assert loop_loads == tier_loads


def test_sweep_cpu_bytes_on_the_recorded_log_gives_hit_rates(
    tier_log: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sw"
    argv = ["sweep", tier_log, "--cpu-bytes", "1GiB,4GiB,16GiB", "--eviction", "lru,arc,opt"]
    assert main([*argv, "--out", str(out), "--serial"]) == 0
    with open(out / "sweep.csv", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 9
    assert all(int(r["blocks_asked"]) > 0 for r in rows)
    assert all(r["tokens_per_chunk"] == "128" for r in rows)  # the log's chunks, not 512
    best = {r["eviction"]: float(r["hit_rate"]) for r in rows if r["cpu_bytes"] == str(16 << 30)}
    assert best["lru"] > 0 and best["opt"] >= best["lru"]
    capsys.readouterr()


def test_sweep_cpu_bytes_refuses_a_log_with_no_tier_events(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = str(tmp_path / "plain.kvlog")
    assert main(["synth", "--steps", "50", "--sync", "none", "--out", log]) == 0
    capsys.readouterr()
    out = tmp_path / "sw"
    argv = ["sweep", log, "--cpu-bytes", "4GiB", "--out", str(out), "--serial"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and "no CPU tier events" in err and "plain.kvlog" in err
    assert not os.path.exists(out)


@pytest.mark.parametrize(
    "flag", [["--threshold", "8"], ["--policy", "tail"], ["--max-bytes-per-step", "64MiB"]]
)
def test_sweep_cpu_bytes_refuses_the_defrag_policy_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: list[str]
) -> None:
    out = tmp_path / "sw"
    argv = ["sweep", MOONCAKE, "--cpu-bytes", "4GiB", "--out", str(out), "--serial", *flag]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and " ".join(flag) in err and "--cpu-bytes" in err
    assert not os.path.exists(out)


def test_sweep_says_why_a_trace_without_prefixes_or_preemption_hits_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sw"
    argv = ["sweep", AZURE, "--cpu-bytes", "4GiB", "--eviction", "lru", "--serial"]
    assert main([*argv, "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "no chunk is asked for twice" in said and "--gpu-tokens" in said

"""``kvlog sweep --cpu-bytes``: CPU tier flags no what-if can use are refused (exit 2, one
line naming the flag, nothing written) instead of a table of ``nan s`` or a negative
threshold run as 0."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvlog.cli import main

MOONCAKE = str(
    Path(__file__).resolve().parents[1] / "data" / "mooncake_synthetic_trace_3601-3800.jsonl"
)


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--prefill-us-per-token", "nan"),
        ("--prefill-us-per-token", "inf"),
        ("--prefill-us-per-token", "-1"),
        ("--store-threshold", "-3"),
        ("--store-threshold", "2,-1"),
        ("--gpu-tokens", "-1"),
    ],
)
def test_a_tier_value_no_what_if_can_use_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str
) -> None:
    out = tmp_path / "sw"
    argv = ["sweep", MOONCAKE, "--out", str(out), "--serial", "--cpu-bytes", "1GiB"]
    assert main([*argv, "--eviction", "lru", flag, value]) == 2
    err = capsys.readouterr().err
    assert flag in err and "Traceback" not in err and len(err.splitlines()) == 1
    assert not os.path.exists(out)


def test_the_edges_of_the_tier_values_still_run(tmp_path: Path) -> None:
    out = tmp_path / "sw"
    argv = ["sweep", MOONCAKE, "--out", str(out), "--serial", "--cpu-bytes", "1GiB"]
    edges = ["--prefill-us-per-token", "0", "--store-threshold", "0,2", "--gpu-tokens", "0"]
    assert main([*argv, "--eviction", "lru", *edges]) == 0
    assert (out / "sweep.csv").stat().st_size > 0


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--store-threshold", "-3"),
        ("--gpu-tokens", "-5"),
        ("--tokens-per-chunk", "7"),
        ("--bytes-per-token", "0"),
        ("--num-chunks", "0"),
        ("--requests", "0"),
    ],
)
def test_tier_synth_refuses_what_kvlog_sweep_refuses(
    flag: str, value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvlog.tier.synth import main as tier_synth

    out = tmp_path / "tier.kvlog"
    assert tier_synth([MOONCAKE, "--out", str(out), "--requests", "10", flag, value]) == 2
    err = capsys.readouterr().err
    assert (
        err
        == f"python -m kvlog.tier.synth: {flag}={value}: expected " + err.split("expected ", 1)[1]
    )
    assert err.count("\n") == 1
    assert not out.exists()  # refused before the log was opened


def test_tier_synth_still_writes_a_log_at_the_edges(tmp_path: Path) -> None:
    from kvlog.tier.synth import main as tier_synth

    out = tmp_path / "tier.kvlog"
    edges = ["--store-threshold", "0", "--gpu-tokens", "0", "--requests", "10"]
    assert tier_synth([MOONCAKE, "--out", str(out), *edges]) == 0
    assert out.exists()

"""The command-line leftovers of the s22 attack campaign: a missing log reads the same in
every subcommand, ``python -m kvlog.tier.synth`` checks its flags as ``kvlog sweep
--cpu-bytes`` does, a header-only log's report draws without a matplotlib warning."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvlog.cli import main


@pytest.mark.parametrize(
    "argv",
    [
        ["replay", "{missing}"],
        ["replay", "--report", "{tmp}/r.png", "{missing}"],
        ["replay", "--parallel", "{missing}"],
        ["replay", "{log}", "--against", "{missing}"],
        ["inspect", "{missing}"],
        ["ranks", "{log}", "{missing}"],
        ["sweep", "{missing}", "--out", "{tmp}/out"],
        ["sweep", "--cpu-bytes", "1GiB", "{missing}", "--out", "{tmp}/out"],
    ],
)
def test_a_missing_log_reads_the_same_in_every_subcommand(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "a.kvlog"
    assert main(["synth", "--out", str(log), "--steps", "20", "--sync", "none"]) == 0
    capsys.readouterr()
    missing = tmp_path / "gone.kvlog"
    args = [a.format(missing=missing, tmp=tmp_path, log=log) for a in argv]
    assert main(args) == 2
    captured = capsys.readouterr()
    assert captured.err == f"kvlog {argv[0]}: [Errno 2] {missing}: no such log\n"
    assert captured.out == ""  # nothing printed before the refusal (sweep's banner neither)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.kvlog"]


MOONCAKE = str(Path(__file__).parent / "data" / "mooncake_synthetic_trace_3601-3800.jsonl")


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


@pytest.mark.parametrize("suffix", [".png", ".svg"])
def test_a_header_only_log_reports_without_a_matplotlib_warning(
    suffix: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import warnings

    from kvlog.log import LogWriter

    log = tmp_path / "empty.kvlog"
    LogWriter(log, new=True).close()
    report = tmp_path / f"r{suffix}"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib's "No artists with labels" included
        assert main(["replay", str(log), "--report", str(report)]) == 0
        assert main(["replay", str(log), "--threshold", "4", "--report", str(report)]) == 0
    assert report.stat().st_size > 0
    assert capsys.readouterr().err == ""

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

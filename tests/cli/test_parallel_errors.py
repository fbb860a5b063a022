"""``kvlog replay DIR --parallel`` on a damaged segment says what the sequential replay
says, in one line (issue 34 item 8): the error a Ray task raised, not Ray's traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvlog.cli import main

pytest.importorskip("ray")


def test_a_corrupt_segment_under_parallel_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = str(tmp_path / "segs") + "/"
    argv = ["synth", "--steps", "1500", "--sync", "none", "--segment-bytes", "64KiB"]
    assert main([*argv, "--out", log]) == 0
    segments = sorted(Path(log).glob("*.kvlog"))
    assert len(segments) >= 3
    sealed = segments[1]
    data = bytearray(sealed.read_bytes())
    data[len(data) // 2] ^= 0xFF
    sealed.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["replay", log]) == 2
    sequential = capsys.readouterr().err.strip()
    assert main(["replay", log, "--parallel", "--num-cpus", "1"]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("kvlog replay")]
    assert lines == [sequential]
    assert "Traceback" not in err and "\x1b[" not in err and sealed.name in sequential

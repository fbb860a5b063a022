"""Words a user can trust (issue 34 items 4, 5, 7, 9, 10, 12, 13): a command that checked
nothing says so and fails, a value that turns defrag off is refused wherever it is given, a
segment size for a log file is refused, a divergence names the field that differs, help
shows true defaults, and messages speak the user's units, not kvlog's internals."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from kvlog import replay
from kvlog.cli import build_parser, main
from kvlog.log import LogWriter

DATA = Path(__file__).resolve().parents[1] / "data"
MOONCAKE = str(DATA / "mooncake_synthetic_trace_3601-3800.jsonl")


def _synth(path: Path, *extra: str) -> str:
    assert main(["synth", "--steps", "200", "--sync", "none", "--out", str(path), *extra]) == 0
    return str(path)


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("words")
    return {
        "a": _synth(d / "a.kvlog"),
        "longer": _synth(d / "a300.kvlog", "--steps", "300"),
        "t8": _synth(d / "t8.kvlog", "--threshold", "8"),
    }


# -- item 4: synth --execute that read no block -------------------------------------------
def test_synth_execute_that_read_no_block_fails_as_replay_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = str(tmp_path / "t.kvlog")
    argv = ["synth", "--trace", MOONCAKE, "--requests", "50", "--execute", "--sync", "none"]
    assert main([*argv, "--out", out]) == 1
    err = capsys.readouterr().err
    assert "--execute read no block: nothing was checked" in err and "--check-every" in err


def test_synth_execute_that_checks_blocks_passes(tmp_path: Path) -> None:
    out = str(tmp_path / "t.kvlog")
    argv = ["synth", "--trace", MOONCAKE, "--requests", "50", "--execute", "--sync", "none"]
    assert main([*argv, "--check-every", "10", "--out", out]) == 0


# -- item 5: a byte cap below one page ----------------------------------------------------
def test_replay_refuses_a_byte_cap_below_one_page(
    logs: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["replay", logs["a"], "--max-bytes-per-step", "1KiB"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "--max-bytes-per-step" in captured.err
    assert "at least one page" in captured.err and len(captured.err.splitlines()) == 1


def test_replay_keeps_a_byte_cap_of_one_page(logs: dict[str, str]) -> None:
    assert main(["replay", logs["a"], "--max-bytes-per-step", "2MiB"]) == 0


def test_sweep_refuses_a_budget_below_one_page(
    logs: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sw"
    argv = ["sweep", logs["a"], "--policy", "budget", "--out", str(out), "--serial"]
    assert main([*argv, "--max-bytes-per-step", "1KiB"]) == 2
    err = capsys.readouterr().err
    assert "--max-bytes-per-step" in err and "at least one page" in err
    assert not out.exists()


# -- item 7: a segment size for a log file ------------------------------------------------
@pytest.mark.parametrize(
    "flag", [["--segment-bytes", "1MiB"], ["--retain-bytes", "4MiB"], ["--compress"]]
)
def test_synth_refuses_a_segment_option_for_a_log_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: list[str]
) -> None:
    out = tmp_path / "f.kvlog"
    assert main(["synth", "--steps", "20", "--sync", "none", "--out", str(out), *flag]) == 2
    err = capsys.readouterr().err
    assert flag[0] in err and "DIR/" in err and len(err.splitlines()) == 1
    assert not os.path.lexists(out)


def test_synth_takes_a_segment_size_for_a_directory(tmp_path: Path) -> None:
    out = str(tmp_path / "d") + "/"
    assert main(["synth", "--steps", "20", "--sync", "none", "--out", out, "--segment-bytes",
                 "1MiB"]) == 0  # fmt: skip
    assert os.path.isdir(out)


# -- item 9: a divergence names what differs -----------------------------------------------
def test_against_names_the_field_that_differs(
    logs: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["replay", logs["a"], "--against", logs["t8"]]) == 1
    out = capsys.readouterr().out
    assert "threshold" in out and "32" in out and "8" in out
    assert "pad_sizes" not in out and "num_gpu_blocks" not in out  # not two whole dicts
    assert "verified: the replay agrees" not in out and "seq -1" not in out


def test_against_a_log_that_goes_on_names_the_last_agreeing_event(
    logs: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["replay", logs["longer"], "--against", logs["a"]]) == 1
    out = capsys.readouterr().out
    verdict = next(line for line in out.splitlines() if line.startswith("DIVERGENCE"))
    seq = int(re.search(r"at seq (\d+)", verdict).group(1))  # type: ignore[union-attr]
    assert f"last agreeing seq {seq - 1}" in verdict
    assert "verified: the replay agrees" not in out


def test_ranks_name_the_field_that_differs(
    logs: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["ranks", logs["a"], logs["t8"]]) == 1
    out = capsys.readouterr().out
    assert "threshold" in out and "pad_sizes" not in out and "num_gpu_blocks" not in out


# -- item 10: help shows true defaults ------------------------------------------------------
@pytest.mark.parametrize("command", ["synth", "replay", "inspect", "demo", "sweep", "ranks"])
def test_help_shows_no_default_of_a_switch_as_a_bool(command: str) -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    text = sub.choices[command].format_help()  # type: ignore[union-attr]
    assert "(default: True)" not in text and "(default: False)" not in text


def test_help_says_what_the_off_switches_leave_on() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    replay_help = " ".join(sub.choices["replay"].format_help().split())  # type: ignore[union-attr]
    synth_help = " ".join(sub.choices["synth"].format_help().split())  # type: ignore[union-attr]
    assert "checkpoints are verified unless given" in replay_help
    assert "defrag is on unless given" in synth_help


# -- item 12: messages in the user's words ------------------------------------------------
def test_a_refused_what_if_under_parallel_names_the_flag_as_typed(
    logs: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["replay", logs["a"], "--parallel", "--threshold", "8"]) == 2
    err = capsys.readouterr().err
    assert "--threshold 8" in err and "{" not in err


def test_a_refused_ratio_limit_is_shown_as_typed(
    logs: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["replay", logs["a"], "--ratio-limit", "2"]) == 2
    err = capsys.readouterr().err
    assert "--ratio-limit 2" in err and "200" not in err


@pytest.mark.parametrize("data", [b"KVLOGxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx", b""])
def test_a_log_that_breaks_before_its_first_record_has_no_minus_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], data: bytes
) -> None:
    log = tmp_path / "bad.kvlog"
    log.write_bytes(data or Path(_synth(tmp_path / "a.kvlog")).read_bytes()[:100])
    capsys.readouterr()
    assert main(["replay", str(log)]) == 2
    err = capsys.readouterr().err
    assert "number -1" not in err and "offset -1" not in err
    assert "before the first record" in err


def test_a_torn_tail_is_said_in_words(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = str(tmp_path / "torn.kvlog")
    writer = LogWriter(log, sync="none")
    from kvlog.events import CacheConfigured, StepEnded

    writer.append(CacheConfigured(num_gpu_blocks=64, block_size=16))
    writer.append(StepEnded(step=0))
    writer.flush()
    with open(log, "ab") as f:
        f.write(b"\x07" * 11)
    assert main(["inspect", log]) == 0
    err = capsys.readouterr().err
    assert "torn tail" in err and "Recovery(" not in err and "11 bytes" in err


def test_salvage_says_its_stop_reason_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = Path(_synth(tmp_path / "a.kvlog"))
    data = bytearray(log.read_bytes())
    data[3000] ^= 0xFF
    log.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["replay", "--salvage", str(log)]) == 1
    captured = capsys.readouterr()
    both = captured.out + captured.err
    assert both.count("checksum mismatch") == 1


# -- item 13: results print short ---------------------------------------------------------
def test_a_replay_result_prints_short_and_sums_itself_up(logs: dict[str, str]) -> None:
    result = replay(logs["a"], threshold=8)
    assert len(repr(result)) < 400 and "a.kvlog" in repr(result)
    summary = result.describe()
    assert "verified" in summary and len(summary.splitlines()) == 1


def test_a_synth_result_prints_short(tmp_path: Path) -> None:
    from kvlog.synth import SynthConfig, run_synth

    result = run_synth(SynthConfig(steps=200), str(tmp_path / "s.kvlog"), sync="none")
    assert len(repr(result)) < 400 and "s.kvlog" in repr(result)
    assert len(result.describe().splitlines()) == 1

"""The kvlog command line, end to end: synth, replay (verify, what-if, report, against),
inspect, demo, in-process through ``kvlog.cli.entry.main`` plus one run of the console script."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from kvlog.cli import main
from kvlog.events import BlocksAllocated
from kvlog.log import LogReader, LogWriter

SYNTH = [
    "--steps",
    "200",
    "--num-gpu-blocks",
    "256",
    "--prompt-len-mean",
    "160",
    "--output-len-mean",
    "48",
    "--arrival-rate",
    "0.3",
    "--sync",
    "none",
    "--checkpoint-every",
    "16",
]


@pytest.fixture(scope="module")
def log_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("cli") / "a.kvlog")
    assert (
        main(["synth", "--out", path, "--num-cpu-blocks", "96", "--block-size-factor", "2", *SYNTH])
        == 0
    )
    return path


def test_synth_prints_its_summary_and_refuses_to_overwrite(
    log_path: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert os.path.getsize(log_path) > 0
    assert main(["synth", "--out", log_path, *SYNTH]) == 2
    assert "already holds records" in capsys.readouterr().err


def test_synth_records_a_log_directory_that_rotates_retains_and_replays(
    log_path: str, tmp_path: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--segment-bytes``/``--retain-bytes`` with ``--out DIR/``: sealed segments, the
    oldest dropped, and what is left replays and verifies; refused for a log file."""
    directory = os.path.join(tmp_path, "logs") + "/"
    flags = ["--steps", "3000", "--sync", "none", "--segment-bytes", "64KiB"]
    assert main(["synth", "--out", directory, *flags, "--retain-bytes", "256KiB"]) == 0
    with open(os.path.join(directory, "MANIFEST.json"), encoding="utf-8") as f:
        manifest = json.load(f)
    segments = [n for n in os.listdir(directory) if n.endswith(".kvlog")]
    assert len(segments) >= 2, segments
    assert not any(n.startswith("0000000000000000") for n in segments), "retention dropped none"
    assert manifest
    capsys.readouterr()
    assert main(["replay", directory]) == 0
    assert "verified" in capsys.readouterr().out
    assert main(["synth", "--out", log_path, "--segment-bytes", "64KiB", *SYNTH]) == 2
    assert "log directory" in capsys.readouterr().err


def test_synth_execute_runs_canary_checks(
    tmp_path: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = os.path.join(tmp_path, "e.kvlog")
    assert (
        main(
            [
                "synth",
                "--out",
                path,
                "--execute",
                "--backend",
                "fake",
                "--prefix-caching",
                "--check-every",
                "50",
                *SYNTH,
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "canary" in out and " 0 wrong" in out


def test_replay_verifies(log_path: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", log_path]) == 0
    out = capsys.readouterr().out
    assert "verified: the replay agrees" in out and "verified" in out and "events/s" in out


def test_replay_what_if_writes_svg_and_csv_reports(
    log_path: str, tmp_path: str, capsys: pytest.CaptureFixture[str]
) -> None:
    svg = os.path.join(tmp_path, "r.svg")
    assert main(["replay", log_path, "--no-defrag", "--report", svg]) == 0
    out = capsys.readouterr().out
    assert "what-if: defrag off (recorded on)" in out and f"wrote SVG {svg}" in out
    with open(svg, encoding="utf-8") as f:
        text = f.read()
    assert "<svg" in text and "what-if: defrag off" in text  # matplotlib, legend per run
    csv_path = os.path.join(tmp_path, "r.csv")
    assert main(["replay", log_path, "--threshold", "4", "--report", csv_path]) == 0
    with open(csv_path, encoding="utf-8") as f:
        rows = f.read().splitlines()
    assert rows[0].startswith("series,step,num_used,max_used,fragmentation")
    assert len(rows) == 1 + 2 * 200


def test_replay_execute_and_from_snapshot(
    log_path: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["replay", log_path, "--execute"]) == 0
    assert " 0 wrong" in capsys.readouterr().out
    assert main(["replay", log_path, "--from-snapshot"]) == 0
    assert "started at" in capsys.readouterr().out


def test_replay_of_an_edited_log_fails_and_names_the_seq(
    log_path: str, tmp_path: str, capsys: pytest.CaptureFixture[str]
) -> None:
    edited = os.path.join(tmp_path, "edited.kvlog")
    target = -1
    with LogWriter(edited, sync="none") as writer:
        for seq, record in LogReader(log_path).records():
            if (
                target < 0
                and seq > 100
                and isinstance(record, BlocksAllocated)
                and len(record.block_ids) > 1
            ):
                record = BlocksAllocated(req_id=record.req_id, block_ids=record.block_ids[::-1])
                target = seq
            writer.append(record)
    assert main(["replay", edited, "--against", log_path]) == 1
    assert f"DIVERGENCE (event) at seq {target}" in capsys.readouterr().out
    assert main(["replay", edited]) == 1
    assert "DIVERGENCE (checkpoint)" in capsys.readouterr().out


def test_inspect_filters_by_type_and_range(
    log_path: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        main(
            [
                "inspect",
                log_path,
                "--type",
                "StepEnded",
                "--type",
                "BlocksAllocated",
                "--from",
                "10",
                "--to",
                "60",
            ]
        )
        == 0
    )
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines and all(10 <= d["seq"] <= 60 for d in lines)
    assert {d["type"] for d in lines} == {"StepEnded", "BlocksAllocated"}
    assert main(["inspect", log_path, "--header", "--to", "0"]) == 0
    header, first = capsys.readouterr().out.splitlines()
    assert json.loads(header)["schema_version"] == 1
    assert json.loads(first)["type"] == "CacheConfigured"


def test_bad_input_exits_2(tmp_path: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", os.path.join(tmp_path, "missing.kvlog")]) == 2
    with pytest.raises(SystemExit):
        main(["replay"])
    bad = os.path.join(tmp_path, "x.kvlog")
    assert main(["synth", "--out", bad, "--max-swaps", "1000", *SYNTH]) == 2
    assert "max_swaps" in capsys.readouterr().err


def test_demo_runs_with_defaults_in_a_directory(
    tmp_path: str, capsys: pytest.CaptureFixture[str]
) -> None:
    out_dir = os.path.join(tmp_path, "demo")
    assert main(["demo", "--out", out_dir, "--steps", "300"]) == 0
    out = capsys.readouterr().out
    assert "live digest == replayed digest" in out and out.rstrip().splitlines()[-1].startswith(
        "OK"
    )
    assert os.path.exists(os.path.join(out_dir, "demo.kvlog"))
    assert os.path.exists(os.path.join(out_dir, "demo_report.svg"))
    assert os.path.exists(os.path.join(out_dir, "demo_report.png"))
    assert "hit rate" in out  # the demo exercises prefix caching


def test_console_script(log_path: str) -> None:
    script = shutil.which("kvlog") or os.path.join(os.path.dirname(sys.executable), "kvlog")
    done = subprocess.run(
        [script, "inspect", log_path, "--to", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert [json.loads(line)["seq"] for line in done.stdout.splitlines()] == [0, 1, 2]


def test_version_names_the_package_and_the_log_format(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == "kvlog 0.1.0 (log schema 1, format 1)"


def test_inspect_summarises_snapshots_and_shows_them_when_asked(
    tmp_path: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = os.path.join(tmp_path, "s.kvlog")
    assert main(["synth", "--out", path, *SYNTH, "--snapshot-every", "1"]) == 0
    capsys.readouterr()
    assert main(["inspect", path, "--type", "Checkpoint"]) == 0
    short = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert short and all(len(r["snapshot"]) < 80 for r in short)
    assert any("--snapshots shows it" in r["snapshot"] for r in short)
    assert main(["inspect", path, "--type", "Checkpoint", "--snapshots"]) == 0
    whole = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert max(len(r["snapshot"]) for r in whole) > 1000


def test_inspect_numbers_every_record_by_its_own_seq(
    log_path: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every line carries its record's own ``seq``, a checkpoint's too (its ``seq`` field,
    the event it digests, is not the line's number)."""
    assert main(["inspect", log_path]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    records = list(LogReader(log_path).records())
    assert [line["seq"] for line in lines] == [seq for seq, _ in records]
    checkpoints = [line for line in lines if line["type"] == "Checkpoint"]
    events = {line["seq"] for line in lines if line["type"] != "Checkpoint"}
    assert checkpoints and all(c["covers_seq"] < c["seq"] for c in checkpoints)
    assert all(c["covers_seq"] in events or c["covers_seq"] == -1 for c in checkpoints)


def test_inspect_header_reads_settings_of_new_and_old_logs(
    log_path: str, capsys: pytest.CaptureFixture[str]
) -> None:
    old = os.path.join(os.path.dirname(__file__), "..", "..", "replays", "plain.kvlog")
    assert isinstance(LogReader(old).header.meta["synth"], str)  # JSON inside a string
    for path in (log_path, old):
        assert main(["inspect", path, "--header", "--to", "0"]) == 0
        header = json.loads(capsys.readouterr().out.splitlines()[0])
        assert header["meta"]["workload"] == "kvlog synth"
        assert isinstance(header["meta"]["synth"], dict), path
        assert isinstance(header["meta"]["synth"]["steps"], int)
    assert LogReader(log_path).header.meta["synth.steps"] == "200"  # flat: no JSON in JSON


def test_help_is_plain_text_and_synth_flags_show_defaults(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    top = capsys.readouterr().out
    assert "``" not in top and "exit status" in top
    with pytest.raises(SystemExit):
        main(["synth", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag in ("--seed", "--steps", "--num-prefixes", "--prefix-share", "--sync"):
        assert flag in text
    assert text.count("(default:") >= 12
    assert "(default: None)" not in text


def test_an_existing_log_is_refused_without_python_advice(
    log_path: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["synth", "--out", log_path, *SYNTH]) == 2
    err = capsys.readouterr().err
    assert "already holds records" in err and "--out" in err and "Engine" not in err

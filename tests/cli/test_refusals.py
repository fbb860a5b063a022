"""The command line refuses every bad value, flag combination, input file and output place
with one line naming it, exit 2 and nothing written, before any work; Ctrl-C exits 130 and
leaves a log that verifies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvlog import replay
from kvlog.cli import main
from kvlog.events import StepEnded
from kvlog.log import LogWriter
from tests.support.engines import busy_engine

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"
MOONCAKE = str(DATA / "mooncake_synthetic_trace_3601-3800.jsonl")
SMALL = ["--steps", "120", "--num-gpu-blocks", "128", "--sync", "none"]


def kvlog(*argv: str) -> int:
    return main(list(argv))


@pytest.fixture(scope="module")
def log(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("hcli") / "a.kvlog")
    assert kvlog("synth", "--out", path, "--checkpoint-every", "8", *SMALL) == 0
    return path


def refused(capsys: pytest.CaptureFixture[str], argv: list[str], *names: str) -> str:
    """Runs ``kvlog argv``: exit 2, one line on stderr naming each of ``names``."""
    assert main(argv) == 2, argv
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    for name in names:
        assert name in err, (name, err)
    return err


def entries(path: Path) -> list[str]:
    return sorted(os.listdir(path))


# -- replay --parallel honours its flags or refuses them -----------------------------------
@pytest.mark.parametrize(
    ("flags", "name"),
    [
        (["--against", "{log}"], "--against"),
        (["--execute"], "--execute"),
        (["--report", "{dir}/r.csv"], "--report"),
        (["--from-snapshot"], "--from-snapshot"),
        (["--no-defrag"], "--defrag"),
        (["--threshold", "3"], "--threshold"),
        (["--policy", "tail"], "--policy"),
        (["--max-bytes-per-step", "64MiB"], "--max-bytes-per-step"),
    ],
)
def test_parallel_refuses_what_it_would_ignore(
    log: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], name: str
) -> None:
    argv = ["replay", log, "--parallel", *(f.format(log=log, dir=tmp_path) for f in flags)]
    refused(capsys, argv, name, "--parallel")
    assert entries(tmp_path) == []


def test_parallel_flags_need_parallel(log: str, capsys: pytest.CaptureFixture[str]) -> None:
    refused(capsys, ["replay", log, "--num-cpus", "2"], "--num-cpus", "--parallel")
    refused(capsys, ["replay", log, "--address", "auto"], "--address", "--parallel")


@pytest.mark.parametrize("flag", ["--execute", "--no-defrag", "--against"])
def test_from_snapshot_refuses_other_modes_up_front(
    log: str, capsys: pytest.CaptureFixture[str], flag: str
) -> None:
    argv = ["replay", log, "--from-snapshot", flag, *([log] if flag == "--against" else [])]
    refused(capsys, argv, "--from-snapshot")


# -- --num-cpus below 1 --------------------------------------------------------------------
@pytest.mark.parametrize("cpus", ["0", "-1"])
def test_num_cpus_below_one_is_refused_not_a_hang(log: str, tmp_path: Path, cpus: str) -> None:
    """Run as the user does (a process with a timeout: the old code waited forever)."""
    for argv in (
        ["replay", log, "--parallel", "--num-cpus", cpus],
        ["sweep", log, "--out", str(tmp_path / "sw"), "--num-cpus", cpus],
    ):
        run = subprocess.run(
            [sys.executable, "-m", "kvlog.cli", *argv],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            cwd=ROOT,
        )
        assert run.returncode == 2, run.stderr
        assert "--num-cpus" in run.stderr and "Traceback" not in run.stderr
    assert entries(tmp_path) == []


def test_the_ray_pool_refuses_zero_cpus() -> None:
    from kvlog.analysis.pool import RayPool as _RayPool
    from kvlog.errors import ConfigError

    with pytest.raises(ConfigError, match="num_cpus"):
        _RayPool(None, 0)


# -- trace runs that cannot progress or end ------------------------------------------------
@pytest.mark.parametrize(
    ("flags", "name"),
    [
        (["--max-model-len", "1"], "--max-model-len"),
        (["--max-model-len", "-5"], "--max-model-len"),
        (["--num-gpu-blocks", "16", "--max-model-len", "4000"], "--max-model-len"),
        (["--max-num-seqs", "0"], "--max-num-seqs"),
        (["--time-scale", "1e9"], "--time-scale"),  # the last arrival after step 1,000,000
        (["--time-scale", "inf"], "--time-scale"),
        (["--step-ms", "nan"], "--step-ms"),
        (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens"),
    ],
)
def test_trace_runs_that_cannot_progress_are_refused_before_the_log(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], name: str
) -> None:
    out = str(tmp_path / "t.kvlog")
    refused(capsys, ["synth", "--out", out, "--trace", MOONCAKE, "--requests", "20", *flags], name)
    assert entries(tmp_path) == []


@pytest.mark.parametrize("kind", ["empty trace", "--requests 0"])
def test_a_trace_run_of_no_requests_is_refused_before_the_log(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    """A trace with no rows, or ``--requests 0``: a run that serves nothing is refused,
    and no log is left."""
    logs = tmp_path / "logs"
    logs.mkdir()
    out = str(logs / "t.kvlog")
    if kind == "empty trace":
        empty = tmp_path / "empty.jsonl"
        empty.write_text("\n")
        refused(capsys, ["synth", "--out", out, "--trace", str(empty)], "no requests")
    else:
        refused(
            capsys, ["synth", "--out", out, "--trace", MOONCAKE, "--requests", "0"], "--requests"
        )
    assert entries(logs) == []


def _trace(
    max_steps: int = 1_000_000, blocks: int = 512, **changes: object
) -> tuple[object, list[object]]:
    from kvlog.synth import SynthConfig, TraceConfig, read_trace

    synth = SynthConfig(num_gpu_blocks=blocks, block_size=128, max_num_seqs=8)
    config = TraceConfig(synth, "mooncake", max_steps=max_steps, **changes)  # type: ignore[arg-type]
    return config, list(read_trace(MOONCAKE, limit=20))


def test_a_trace_past_max_steps_is_refused_and_leaves_no_log(tmp_path: Path) -> None:
    from kvlog.errors import TraceError
    from kvlog.synth import run_trace

    config, requests = _trace(max_steps=120)  # arrivals fit (the last ~ step 105), serving not
    with pytest.raises(TraceError, match="did not finish within 120 steps"):
        run_trace(config, requests, tmp_path / "t.kvlog", sync="none")  # type: ignore[arg-type]
    assert entries(tmp_path) == []


def test_a_stalled_trace_run_is_refused_after_stall_steps() -> None:
    """The watchdog behind the up-front checks: a request larger than the pool (the check
    bypassed) stalls; refused after STALL_STEPS steps, not after a million."""
    from kvlog.errors import TraceError
    from kvlog.runtime.engine import Engine
    from kvlog.synth import TraceRun
    from kvlog.synth.serving import STALL_STEPS

    config, requests = _trace(blocks=64, max_model_len=200_000)  # the first: 34k tokens
    engine = Engine(config.synth.cache_config())  # type: ignore[attr-defined]
    run = TraceRun(config, requests, engine)  # type: ignore[arg-type]
    with pytest.raises(TraceError, match="no progress"):
        run.run()
    assert run.result.num_steps < 2 * STALL_STEPS


# -- untyped errors and tracebacks ---------------------------------------------------------
@pytest.mark.parametrize(
    ("flags", "name"),
    [
        (["--arrival-rate", "nan"], "--arrival-rate"),
        (["--arrival-rate", "inf"], "--arrival-rate"),
        (["--arrival-rate", "-1"], "--arrival-rate"),
        (["--prompt-len-mean", "nan"], "--prompt-len-mean"),
        (["--seed", "-1"], "--seed"),
        (["--num-prefixes", "-1"], "--num-prefixes"),
        (["--failure-rate", "2"], "--failure-rate"),
        (["--time-scale", "0.5"], "--time-scale"),  # a trace flag without --trace
    ],
)
def test_synth_values_that_crashed_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], name: str
) -> None:
    refused(capsys, ["synth", "--out", str(tmp_path / "s.kvlog"), *SMALL, *flags], name)
    assert entries(tmp_path) == []


@pytest.mark.parametrize(
    "argv",
    [
        ["synth", "--out", "{dir}/s.kvlog", "--ratio-limit", "inf", "--policy", "tail"],
        ["synth", "--out", "{dir}/s.kvlog", "--max-bytes-per-step", "inf"],
        ["sweep", "{log}", "--out", "{dir}/sw", "--budget", "inf"],
        ["sweep", "{log}", "--out", "{dir}/sw", "--policy", "foo"],
    ],
)
def test_argument_values_that_crashed_are_usage_errors(
    log: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main([a.format(dir=tmp_path, log=log) for a in argv])
    assert info.value.code == 2
    assert "Traceback" not in capsys.readouterr().err
    assert entries(tmp_path) == []


def test_report_to_an_unwritable_place_is_refused_before_the_replay(
    log: str, capsys: pytest.CaptureFixture[str]
) -> None:
    err = refused(capsys, ["replay", log, "--report", "/proc/kvlog-report.csv"], "--report")
    assert "writ" in err
    assert "replay speed" not in capsys.readouterr().out  # nothing was replayed


def test_sweep_without_matplotlib_is_refused_before_it_runs(
    log: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    refused(capsys, ["sweep", log, "--out", str(tmp_path / "sw"), "--serial"], "kvlog[plot]")
    assert entries(tmp_path) == []


def test_inspect_refuses_negative_bounds(log: str, capsys: pytest.CaptureFixture[str]) -> None:
    refused(capsys, ["inspect", log, "--from", "-5"], "--from")
    refused(capsys, ["inspect", log, "--to", "-3"], "--to")


def test_an_os_error_is_one_line_and_exit_2(
    log: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvlog.cli import inspect as cli_module

    def denied(path: str, **_: object) -> None:
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(cli_module, "LogReader", denied)
    refused(capsys, ["inspect", log], "Permission denied")


@pytest.mark.parametrize(
    ("text", "fmt"),
    [
        ('{"timestamp": 9' + "0" * 308 + ', "input_length": 5, "output_length": 1, '
         '"hash_ids": [1]}\n', "mooncake"),  # OverflowError
        ('{"timestamp": 1' + "0" * 307 + ', "input_length": 5, "output_length": 1, '
         '"hash_ids": [1]}\n', "mooncake"),  # a float, but not a time
        ("[" * 100_000 + "]" * 100_000 + "\n", "mooncake"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "x" * (128 << 10) + "x,1,1\n", "azure"),
    ],
)  # fmt: skip
def test_trace_rows_that_raised_untyped_errors_raise_trace_error_naming_the_line(
    tmp_path: Path, text: str, fmt: str
) -> None:
    from kvlog.errors import TraceError
    from kvlog.synth import read_trace

    path = tmp_path / f"t.{fmt}"
    path.write_text("\n" + text if fmt == "mooncake" else text, encoding="utf-8")
    with pytest.raises(TraceError, match=f"{path}:2"):
        read_trace(path, fmt)


# -- unsorted traces, repeated hash_ids ----------------------------------------------------
def _mooncake_rows(tmp_path: Path, rows: list[str]) -> Path:
    path = tmp_path / "m.jsonl"
    path.write_text("".join(r + "\n" for r in rows), encoding="utf-8")
    return path


def test_unsorted_trace_rows_are_served_in_arrival_order(tmp_path: Path) -> None:
    from kvlog.synth import read_trace

    row = '{{"timestamp": {t}, "input_length": {n}, "output_length": 2, "hash_ids": [{h}]}}'
    path = _mooncake_rows(
        tmp_path, [row.format(t=5000, n=10, h=1), row.format(t=1000, n=20, h=2),
                   row.format(t=3000, n=30, h=3)]
    )  # fmt: skip
    requests = read_trace(path)
    assert [r.arrival_s for r in requests] == [0.0, 2.0, 4.0]
    assert [r.input_len for r in requests] == [20, 30, 10]


def test_a_repeated_hash_id_is_refused_naming_the_line_and_nothing_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    row = '{"timestamp": 0, "input_length": 1000, "output_length": 2, "hash_ids": [7, 8]}'
    bad = '{"timestamp": 9, "input_length": 1000, "output_length": 2, "hash_ids": [4, 4]}'
    trace = _mooncake_rows(tmp_path, [row, bad])
    out = str(tmp_path / "t.kvlog")
    err = refused(capsys, ["synth", "--out", out, "--trace", str(trace), "--prefix-caching"])
    assert f"{trace}:2" in err and "hash_id" in err
    assert entries(tmp_path) == ["m.jsonl"]


# -- silently accepted values --------------------------------------------------------------
@pytest.mark.parametrize(
    ("flags", "name"),
    [
        (["--num-gpu-blocks", "0"], "num_gpu_blocks"),
        (["--block-size", "0"], "block_size"),
        (["--steps", "-10"], "--steps"),
        (["--max-bytes-per-step", "100"], "--max-bytes-per-step"),
        (["--ratio-limit", "1.2"], "--ratio-limit"),  # the seed policy ignores it
        (["--min-swaps", "2"], "--min-swaps"),
    ],
)
def test_values_that_were_silently_replaced_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], name: str
) -> None:
    refused(capsys, ["synth", "--out", str(tmp_path / "s.kvlog"), *SMALL, *flags], name)
    assert entries(tmp_path) == []


def test_a_ratio_limit_given_as_a_percent_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as info:
        kvlog("synth", "--out", str(tmp_path / "s"), "--policy", "tail", "--ratio-limit", "150")
    assert info.value.code == 2 and entries(tmp_path) == []


def test_ratio_limit_on_replay_needs_the_tail_policy(
    log: str, capsys: pytest.CaptureFixture[str]
) -> None:
    refused(capsys, ["replay", log, "--ratio-limit", "1.2"], "--ratio-limit")  # recorded: seed
    assert kvlog("replay", log, "--policy", "tail", "--ratio-limit", "1.2") == 0


def test_report_with_an_unknown_extension_is_refused(
    log: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    refused(capsys, ["replay", log, "--report", str(tmp_path / "out.pdf")], "--report", ".pdf")
    assert entries(tmp_path) == []


def test_a_bom_led_headerless_azure_trace_keeps_its_first_row(tmp_path: Path) -> None:
    from kvlog.synth import read_trace

    path = tmp_path / "a.csv"
    rows = "2023-11-16 18:15:46.5,374,44\n2023-11-16 18:15:47.5,396,109\n"
    path.write_bytes(b"\xef\xbb\xbf" + rows.encode())
    assert [r.input_len for r in read_trace(path)] == [374, 396]


@pytest.mark.parametrize("stamp", ['"12"', "true", "null"])
def test_a_mooncake_timestamp_must_be_a_json_number(tmp_path: Path, stamp: str) -> None:
    from kvlog.errors import TraceError
    from kvlog.synth import read_trace

    row = f'{{"timestamp": {stamp}, "input_length": 5, "output_length": 1, "hash_ids": [1]}}'
    with pytest.raises(TraceError, match=r":1: .*timestamp"):
        read_trace(_mooncake_rows(tmp_path, [row]))


# -- bad output places and empty runs ------------------------------------------------------
def test_replay_execute_that_checked_nothing_does_not_pass(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A trace run ends with every request finished: no live block to read at the end."""
    out = str(tmp_path / "t.kvlog")
    assert kvlog("synth", "--out", out, "--trace", MOONCAKE, "--requests", "5") == 0
    capsys.readouterr()
    assert kvlog("replay", out, "--execute") == 1
    captured = capsys.readouterr()
    assert "0 blocks read" in captured.out and "nothing was checked" in captured.err


def test_replay_execute_of_a_log_with_no_events_does_not_pass(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A log with its header only (the recorder opened it, no configuration came): no
    canary executor was ever made, so nothing was read."""
    out = tmp_path / "empty.kvlog"
    with LogWriter(out):
        pass
    assert kvlog("replay", str(out), "--execute") == 1
    assert "nothing was checked" in capsys.readouterr().err
    assert kvlog("replay", str(out)) == 0  # verifying it is fine: no checkpoint disagrees


def test_scheduler_vllm_without_vllm_is_refused_before_the_log(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "vllm.config", None)  # as where vLLM is not installed
    out = str(tmp_path / "t.kvlog")
    argv = ["synth", "--out", out, "--trace", MOONCAKE, "--requests", "3", "--scheduler", "vllm"]
    refused(capsys, argv, "kvlog[vllm]")
    assert entries(tmp_path) == []


def test_demo_does_not_delete_an_unrelated_demo_kvlog(
    log: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mine = tmp_path / "demo.kvlog"
    data = Path(log).read_bytes()
    mine.write_bytes(data)
    refused(capsys, ["demo", "--out", str(tmp_path), "--steps", "50"], str(mine))
    assert mine.read_bytes() == data and entries(tmp_path) == ["demo.kvlog"]
    mine.unlink()
    assert kvlog("demo", "--out", str(tmp_path), "--steps", "60") == 0
    assert kvlog("demo", "--out", str(tmp_path), "--steps", "60") == 0  # its own: replaced


def test_a_report_onto_the_log_itself_is_refused(
    log: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    csv_log = tmp_path / "X.csv"
    data = Path(log).read_bytes()
    csv_log.write_bytes(data)
    refused(capsys, ["replay", str(csv_log), "--report", str(csv_log)], "--report")
    assert csv_log.read_bytes() == data


# -- Ctrl-C --------------------------------------------------------------------------------
def test_keyboard_interrupt_exits_130_with_one_line(
    log: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvlog.cli import replay as cli_module

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_module, "replay", interrupted)
    assert kvlog("replay", log) == 130
    assert capsys.readouterr().err == "kvlog replay: interrupted\n"


def _interrupt_synth(out: Path, extra: list[str], grown: int) -> subprocess.CompletedProcess[str]:
    """``kvlog synth`` in a process of its own, SIGINT once its log holds ``grown`` bytes."""
    argv = [sys.executable, "-m", "kvlog.cli", "synth", "--out", str(out), *extra]
    proc = subprocess.Popen(
        argv,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # not inherited
    )
    deadline = time.monotonic() + 120
    while (not out.exists() or out.stat().st_size < grown) and proc.poll() is None:
        assert time.monotonic() < deadline, "the synth never wrote its log"
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(argv, proc.returncode, "", err)


@pytest.mark.parametrize(
    ("extra", "grown"),
    [
        (["--steps", "1000000", "--sync", "step"], 200_000),
        (["--steps", "1000000", "--sync", "always", "--num-cpu-blocks", "64"], 50_000),
        (["--steps", "1000000", "--execute", "--backend", "fake", "--num-cpu-blocks", "64"], 1),
        (["--trace", MOONCAKE, "--num-gpu-blocks", "300", "--num-cpu-blocks", "64"], 1),
    ],
)
def test_sigint_exits_130_and_the_cut_log_verifies(
    tmp_path: Path, extra: list[str], grown: int
) -> None:
    out = tmp_path / "s.kvlog"
    done = _interrupt_synth(out, extra, grown)
    assert done.returncode == 130, done.stderr
    assert done.stderr == "kvlog synth: interrupted\n"
    assert kvlog("replay", str(out)) == 0


def test_report_onto_a_directory_is_refused_not_renamed(
    log: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "r").mkdir()
    refused(capsys, ["replay", log, "--report", str(tmp_path / "r")], "--report", "directory")
    assert entries(tmp_path) == ["r"] and entries(tmp_path / "r") == []


def test_a_negative_request_count_names_its_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = str(tmp_path / "t.kvlog")
    refused(capsys, ["synth", "--out", out, "--trace", MOONCAKE, "--requests", "-1"], "--requests")
    assert entries(tmp_path) == []


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


def test_against_a_log_without_cache_configured_is_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A refusal in one line, exit 2, no traceback (it once ended in an AssertionError)."""
    good, bad = tmp_path / "good.kvlog", tmp_path / "bad.kvlog"
    busy_engine(good).close()
    with LogWriter(bad, "none") as writer:
        writer.append(StepEnded(0))
    assert main(["replay", str(good), "--against", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "does not start with CacheConfigured" in err and "Traceback" not in err
    assert replay(good, against=good).ok

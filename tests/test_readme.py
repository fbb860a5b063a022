"""Every command the README and the manual in ``docs/`` show runs as written.

The commands are read from the pages' fenced ``bash`` blocks, their indented command
listings and their inline code spans. Every ``kvlog`` flag shown must exist on its command;
every script, test file and requirements file named must exist, with the flags shown;
and the ``kvlog`` commands with no placeholder left (LOG, FILE, DIR, ...) run for real,
on small inputs: the shared traces become the slices in ``tests/data`` (first 40
requests), log paths a temporary directory, and a sweep runs ``--serial`` (the Ray path
has its own test in ``test_sweep.py``). The setup, test, dependency floors and real-vLLM
stage lines are what ``.ci/run`` runs itself, read from the README as ``.ci/run`` reads them.
Every relative link of the pages leads to a file of the repository.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
from pathlib import Path

import pytest

from kvlog.cli import build_parser, main

ROOT = Path(__file__).resolve().parent.parent
PAGES = {
    path.relative_to(ROOT).as_posix(): path.read_text(encoding="utf-8")
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
}
README = PAGES["README.md"]
DATA = ROOT / "tests" / "data"
TRACES = {
    "../shared/traces/mooncake_synthetic_trace.jsonl": DATA
    / "mooncake_synthetic_trace_3601-3800.jsonl",
    "../shared/traces/AzureLLMInferenceTrace_conv.csv": DATA
    / "AzureLLMInferenceTrace_conv_head300.csv",
}
PLACEHOLDERS = re.compile(r"\b(LOG|FILE|DIR|OTHER|NAME|N|T|S|E)\b|\.\.\.|\[|\||FILE\.png")
FOREIGN = {"pip", "python3", "ruff", "mypy", "vllm", ".", "head"}
"""Programs whose flags are not kvlog's (their lines are what ``.ci/run`` runs)."""


def _fenced(page: str) -> list[str]:
    """Commands of the ``bash`` blocks: continuation lines joined, comments dropped."""
    out = []
    for block in re.findall(r"^```bash\n(.*?)^```", page, re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  # ")[0].strip()
            if line:
                out.append(line)
    return out


def _listed(page: str) -> list[str]:
    """Commands of the indented listings (``    kvlog demo    what it does``): the first
    column, with a backslash-continued next line joined."""
    out = []
    lines = page.splitlines()
    for i, line in enumerate(lines):
        if re.match(r"^    (kvlog|python) ", line):
            command = re.split(r"\s{2,}", line.strip())[0]
            if command.endswith("\\"):
                command = command[:-1] + " " + lines[i + 1].strip()
            out.append(command)
    return out


def _inline(page: str) -> list[str]:
    """Inline code spans that are commands (they may wrap onto the next line)."""
    prose = re.sub(r"^```.*?^```", "", page, flags=re.S | re.M)
    spans = [" ".join(s.split()) for s in re.findall(r"`([^`]{1,400})`", prose)]
    return [s for s in spans if re.match(r"(kvlog|python) ", s)]


def _inline_flags(page: str) -> list[str]:
    """Flags named alone in inline code spans (``--threshold 8,16,32``)."""
    prose = re.sub(r"^```.*?^```", "", page, flags=re.S | re.M)
    spans = re.findall(r"`(--[a-z][^`]{0,200})`", prose)
    return [s.split()[0].split("=")[0] for s in spans]


def _commands(page: str) -> list[str]:
    return list(dict.fromkeys(_fenced(page) + _listed(page) + _inline(page)))


COMMANDS = list(dict.fromkeys(c for page in PAGES.values() for c in _commands(page)))


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return {"": parser, **action.choices}
    raise AssertionError("kvlog has no subcommands")


SUBCOMMANDS = _subparsers()
ALL_FLAGS = {flag for p in SUBCOMMANDS.values() for a in p._actions for flag in a.option_strings}


def _flags(text: str) -> list[str]:
    """``--a/--b/--c`` and ``--x=1`` count as flags ``--a``, ``--b``, ``--c``, ``--x``."""
    found = re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text)
    return list(dict.fromkeys(found))


def _parts(command: str) -> list[str]:
    """A shell line cut at ``&&``, `` | `` and ``;``, each part without leading VAR=value
    (a ``|`` between alternatives, ``mooncake|azure``, stays)."""
    parts = []
    for part in re.split(r"&&|\s\|\s|;", command):
        words = part.split()
        while words and re.match(r"^[A-Z_]+=", words[0]):
            words.pop(0)
        if words:
            parts.append(" ".join(words))
    return parts


def _script_flags(path: Path) -> set[str]:
    return set(re.findall(r"\"(--[a-z][a-z0-9-]*)\"", path.read_text(encoding="utf-8")))


def test_the_pages_show_the_commands_this_test_reads() -> None:
    # a broken reader would make every test below vacuous: each page's known commands
    known = {
        "README.md": ("kvlog demo", "kvlog --version", "python3 -m venv .venv-vllm"),
        "docs/benchmarks.md": ("python bench/bench_step.py", "python bench/bench_facade.py"),
        "docs/sweeps.md": ("kvlog synth --trace", "kvlog sweep mooncake.kvlog azure.kvlog"),
        "docs/logs.md": ("kvlog ranks LOG LOG", "kvlog replay LOG --salvage"),
        "docs/vllm.md": ("kvlog replay /var/log/kvlog/", "python tests/vllm_harness.py"),
        "docs/cpu-tier.md": ("kvlog sweep ../shared/traces/", "python -m kvlog.tier.synth"),
        "docs/testing.md": ("HYPOTHESIS_PROFILE=fuzz pytest", "python fuzz/campaign.py all"),
        "docs/cli.md": ("kvlog inspect LOG", "kvlog ranks LOG LOG"),
    }
    for page, commands in known.items():
        shown = _commands(PAGES[page])
        for expected in commands:
            assert any(c.startswith(expected) for c in shown), f"{page}: {expected}"
    assert len(COMMANDS) >= 40


def _ci_command(heading: str) -> str:
    """The first line of the first ``bash`` block after ``heading``, as ``.ci/run`` reads it."""
    after = README.split(f"\n{heading}\n", 1)[1]
    return after.split("```bash\n", 1)[1].splitlines()[0]


def test_ci_reads_its_commands_from_the_readme() -> None:
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    for heading in ("### The real-vLLM stage", "### The dependency floors"):
        assert f"/^{heading}$/" in ci, heading
        assert _ci_command(heading) in COMMANDS, heading
    first = re.findall(r"^```bash\n(.*?)^```", README, re.S | re.M)[0].splitlines()
    assert first[0].endswith("kvlog demo") and first[1].endswith("pytest"), first
    assert _ci_command("### The real-vLLM stage").startswith("python3 -m venv .venv-vllm")
    assert "PYTHONPATH=.floors pytest" in _ci_command("### The dependency floors")


def test_ci_runs_a_stage_per_other_supported_vllm() -> None:
    """Every supported vLLM but the real-vLLM stage's has a line of its own in the README's
    "vLLM version stages" block, installing that release's nodeps file (issue 30)."""
    from kvlog.integrations import SUPPORTED_VLLM

    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "/^### The vLLM version stages$/" in ci
    block = README.split("\n### The vLLM version stages\n", 1)[1].split("```bash\n", 1)[1]
    lines = block.split("\n```", 1)[0].splitlines()
    main = re.search(r"vllm==(\d+\.\d+)", (ROOT / ".ci" / "vllm-nodeps.txt").read_text())
    assert main is not None
    others = [v.rsplit(".", 1)[0] for v in SUPPORTED_VLLM if not v.startswith(main[1] + ".")]
    assert len(lines) == len(others) >= 2
    for minor, line in zip(others, lines, strict=True):
        nodeps = f".ci/vllm-{minor}-nodeps.txt"
        assert f"-r {nodeps}" in line and line in COMMANDS, line
        assert f"vllm=={minor}." in (ROOT / nodeps).read_text(encoding="utf-8")


@pytest.mark.parametrize("page", sorted(PAGES))
def test_every_link_leads_to_a_file(page: str) -> None:
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", PAGES[page]):
        assert ((ROOT / page).parent / target).exists(), f"{page}: {target}"


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_and_file_shown_exists(command: str) -> None:
    for part in _parts(command):
        program, *rest = part.split()
        if program == "kvlog":
            sub = rest[0] if rest and not rest[0].startswith("-") else ""
            assert sub in SUBCOMMANDS, f"kvlog has no command {sub!r}: {command}"
            known = {f for a in SUBCOMMANDS[sub]._actions for f in a.option_strings}
            for flag in _flags(part):
                assert flag in known, f"kvlog {sub} has no {flag}: {command}"
        elif program in ("python", "pytest"):
            files = [w for w in rest if w.endswith(".py")]
            for name in files:
                assert (ROOT / name).is_file(), f"{name} does not exist: {command}"
            if program == "python" and files:
                flags = _script_flags(ROOT / files[0])
                for flag in _flags(part):
                    assert flag in flags, f"{files[0]} has no {flag}: {command}"
        else:
            assert program in FOREIGN or program.startswith("."), f"unknown program: {part}"
            for name in re.findall(r"-r (\S+)", part):
                assert (ROOT / name).is_file(), f"{name} does not exist: {command}"


def test_every_flag_named_in_the_prose_exists() -> None:
    harness = _script_flags(ROOT / "tests" / "vllm_harness.py")
    benches = set().union(*(_script_flags(p) for p in (ROOT / "bench").glob("*.py")))
    foreign = {"--kv-transfer-config", "--hypothesis-show-statistics", "--no-deps"}
    for flag in (f for page in PAGES.values() for f in _inline_flags(page)):
        assert flag in ALL_FLAGS | harness | benches | foreign, f"no command has {flag}"


def _runnable(command: str, tmp: Path) -> list[str] | None:
    """The command as argv for ``kvlog.cli.entry.main`` with the README's paths made small and
    local, or None while a placeholder is left in it."""
    if not command.startswith("kvlog ") or "|" in command.replace("|.", ""):
        command = command.split(" | ")[0]
        if not command.startswith("kvlog "):
            return None
    for shared, local in TRACES.items():
        command = command.replace(shared, f"{local} --requests 40")
    command = command.replace("/var/log/kvlog/worker-1234.kvlog", str(tmp / "azure.kvlog"))
    if PLACEHOLDERS.search(command) or "--parallel" in command:
        return None
    argv = shlex.split(command)[1:]
    if len(argv) == 1 and argv[0] in ("synth", "replay", "inspect", "sweep", "ranks", "top"):
        return None  # the command's name in a sentence ("as `kvlog synth` does")
    if argv[0] in ("replay", "inspect", "sweep", "ranks", "top") and not any(
        word.endswith(".kvlog") or "/" in word for word in argv[1:]
    ):
        return None  # a flag named in a sentence ("`kvlog replay --report`"): no log to read
    for i, word in enumerate(argv):
        if word.endswith(".kvlog") and "/" not in word:
            argv[i] = str(tmp / word)
    if argv[:1] in (["demo"], ["sweep"]) and "--out" in argv:
        argv[argv.index("--out") + 1] = str(tmp / argv[0])
    elif argv[:1] == ["demo"]:
        argv += ["--out", str(tmp / "demo")]
    if argv[:1] == ["demo"]:
        argv += ["--steps", "150"]
    if argv[:1] == ["sweep"]:
        argv += ["--serial"]
    return argv


def test_the_commands_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    order = {"synth": 0, "demo": 0, "replay": 1, "inspect": 1, "sweep": 2}
    runs = [argv for c in COMMANDS if (argv := _runnable(c, tmp_path)) is not None]
    runs.sort(key=lambda argv: order.get(argv[0], 1) if argv else 1)
    ran = []
    for argv in runs:
        if argv == ["--version"]:
            with pytest.raises(SystemExit) as exit_:
                main(argv)
            assert exit_.value.code == 0
        else:
            assert main(argv) == 0, f"kvlog {' '.join(argv)}: {capsys.readouterr()}"
        ran.append(argv[0] if argv else "")
    assert {"demo", "synth", "replay", "inspect", "sweep", "--version"} <= set(ran), ran
    assert os.path.exists(tmp_path / "sweep" / "sweep.png")

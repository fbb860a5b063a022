"""SIGKILL a writer mid-append, many times: every record it reported durable survives.

Each child (forked by the server in ``log_child_writer.py``) appends a deterministic
record stream with ``sync="step"`` or ``"always"`` and reports each durable sequence
number on a pipe; the test kills it at a random moment, then reopens the log.
"""

from __future__ import annotations

import itertools
import os
import random
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from log_child_writer import record_stream

import kvlog
from kvlog.events import StepEnded
from kvlog.log import LogReader, LogWriter

NUM_KILLS = 24
TIMEOUT_S = 30.0


class ForkServer:
    """The test's end of ``log_child_writer.py serve``: commands out, lines back."""

    def __init__(self) -> None:
        script = Path(__file__).with_name("log_child_writer.py")
        root = str(Path(kvlog.__file__).parent.parent)  # the children import this kvlog
        path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
        self.process = subprocess.Popen(
            [sys.executable, str(script), "serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": path},
        )
        assert self.process.stdin is not None and self.process.stdout is not None
        self._stdin = self.process.stdin
        self._fd = self.process.stdout.fileno()
        self._pending = b""

    def send(self, line: str) -> None:
        self._stdin.write(line.encode() + b"\n")
        self._stdin.flush()

    def lines(self) -> Iterator[str]:
        """Lines from the server and its children, failing the test on a long silence."""
        while True:
            while b"\n" in self._pending:
                line, self._pending = self._pending.split(b"\n", 1)
                yield line.decode()
            ready, _, _ = select.select([self._fd], [], [], TIMEOUT_S)
            assert ready, "fork server or child writer went silent"
            chunk = os.read(self._fd, 1 << 16)
            assert chunk, "fork server exited"
            self._pending += chunk

    def close(self) -> None:
        self._stdin.close()
        self.process.wait(timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def server() -> Iterator[ForkServer]:
    fork_server = ForkServer()
    yield fork_server
    fork_server.close()


def _kill_during_appends(server: ForkServer, path: Path, sync: str, seed: int) -> list[int]:
    """Run one child, SIGKILL it after a random number of syncs plus a random delay;
    return the sequence numbers it reported as durable."""
    rng = random.Random(seed)
    server.send(f"run {path} {sync} {seed}")
    lines = server.lines()
    synced: list[int] = []
    pid = -1
    wanted = rng.randint(1, 16)
    for line in lines:
        fields = line.split()
        assert len(fields) == 2, f"unexpected output from the fork server or a child: {line!r}"
        kind, value = fields
        if kind == "pid":
            pid = int(value)
        else:
            synced.append(int(value))
        if pid > 0 and len(synced) >= wanted:
            break
    time.sleep(rng.uniform(0.0, 0.004))
    os.kill(pid, signal.SIGKILL)
    server.send(f"reap {pid}")
    for line in lines:
        kind, *values = line.split()
        if kind == "reaped":
            assert int(values[0]) == pid
            break
        synced.append(int(values[0]))
    return synced


@pytest.mark.parametrize("sync", ["step", "always"])
def test_sigkill_keeps_every_synced_record(server: ForkServer, tmp_path: Path, sync: str) -> None:
    num_torn = 0
    for run in range(NUM_KILLS // 2):
        seed = run * 2 + (sync == "always")
        path = tmp_path / f"killed-{seed}.kvlog"
        synced = _kill_during_appends(server, path, sync, seed)
        assert synced, "the child reported nothing durable"
        assert synced == sorted(synced)

        reader = LogReader(path)
        got = list(reader)
        expected = list(itertools.islice(record_stream(seed), len(got)))
        assert [seq for seq, _ in got] == list(range(len(got)))
        assert [record for _, record in got] == expected  # a prefix of what it appended
        assert synced[-1] < len(got), f"durable record {synced[-1]} lost ({len(got)} kept)"
        if sync == "step":
            assert all(isinstance(expected[seq], StepEnded) for seq in synced)
        num_torn += reader.tail is not None

        with LogWriter(path, sync="none") as writer:
            assert writer.next_seq == len(got)
            assert writer.recovery == reader.tail
            writer.append(StepEnded(-1))
        assert LogReader(path).records(len(got)).__next__() == (len(got), StepEnded(-1))
    print(f"{sync}: {num_torn} of {NUM_KILLS // 2} kills left a torn tail")

"""A fork server for the SIGKILL tests: ``log_child_writer.py serve`` forks writers that
report each durable sequence number; the tests kill them at random moments."""

from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import kvlog

__all__ = ["TIMEOUT_S", "ForkServer", "kill_during_appends"]

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
        assert self.process.stdout is not None
        self.process.stdout.close()


def kill_during_appends(server: ForkServer, path: Path, sync: str, seed: int) -> list[int]:
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

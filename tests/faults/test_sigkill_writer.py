"""SIGKILL a writer mid-append, many times: every record it reported durable survives.

Each child (forked by the server in ``log_child_writer.py``) appends a deterministic
record stream with ``sync="step"`` or ``"always"`` and reports each durable sequence
number on a pipe; the test kills it at a random moment, then reopens the log.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvlog.events import StepEnded
from kvlog.log import LogReader, LogWriter
from tests.support.fork_server import ForkServer, kill_during_appends
from tests.support.log_child_writer import record_stream

NUM_KILLS = 24


@pytest.fixture(scope="module")
def server() -> Iterator[ForkServer]:
    fork_server = ForkServer()
    yield fork_server
    fork_server.close()


@pytest.mark.parametrize("sync", ["step", "always"])
def test_sigkill_keeps_every_synced_record(server: ForkServer, tmp_path: Path, sync: str) -> None:
    num_torn = 0
    for run in range(NUM_KILLS // 2):
        seed = run * 2 + (sync == "always")
        path = tmp_path / f"killed-{seed}.kvlog"
        synced = kill_during_appends(server, path, sync, seed)
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

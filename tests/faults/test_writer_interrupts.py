"""A KeyboardInterrupt at any line of the writer leaves a usable or a poisoned writer and
a log that reopens as a prefix of what was appended.

``sys.settrace`` raises ``KeyboardInterrupt`` at the k-th line event inside
``kvlog/log/writer.py`` (this thread only), for k = 1, 2, ... until the operation runs
through without reaching it, on each sync mode and each operation (a plain append, a
step-ending append, a checkpoint split into snapshot parts, ``flush``, ``close``). After
each interrupt the writer must be either usable, with the record wholly there or wholly
absent, or poisoned (appends raise ``LogPoisoned``; ``close()`` writes nothing more but
releases the fd and its lock); the file must reopen and read back as a prefix of what was
appended.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

import kvlog.log.writer as writer_module
from kvlog.errors import LogPoisoned, RecordRejected
from kvlog.events import BlocksAllocated, Checkpoint, Record, StepEnded
from kvlog.log import SYNC_MODES, LogReader, LogWriter

WRITER_FILE = writer_module.__file__
PREFIX: list[Record] = [BlocksAllocated("r0", [1, 2]), StepEnded(0), BlocksAllocated("r1", [3])]
AFTER = StepEnded(9)
BIG = Checkpoint(seq=3, digest="ab" * 32, step=1, snapshot=bytes(range(200)))
MAX_K = 2000


class Interrupter:
    """A trace function raising KeyboardInterrupt at the k-th line event in writer.py."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.count = 0

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename != WRITER_FILE:
            return None
        return self._local

    def _local(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line":
            self.count += 1
            if self.count == self.k:
                raise KeyboardInterrupt(f"line event {self.k}")
        return self._local

    @property
    def fired(self) -> bool:
        return self.count >= self.k


def _operations() -> dict[str, tuple[Callable[[LogWriter], object], Record | None]]:
    """name: (the interrupted call, the record it appends or None)."""
    small = BlocksAllocated("r2", [4, 5])
    return {
        "append": (lambda w: w.append(small), small),
        "append_step": (lambda w: w.append(StepEnded(1)), StepEnded(1)),
        "append_parts": (lambda w: w.append(BIG), BIG),
        "flush": (lambda w: w.flush(), None),
        "close": (lambda w: w.close(), None),
    }


def _read(path: Path) -> list[Record]:
    got = list(LogReader(path))
    seqs = [seq for seq, _ in got]  # snapshot parts take seqs the reader does not yield
    assert seqs == sorted(set(seqs)), f"sequence numbers out of order: {seqs}"
    return [record for _, record in got]


def _is_prefix(got: list[Record], appended: list[Record]) -> bool:
    return got == appended[: len(got)]


def _check_after(writer: LogWriter, path: Path, appended: list[Record]) -> None:
    """The invariants after an interrupt (the tracer is off again); ``appended`` ends
    with the interrupted call's record, if it has one."""
    if writer.poisoned:
        with pytest.raises(LogPoisoned):
            writer.append(AFTER)
        size = path.stat().st_size
        writer.close()
        assert path.stat().st_size == size, "a poisoned writer wrote on close"
    elif writer.closed:  # an interrupted close: the next one only releases the fd
        writer.close()
    else:  # usable: the record wholly there or wholly absent
        writer.append(AFTER)
        writer.close()
        got = _read(path)
        assert got in ([*PREFIX, AFTER], [*appended, AFTER]), got
        appended = got
    assert writer._fd == -1, "the fd was not released"
    with LogWriter(path, "none"):  # reopens (torn tail cut at most) and the lock is free
        pass
    assert _is_prefix(_read(path), appended)


def _run_once(tmp_path: Path, sync: str, op: str, k: int) -> bool:
    """One interrupted run; False when the operation finished before the k-th line."""
    call, record = _operations()[op]
    path = tmp_path / f"{sync}-{op}-{k}.kvlog"
    writer = LogWriter(path, sync, buffer_bytes=64)  # type: ignore[arg-type]
    for prefix_record in PREFIX:
        writer.append(prefix_record)
    tracer, outer = Interrupter(k), sys.gettrace()  # outer: coverage's, if any
    sys.settrace(tracer)
    try:
        call(writer)
    except KeyboardInterrupt:
        pass
    finally:
        sys.settrace(outer)
    if not tracer.fired:
        writer.close()
        return False
    _check_after(writer, path, [*PREFIX, record] if record is not None else list(PREFIX))
    os.unlink(path)
    return True


@pytest.mark.parametrize("op", sorted(_operations()))
@pytest.mark.parametrize("sync", SYNC_MODES)
def test_interrupt_at_every_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sync: str, op: str
) -> None:
    monkeypatch.setattr(writer_module, "SNAPSHOT_PART_BYTES", 64)  # BIG: 4 parts
    for k in range(1, MAX_K):
        if not _run_once(tmp_path, sync, op, k):
            break
    else:
        pytest.fail(f"{op} still hit line event {MAX_K}")
    assert k > 5, f"{op} ran only {k - 1} writer lines: is the tracer filtering the right file?"
    print(f"{sync} {op}: interrupted at each of {k - 1} line events")


def test_rejected_checkpoint_takes_back_its_parts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint that does not encode after its parts were framed leaves none of them
    (parts without their checkpoint, followed by more records, would be corruption)."""
    monkeypatch.setattr(writer_module, "SNAPSHOT_PART_BYTES", 64)
    path = tmp_path / "a.kvlog"
    with LogWriter(path, "step") as writer:
        writer.append(PREFIX[0])
        bad = Checkpoint(seq=0, digest="\ud800", step=0, snapshot=bytes(200))
        with pytest.raises(RecordRejected):
            writer.append(bad)
        assert not writer.poisoned and writer.next_seq == 1
        writer.append(AFTER)
    assert _read(path) == [PREFIX[0], AFTER]

"""Failure isolation: a writer whose disk failed is let go, and its log marked where it stopped.

A recorder must never take serving down. When an append, fsync, seal or close of the log fails
with an I/O error (``LogPoisoned``), an Engine built with ``on_log_error="detach"`` (the facades
and the connector build theirs so) calls ``detach_writer``: the failed writer's descriptor and
lock are released, and the log (a directory's open segment) is reopened to append a
``LogDetached`` record and close cleanly, where the disk still allows (cutting a torn tail
first frees what the failed write took; the record is tens of bytes). What the log then holds
replays and verifies up to the gap; readers report the gap (``LogReader.gaps``).
``LogStatus`` is what ``Engine.log_status()`` says about its recorder.
"""

from __future__ import annotations

import logging

import msgspec

from kvlog.log.format import LogDetached
from kvlog.log.segments import SegmentedWriter
from kvlog.log.writer import LogWriter

__all__ = ["LogStatus", "detach_writer", "error_errno"]

_logger = logging.getLogger("kvlog")


class LogStatus(msgspec.Struct, frozen=True):
    """Where an Engine's recorder stands.

    ``path``: the log (None: the engine records no log); ``attached``: records still go to
    it; ``error``: the I/O error it detached on ('' while attached) and its ``errno``;
    ``num_errors``: I/O errors met (0 or 1: the recorder detaches at the first);
    ``gap_marked``: a ``LogDetached`` record ends the log; ``last_seq``: the last record
    known appended before the detach (or now)."""

    path: str | None
    attached: bool
    error: str = ""
    errno: int = 0
    num_errors: int = 0
    gap_marked: bool = False
    last_seq: int = -1


def error_errno(error: BaseException) -> int:
    """The OS error number behind ``error`` (its cause's), or 0."""
    seen: BaseException | None = error
    while seen is not None:
        code = getattr(seen, "errno", None)
        if isinstance(code, int) and code > 0:
            return code
        seen = seen.__cause__
    return 0


def _error_text(error: BaseException) -> str:
    cause = error.__cause__
    return str(cause) if isinstance(cause, OSError) else str(error)


def detach_writer(writer: LogWriter | SegmentedWriter, error: BaseException) -> bool:
    """Release a failed writer and append a ``LogDetached`` record to its log (a
    directory's open segment) if the disk allows; whether the record was written. Never
    raises an ``Exception`` (an interrupt goes through)."""
    path = writer.path if isinstance(writer, LogWriter) else writer.active_path
    try:
        writer.abandon()  # poisoned: only releases the descriptor and its lock
    except Exception as exc:  # the buffered records may not make it: they are in the gap
        _logger.debug("%s: abandoning the failed writer: %s", writer.path, exc)
    if path is None:
        return False
    record = LogDetached(_error_text(error), error_errno(error))
    marked = False
    try:
        with LogWriter(path, sync="always") as marker:
            marker.append_detached(record)  # written and fsynced, or raises
            marked = True
    except Exception as exc:  # the close record after it may not fit: the log ends torn
        _logger.debug("%s: cannot mark the gap or close after it: %s", path, exc)
    return marked

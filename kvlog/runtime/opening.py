"""How the Engine opens its log: the options of a log directory (:class:`LogOptions`) and
their checks, a new or continued log's writer (a file or a directory of segments), and the
checks a resume makes (the snapshot handed back is the state at the log's end)."""

from __future__ import annotations

import os
import typing
from typing import TYPE_CHECKING, Literal

from kvlog import reducers
from kvlog.errors import (
    ConfigError,
    LogNotFound,
)
from kvlog.events import (
    Checkpoint,
)
from kvlog.log import (
    DEFAULT_SYNC_INTERVAL_S,
    LogReader,
    LogWriter,
    SegmentedWriter,
    SyncMode,
    is_log_directory,
    list_segments,
)
from kvlog.log.segments import DEFAULT_SEGMENT_BYTES, MIN_SEGMENT_BYTES
from kvlog.reducers import checkpoint
from kvlog.runtime.fold import checkpoint_digest, state_at_end

__all__ = [
    "LogOptions",
    "OnLogError",
    "Writer",
    "check_log_options",
    "check_snapshot_of",
    "last_event_seq",
    "open_existing",
    "open_writer",
    "segmented",
    "wants_directory",
]

if TYPE_CHECKING:
    pass

OnLogError = Literal["raise", "detach"]


Writer: typing.TypeAlias = "LogWriter | SegmentedWriter"


class LogOptions(typing.NamedTuple):
    """How the Engine's log is kept beyond ``sync``: segments for a log directory
    (``segment_bytes``, ``retain_bytes``, ``retain_seconds``, ``compress``; see
    ``kvlog.log.segments``) and what an I/O error does (``on_log_error``: ``"raise"``,
    ``LogPoisoned`` out of the call; ``"detach"``, the recorder detaches and the engine goes
    on in memory, see ``Engine.log_status``)."""

    segment_bytes: int | None = None
    retain_bytes: int | None = None
    retain_seconds: float | None = None
    compress: bool = False
    on_log_error: OnLogError = "raise"


def open_existing(
    path: str | os.PathLike[str],
    sync: SyncMode,
    sync_interval_s: float = DEFAULT_SYNC_INTERVAL_S,
    options: LogOptions | None = None,
) -> Writer:
    """The writer of a log that must exist already (``LogNotFound`` otherwise; nothing is
    created). Opening locks it and cuts a torn tail."""
    if not os.path.lexists(path) or (os.path.isfile(path) and os.path.getsize(path) == 0):
        raise LogNotFound(2, f"{os.fspath(path)}: no log to continue")
    options = options or LogOptions()
    check_log_options(options, path)
    if os.path.isdir(path) and not list_segments(os.fspath(path)):
        raise LogNotFound(2, f"{os.fspath(path)}: a directory with no log segments to continue")
    return open_writer(path, sync, sync_interval_s, options, meta=None, new=False)


def open_writer(
    path: str | os.PathLike[str],
    sync: SyncMode,
    sync_interval_s: float,
    options: LogOptions,
    *,
    meta: dict[str, str] | None,
    new: bool,
) -> Writer:
    """A ``SegmentedWriter`` for a log directory (see ``wants_directory``), else a
    ``LogWriter``."""
    if not wants_directory(path, options):
        return LogWriter(path, sync=sync, meta=meta, new=new, sync_interval_s=sync_interval_s)
    return SegmentedWriter(
        path,
        sync,
        meta=meta,
        new=new,
        sync_interval_s=sync_interval_s,
        segment_bytes=options.segment_bytes or DEFAULT_SEGMENT_BYTES,
        retain_bytes=options.retain_bytes,
        retain_seconds=options.retain_seconds,
        compress=options.compress,
    )


def check_log_options(options: LogOptions, path: str | os.PathLike[str] | None) -> None:
    """``ConfigError`` for a bad option, or a segment option for a log that is one file."""
    if options.on_log_error not in ("raise", "detach"):
        raise ConfigError("on_log_error", options.on_log_error, "'raise' or 'detach'")
    if type(options.compress) is not bool:
        raise ConfigError("compress", options.compress, "a bool")
    bounds = [("segment_bytes", options.segment_bytes, MIN_SEGMENT_BYTES)]
    bounds += [("retain_bytes", options.retain_bytes, 0)]
    for name, value, low in bounds:
        if value is not None and (type(value) is not int or value < low):
            raise ConfigError(name, value, f"an int >= {low} (bytes)")
    seconds = options.retain_seconds
    if seconds is not None and (type(seconds) not in (int, float) or not seconds >= 0):
        raise ConfigError("retain_seconds", seconds, "a number of seconds >= 0")
    if path is not None and segmented(options) and not wants_directory(path, options):
        raise ConfigError(
            "log_path",
            os.fspath(path),
            "a log directory (a directory, a path ending in '/', or a path not there yet) for "
            "segment, retention and compression options, not a file",
        )


def segmented(options: LogOptions) -> bool:
    """Whether any option of a log directory is set."""
    segment = options.segment_bytes, options.retain_bytes, options.retain_seconds
    return options.compress or any(v is not None for v in segment)


def wants_directory(path: str | os.PathLike[str], options: LogOptions) -> bool:
    """A log directory: an existing directory, a path ending in ``/``, or a path not there
    yet given with a segment option (``Engine(config, "logs", segment_bytes=...)``)."""
    return is_log_directory(path) or (segmented(options) and not os.path.lexists(path))


def check_snapshot_of(path: str, state: reducers.State, last: int) -> None:
    """``ConfigError`` unless ``state`` is the state at the end of the log at ``path``
    (whose last event is ``last``): a snapshot of another log, or of another point of this
    one, would make the continued log one that no longer replays."""
    final: Checkpoint | None = None
    for _, record in LogReader(path).records():
        if type(record) is Checkpoint:
            final = record
    if final is not None and final.seq == last:
        expected, actual = final.digest, checkpoint_digest(state, final.digest)
    else:  # the log ends past its last checkpoint (a crash): its end, replayed
        expected = checkpoint.checkpoint_digest(state_at_end(path)[0])
        actual = checkpoint.checkpoint_digest(state)
    if actual != expected:
        raise ConfigError(
            "blob",
            f"<snapshot with digest {actual}>",
            f"a snapshot of the state at the end of {path} (digest {expected})",
        )


def last_event_seq(path: str | os.PathLike[str]) -> int:
    """Sequence number of the last event in a log (-1 when it holds none)."""
    last = -1
    for seq, record in LogReader(path).records():
        if not isinstance(record, Checkpoint):
            last = seq
    return last

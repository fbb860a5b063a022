"""The durable log: an append-only file of CRC-framed, sequence-numbered records.

``LogWriter`` appends (buffered, group commit at each step's end, fsynced inline or by a
background thread) and recovers a torn tail on reopen; ``LogReader`` / ``read_log`` stream
records back and never modify the file.
The byte format is in ``kvlog.log.format``; the torn-tail-versus-corruption rule in
``kvlog.log.scan``. A log is one file or a directory of segments (``kvlog.log.manifest``,
written by ``SegmentedWriter``); every reader takes either. ``latest_snapshot`` finds the
latest snapshot (O(segments) in a directory); ``kvlog.log.detach`` lets a failed writer go.
"""

from kvlog.log.detach import LogStatus, detach_writer
from kvlog.log.format import (
    FORMAT_VERSION,
    MAGIC,
    MAX_RECORD_BYTES,
    LogDetached,
    LogHeader,
    Recovery,
)
from kvlog.log.manifest import is_log_directory, list_segments
from kvlog.log.reader import DamagedRange, LogReader, check_log, read_header, read_log
from kvlog.log.segments import DEFAULT_SEGMENT_BYTES, SegmentedWriter
from kvlog.log.snapshots import first_snapshot, latest_snapshot
from kvlog.log.writer import (
    DEFAULT_SYNC_INTERVAL_S,
    SYNC_INTERVAL_BOUNDS,
    SYNC_MODES,
    LogWriter,
    SyncMode,
    check_sync_interval,
)

__all__ = [
    "DEFAULT_SEGMENT_BYTES",
    "DEFAULT_SYNC_INTERVAL_S",
    "FORMAT_VERSION",
    "MAGIC",
    "MAX_RECORD_BYTES",
    "SYNC_INTERVAL_BOUNDS",
    "SYNC_MODES",
    "DamagedRange",
    "LogDetached",
    "LogHeader",
    "LogReader",
    "LogStatus",
    "LogWriter",
    "Recovery",
    "SegmentedWriter",
    "SyncMode",
    "check_log",
    "check_sync_interval",
    "detach_writer",
    "first_snapshot",
    "is_log_directory",
    "latest_snapshot",
    "list_segments",
    "read_header",
    "read_log",
]

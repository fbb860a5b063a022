"""The durable log: an append-only file of CRC-framed, sequence-numbered records.

``LogWriter`` appends (buffered, group commit at each step's end, fsynced inline or by a
background thread) and recovers a torn tail on reopen; ``LogReader`` / ``read_log`` stream
records back and never modify the file.
The byte format is in ``kvlog.log.format``; the torn-tail-versus-corruption rule in
``kvlog.log.scan``. One file per log (no segments in format version 1).
"""

from kvlog.log.format import (
    FORMAT_VERSION,
    MAGIC,
    MAX_RECORD_BYTES,
    LogHeader,
    Recovery,
)
from kvlog.log.reader import LogReader, read_header, read_log
from kvlog.log.writer import (
    DEFAULT_SYNC_INTERVAL_S,
    SYNC_INTERVAL_BOUNDS,
    SYNC_MODES,
    LogWriter,
    SyncMode,
    check_sync_interval,
)

__all__ = [
    "DEFAULT_SYNC_INTERVAL_S",
    "FORMAT_VERSION",
    "MAGIC",
    "MAX_RECORD_BYTES",
    "SYNC_INTERVAL_BOUNDS",
    "SYNC_MODES",
    "LogHeader",
    "LogReader",
    "LogWriter",
    "Recovery",
    "SyncMode",
    "check_sync_interval",
    "read_header",
    "read_log",
]

"""The one error tree of kvlog.

Bad input raises a subclass of :class:`KvlogError`; a broken internal invariant is an
``assert`` instead (it names a bug in kvlog, not in the caller). Every class is also a
builtin exception, so callers that do not know kvlog can still catch ``ValueError`` or
``OSError``::

    KvlogError (Exception)
    ├── InvalidEvent (ValueError)            an event the state machine refuses; nothing logged
    │   ├── NotConfigured                    an event before CacheConfigured
    │   ├── AlreadyConfigured                a second CacheConfigured
    │   ├── BlockOutOfRange                  a GPU or CPU block id < 0 or >= the pool size
    │   ├── BlockInUse                       a block given to two live requests (no prefix caching)
    │   ├── DuplicateBlock                   the same block id twice in one event
    │   ├── UnknownJob                       TransferFinished for a job that is not in flight
    │   ├── DuplicateJob                     a job id that is in flight or already used
    │   ├── TooManyJobs                      more transfer jobs in flight than the state bounds
    │   ├── TransferSizeMismatch             GPU/CPU block counts that do not fit block_size_factor
    │   └── StateTooLarge (MemoryError)      a pool whose state this machine cannot hold
    ├── CorruptLogError (ValueError)         a log that is damaged other than by a torn tail
    │   └── SchemaVersionError               a header this version cannot read
    ├── RecordRejected (ValueError)          not a record, or larger than the log's record bound
    ├── LogWriterError (OSError)             the log writer cannot go on
    │   ├── LogPoisoned                      an earlier write or fsync failed; no more appends
    │   ├── LogClosed                        an append after close()
    │   ├── LogLocked                        another writer holds the log open for append
    │   └── LogPathError                     a path that cannot hold a log: not a regular file,
    │       │                                a dangling symlink, a refused create (read-only
    │       │                                filesystem, full disk, permissions); errno kept
    │       ├── LogExists (FileExistsError)  a new log asked for where records already are
    │       └── LogNotFound (FileNotFoundError)  a log to continue that is not there
    │           └── SegmentsRetired          segments removed by retention while being read
    ├── LayoutError (ValueError)             KV-cache tensors that do not match a layout
    ├── ConfigError (ValueError)             an argument or environment variable kvlog cannot
    │                                        use (Engine, LogWriter, kvlog.integrations)
    ├── TransferSpecError (ValueError)       a vLLM transfer spec the offloading facade cannot
    │                                        turn into an event (kvlog.integrations)
    ├── TraceError (ValueError)              a request trace kvlog cannot read (kvlog synth --trace)
    ├── MissingExtra (ImportError)           an optional dependency is not installed; names the
    │                                        pip extra that brings it (kvlog sweep, reports)
    ├── EngineBroken (RuntimeError)          an Engine call cut short (an interrupt, an executor
    │                                        error) after its append: no more calls
    ├── UnsupportedVllm (ImportError)        a vLLM release kvlog's connector does not support;
    │                                        names the supported ones (kvlog.integrations)
    └── ExecutorError (RuntimeError)         an executor used wrongly (after shutdown, unknown plan)
        └── BackendUnavailable               a device backend this machine cannot run (no CUDA,
                                             no habana_frameworks)
"""

from __future__ import annotations

__all__ = [
    "AlreadyConfigured",
    "BackendUnavailable",
    "BlockInUse",
    "BlockOutOfRange",
    "ConfigError",
    "CorruptLogError",
    "EngineBroken",
    "DuplicateBlock",
    "DuplicateJob",
    "ExecutorError",
    "InvalidEvent",
    "KvlogError",
    "LayoutError",
    "LogClosed",
    "LogExists",
    "LogLocked",
    "LogNotFound",
    "LogPathError",
    "LogPoisoned",
    "LogWriterError",
    "MissingExtra",
    "NoTierEvents",
    "NotConfigured",
    "RecordRejected",
    "SchemaVersionError",
    "SegmentsRetired",
    "StateTooLarge",
    "TransferSizeMismatch",
    "TraceError",
    "TransferSpecError",
    "UnknownJob",
    "UnsupportedVllm",
]


class KvlogError(Exception):
    """Root of every error kvlog raises on purpose."""


class InvalidEvent(KvlogError, ValueError):
    """An event that the state machine refuses: it is not logged and changes nothing.

    ``event`` is the refused event (or None when refused before decoding), ``reason``
    a short human sentence.
    """

    def __init__(self, reason: str, event: object = None) -> None:
        self.reason = reason
        self.event = event
        name = type(event).__name__ if event is not None else "event"
        super().__init__(f"{name} rejected: {reason}")


class NotConfigured(InvalidEvent):
    """An event arrived before ``CacheConfigured``."""


class AlreadyConfigured(InvalidEvent):
    """A second ``CacheConfigured``."""


class BlockOutOfRange(InvalidEvent):
    """A block id that is negative or not below the pool size."""


class BlockInUse(InvalidEvent):
    """A block allocated to a second live request without prefix caching."""


class DuplicateBlock(InvalidEvent):
    """The same block id appears twice in one event."""


class UnknownJob(InvalidEvent):
    """A ``TransferFinished`` for a job that is not in flight."""


class DuplicateJob(InvalidEvent):
    """A job id that is in flight or was used before."""


class TooManyJobs(InvalidEvent):
    """A store or load while the bounded number of jobs in flight is already reached."""


class TransferSizeMismatch(InvalidEvent):
    """GPU and CPU block counts of a transfer that ``block_size_factor`` cannot match."""


class StateTooLarge(InvalidEvent, MemoryError):
    """A ``CacheConfigured`` whose state this machine cannot hold: refused before anything
    is allocated or logged (the pool bound is ``kvlog.events.validate.MAX_GPU_BLOCKS``)."""


class CorruptLogError(KvlogError, ValueError):
    """A log that is damaged other than by a torn tail (which is repaired instead).

    ``offset`` is the byte offset of the bad record, ``seq`` the sequence number expected
    there (or the one read, where it was readable). ``resume_offset`` and ``resume_seq``:
    where the first valid record after the damage lies in the same file (-1: none found),
    so a salvaging reader can go on there.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str = "",
        offset: int = -1,
        seq: int = -1,
        resume_offset: int = -1,
        resume_seq: int = -1,
    ) -> None:
        self.path = path
        self.offset = offset
        self.seq = seq
        self.resume_offset = resume_offset
        self.resume_seq = resume_seq
        self.message = message
        where = f"{path}: " if path else ""
        at = [f"byte offset {offset}"] if offset >= 0 else []
        at.append(f"sequence number {seq}" if seq >= 0 else "before the first record")
        super().__init__(f"{where}{message} ({', '.join(at)})")


class SchemaVersionError(CorruptLogError):
    """A log header whose format or schema version this kvlog cannot read."""


class RecordRejected(KvlogError, ValueError):
    """A record the log writer refuses before writing anything: not an event or
    ``Checkpoint``, or an encoding over ``kvlog.log.MAX_RECORD_BYTES``."""


class LogWriterError(KvlogError, OSError):
    """The log writer cannot append."""


class LogPoisoned(LogWriterError):
    """An earlier write or fsync failed: the on-disk state is unknown, so appends stop."""


class EngineBroken(KvlogError, RuntimeError):
    """An ``Engine`` call was cut short (a ``KeyboardInterrupt``, a ``MemoryError``, an
    executor error, ...) between its log append and the end of its state change: the log
    may hold an event that the state lacks (or half applied), so the engine refuses every
    later call and ``close()`` writes no checkpoint. The log replays (it ends with that
    event, which replay applies); ``Engine.resume`` continues it. Not an ``OSError``: what
    broke it was rarely the disk (a Ctrl-C, an executor's error)."""


class LogClosed(LogWriterError):
    """An append after ``close()``."""


class LogLocked(LogWriterError):
    """Another ``LogWriter`` (in this or another process) has the log open for append."""


class LogPathError(LogWriterError):
    """A log path kvlog cannot use: a directory, device, FIFO or socket (never replaced),
    a dangling symlink, or an open or create the OS refused (``errno`` is the OS's)."""


class LogExists(LogPathError, FileExistsError):
    """A new log was asked for on a path that already holds records (nothing was touched)."""


class LogNotFound(LogPathError, FileNotFoundError):
    """A log to continue (``Engine.resume``, ``Engine.restore``) that does not exist or
    holds no events (nothing was created)."""


class SegmentsRetired(LogNotFound):
    """Segments of a log directory that a read had listed were removed under it (the
    writer's retention): the records from ``first_seq`` on were not read. ``resume_seq``:
    the first record of the oldest segment still there after them (a snapshot checkpoint
    a fold can go on from), -1 when nothing later is left."""

    def __init__(self, path: str, first_seq: int, resume_seq: int) -> None:
        self.path = path
        self.first_seq = first_seq
        self.resume_seq = resume_seq
        later = (
            f"the log goes on at sequence number {resume_seq}"
            if resume_seq >= 0
            else "nothing later is left to read"
        )
        super().__init__(
            2,
            f"{path}: the segment holding sequence number {first_seq} on was removed by the "
            f"log's retention while it was read; {later}",
        )


class LayoutError(KvlogError, ValueError):
    """KV-cache tensors that do not match the declared layout."""


class ConfigError(KvlogError, ValueError):
    """An argument or environment variable that kvlog cannot use.

    ``name`` is the variable or argument, ``value`` what it held; ``shown``, where given,
    is how the user wrote them (``--ratio-limit 2`` for the 200 kvlog holds).
    """

    def __init__(self, name: str, value: object, expected: str, *, shown: str = "") -> None:
        self.name = name
        self.value = value
        super().__init__(f"{shown or f'{name}={value!r}'}: expected {expected}")


class TransferSpecError(KvlogError, ValueError):
    """A transfer spec the offloading facade cannot turn into an event (e.g. several KV groups)."""


class TraceError(KvlogError, ValueError):
    """A request trace that cannot be read: unknown format, a row that does not parse."""


class NoTierEvents(KvlogError, ValueError):
    """A log asked about its CPU tier (``kvlog sweep --cpu-bytes``) that holds no tier
    events: it was recorded without a CPU tier, so every answer would be 0."""

    def __init__(self, path: str) -> None:
        self.path = path
        super().__init__(
            f"{path} holds no CPU tier events, so no tier what-if can be asked of it: record "
            "one with kvlog synth --trace FILE --num-cpu-blocks N (or the connector's "
            "scheduler log), or give the trace itself"
        )


class MissingExtra(KvlogError, ImportError):
    """An optional dependency is missing; the message names the extra to install."""

    def __init__(self, module: str, extra: str, purpose: str) -> None:
        self.module = module
        self.extra = extra
        super().__init__(
            f"{purpose} needs {module}, which is not installed: pip install 'kvlog[{extra}]'"
        )


class UnsupportedVllm(KvlogError, ImportError):
    """The installed vLLM is none that kvlog's connector supports; one line naming them."""

    def __init__(self, found: str, supported: tuple[str, ...]) -> None:
        self.found = found
        self.supported = supported
        super().__init__(
            f"kvlog supports vLLM {', '.join(supported)} (and their patch releases), found "
            f"{found}: install one of those (docs/vllm.md)"
        )


class ExecutorError(KvlogError, RuntimeError):
    """An executor used wrongly: after shutdown, or with a plan it does not know."""


class BackendUnavailable(ExecutorError):
    """A device backend that cannot run here: no CUDA device, or no Habana software stack."""

"""The Engine: the imperative shell around the pure reducers.

``apply(event)`` is the one way in: one step of the machine (``kvlog.runtime.machine``) with the
log between its check and its change. Its order, and what it guarantees:

1. **check**: the event must be an exact event type, and the reducers' check must accept
   it against the state (numpy integers and 1-D integer arrays are first turned into plain
   ints, which is what gets logged). The check keeps what it found, for the change. A
   refused event raises a ``KvlogError`` (``InvalidEvent``, ``RecordRejected``), is never
   logged and changes nothing, with or without a log: the same checks run either way;
2. **append** it to the log (encoded once, straight into the writer's buffer; a record too
   large for the log is refused there, ``RecordRejected``, nothing written). If the write
   or fsync fails, the writer is poisoned and so is the engine (every later call raises
   ``LogPoisoned``), and the state has not changed: it is the state of every event
   appended before. Events buffered since the last group commit may or may not be on
   disk; ``Engine.resume(log_path)`` rebuilds exactly what is durable. With
   ``on_log_error="detach"`` (the facades' choice) the recorder detaches instead: said once
   on the ``kvlog`` logger, ``log_status()`` reports it, the log ends with a gap record
   where the disk allows, and the engine goes on in memory (``kvlog.log.detach``);
3. **commit**: the machine changes the state once, with what the check found (this cannot
   refuse: the event was checked against this very state), hands the plans to the
   executor, if any, and notifies its observers; ``apply`` returns the plans.

So ``apply`` raises only before anything changed, except ``LogPoisoned`` from the
checkpoint that a ``StepEnded`` may write after it was applied (the engine has then
stopped; resume the log), and an exception that cut it short (below). Every
``checkpoint_every`` steps the engine appends a ``Checkpoint`` record (sequence number of
the last applied record and the state digest), with a state snapshot every
``snapshot_every`` checkpoints (by default 16, and no sooner than ``num_gpu_blocks // 4``
records after the last, so large pools snapshot less often: see ``Engine._snapshot_due``),
so a replay verifies as it goes and can start from the latest snapshot (a log directory
also seals its segment at a step's end once it holds ``segment_bytes``, and opens the next
with a snapshot, ``kvlog.log.segments``); a snapshot of any
allowed pool fits the log (it is split across records when large). ``close()`` drains the
executor's transfers, writes a final checkpoint (with a snapshot) and closes the log
cleanly.

**Interrupts and exceptions.** Every public call is atomic under any exception, wherever it
lands (``KeyboardInterrupt``, ``MemoryError``, an executor's or an observer's error): from
a call's first log append to the end of its change the engine is busy, and a raise there
leaves it broken. Every later call then raises ``EngineBroken`` and ``close()`` writes no
checkpoint, only closes the log, which ends with the event: replay
applies it and ``Engine.resume`` continues it. An executor error comes after the state
changed: the event is logged and counts as applied; the engine is broken (the plan's bytes
are unknown). Interrupting a blocking ``wait`` (or ``close``'s drain) breaks it too.

**Threads.** Calls from several threads are serialized: an ``RLock`` is taken by every
public call (apply, poll, wait, resolve, resolve_all, digest, running_digest, snapshot,
checkpoint, close), so each runs whole and the log holds them in the order they ran. It is
reentrant (an observer may read the engine inside a call); ``.state`` is not locked.

The constructor checks the configuration, that this machine can hold its state
(``StateTooLarge``) and builds the state before it opens or creates the log, so a refused
configuration leaves no file, no descriptor and no lock behind, and a log never holds a
configuration that cannot be loaded back.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import TYPE_CHECKING, Any, overload

import msgspec
import numpy as np

from kvlog import reducers
from kvlog.errors import (
    BlockOutOfRange,
    ConfigError,
    EngineBroken,
    InvalidEvent,
    LogClosed,
    LogNotFound,
    LogPoisoned,
    NotConfigured,
    RecordRejected,
    StateTooLarge,
)
from kvlog.events import (
    STEP_EVENTS,
    CacheConfigured,
    Checkpoint,
    Event,
    Plan,
    TransferBatch,
    TransferFinished,
)
from kvlog.events.validate import normalize_event
from kvlog.log import (
    DEFAULT_SYNC_INTERVAL_S,
    SYNC_MODES,
    LogStatus,
    Recovery,
    SegmentedWriter,
    SyncMode,
    check_sync_interval,
    detach_writer,
)
from kvlog.log.detach import error_errno
from kvlog.reducers import checkpoint
from kvlog.reducers.digest import digest_and_snapshot
from kvlog.reducers.ranges import check_id_dtype
from kvlog.reducers.view import BooksView
from kvlog.runtime.fold import fold_to_end
from kvlog.runtime.machine import Machine, Ticket
from kvlog.runtime.memory import check_state_memory
from kvlog.runtime.opening import (
    LogOptions,
    OnLogError,
    Writer,
    check_log_options,
    check_snapshot_of,
    last_event_seq,
    open_existing,
    open_writer,
    say_not_read,
)
from kvlog.runtime.records import check_record_size, plain_event
from kvlog.runtime.tables import block_table_row

if TYPE_CHECKING:
    from kvlog.executors import Executor, TransferCompletion

__all__ = ["Engine"]

_logger = logging.getLogger("kvlog")


_STEP_TYPES = STEP_EVENTS
DEFAULT_SNAPSHOT_EVERY = 16
"""Checkpoints between snapshots by default (``snapshot_every=None``)."""
SNAPSHOT_BLOCKS_PER_RECORD = 4
"""By default a snapshot waits for ``num_gpu_blocks // 4`` records since the last one: at
most ~1 us of snapshot per record at any pool size (a 1M-block snapshot takes ~0.25 s)."""


class Engine:
    """Event-sourced KV-cache bookkeeping: log, reduce, execute (see the module docstring).

    Thread-safe by serialization: every public call holds the engine's ``RLock``. A call
    cut short after its log append (an interrupt, an executor error) leaves the engine
    broken: later calls raise ``EngineBroken``, ``close()`` writes no checkpoint."""

    def __init__(
        self,
        config: CacheConfigured,
        log_path: str | os.PathLike[str] | None = None,
        executor: Executor | None = None,
        sync: SyncMode = "step",
        checkpoint_every: int = 256,
        snapshot_every: int | None = None,
        *,
        meta: dict[str, str] | None = None,
        sync_interval_s: float = DEFAULT_SYNC_INTERVAL_S,
        segment_bytes: int | None = None,
        retain_bytes: int | None = None,
        retain_seconds: float | None = None,
        compress: bool | None = False,
        on_log_error: OnLogError = "raise",
        _state: reducers.State | None = None,
        last_event_seq: int = -1,
        _writer: Writer | None = None,
    ) -> None:
        self._log: Writer | None = _writer
        self._options = LogOptions(
            segment_bytes, retain_bytes, retain_seconds, compress, on_log_error
        )
        self._status = LogStatus(None if _writer is None else _writer.path, _writer is not None)
        self._closed = False
        self._busy: str | None = None
        """The call between its first log append and the end of its change, else None:
        still set after that call raised, the engine is broken (``EngineBroken``)."""
        self._broken = False
        try:
            _check_arguments(sync, checkpoint_every, snapshot_every)
            check_sync_interval(sync_interval_s)
            check_log_options(self._options, log_path)
            if _state is None:
                config, _state = _configured(config)
            self._init(_state, executor, checkpoint_every, snapshot_every, last_event_seq)
            if _writer is None and log_path is not None:
                self._log = open_writer(
                    log_path, sync, sync_interval_s, self._options, meta=meta, new=True
                )
                self._status = LogStatus(self._log.path, True)
            self._record: Callable[[Event], object] = (
                check_record_size if self._log is None else self._log.append
            )
            """What ``apply`` does between check and commit: the log's append, or without
            a log the same size bound the writer would enforce."""
            self.recovery: Recovery | None = None if self._log is None else self._log.recovery
            """The torn tail cut when the log was opened (``Engine.resume``), else None."""
            if self._log is not None:
                self._start_log(config, fresh=last_event_seq < 0)
        except BaseException:  # an interrupt too: no descriptor or lock left behind
            self._closed = True
            if self._log is not None:
                self._log.close()
            raise

    def _init(
        self,
        state: reducers.State,
        executor: Executor | None,
        checkpoint_every: int,
        snapshot_every: int | None,
        last_event_seq: int,
    ) -> None:
        self._lock = threading.RLock()
        """Serializes every public call (see the class docstring)."""
        self._machine = Machine(state, executor)
        self._view = BooksView(state)
        self.checkpoint_every = checkpoint_every
        self.snapshot_every = snapshot_every
        self._num_steps = 0
        self._num_checkpoints = 0
        self._snapshot_checkpoint = 0  # the checkpoint and the record of the last snapshot
        self._snapshot_seq = max(last_event_seq, 0)
        self._last_seq = last_event_seq

    def _start_log(self, config: CacheConfigured, *, fresh: bool) -> None:
        """Log the configuration (a new log) or a checkpoint of the state (a continued one);
        on failure close the log (its descriptor and lock go with it) and re-raise."""
        assert self._log is not None
        if fresh:
            self._last_seq = self._log.append(config)
        else:
            self._checkpoint(force_snapshot=True)

    # -- the way in ----------------------------------------------------------------------
    @property
    def state(self) -> reducers.State:
        """The reducer state (read it; never change it from outside)."""
        return self._machine.state

    @property
    def view(self) -> BooksView:
        """The books, read only: what a facade may read of the state (never its buffers)."""
        return self._view

    @property
    def machine(self) -> Machine:
        """The one step of the machine this engine drives (add observers to it)."""
        return self._machine

    @property
    def executor(self) -> Executor | None:
        """The executor that carries out the plans (None: bookkeeping only)."""
        return self._machine.executor

    @executor.setter
    def executor(self, executor: Executor | None) -> None:
        self._machine.executor = executor

    @property
    def config(self) -> CacheConfigured:
        config = self.state.config
        assert config is not None, "Engine.config before CacheConfigured: engine bug"
        return config

    @property
    def log_path(self) -> str | None:
        return None if self._log is None else self._log.path

    def apply(self, event: Event, ticket: Ticket | None = None) -> list[Plan]:
        """Check, log, change, execute one event (one step of the machine); the plans.
        ``ticket``: what :meth:`check` returned for this same event object; while what it
        found still describes the state the event is not checked again."""
        with self._lock:
            if self._busy is not None or self._closed:
                self._check_open()
            try:
                return self._apply(event, ticket)
            except BaseException:
                self._broken = self._busy is not None
                raise

    def _log_form(self, checked: reducers.Checked) -> Event:
        """The record the log keeps for ``checked`` (``reducers.recorded``), told the pool's
        size, which bounds a checked step's ids."""
        config = self._machine.state.config
        return reducers.recorded(checked, 0 if config is None else config.num_gpu_blocks)

    def _apply(self, event: Event, ticket: Ticket | None = None) -> list[Plan]:
        """``apply`` without the lock and the entry check (``poll`` applies through it)."""
        outer = self._busy
        machine = self._machine
        try:
            checked = machine.prepared(event, ticket)
        except (InvalidEvent, RecordRejected):  # nothing changed
            plain = plain_event(event)
            if plain is event:
                raise
            checked = machine.check(plain).checked
        self._busy = "apply"  # from here a raise leaves the engine broken
        try:
            self._record(checked.event if self._log is None else self._log_form(checked))
        except RecordRejected:  # nothing logged
            self._busy = outer
            raise
        except LogPoisoned as exc:  # a poisoned log: the state is that of every event
            self._busy = outer  # appended before (docstring), unless the recorder detaches
            self._log_failed(exc)
            self._busy = "apply"
        plans = machine.commit(checked)
        if self._log is not None:
            self._last_seq = self._log.next_seq - 1  # the event just appended
        self._busy = outer
        if type(event) in _STEP_TYPES:
            self._num_steps += 1
            if self.checkpoint_every and self._num_steps % self.checkpoint_every == 0:
                self._checkpoint()
            if isinstance(self._log, SegmentedWriter) and self._log.rotation_due:
                self._rotate()
        return plans

    def _rotate(self) -> None:
        """Seal the full segment; the next one starts with a checkpoint and a snapshot."""
        assert isinstance(self._log, SegmentedWriter), "only a log directory rotates"
        try:
            self._log.seal()
        except LogPoisoned as exc:
            self._log_failed(exc)
            return
        self._checkpoint(force_snapshot=True)

    def _log_failed(self, exc: LogPoisoned) -> None:
        """An I/O error on the log: raise it (``on_log_error="raise"``), or detach the
        recorder and go on in memory (``"detach"``): said once on the ``kvlog`` logger,
        counted in ``log_status()``, the log ended with a gap record where the disk allows."""
        log = self._log
        if self._options.on_log_error != "detach" or log is None:
            raise exc
        self._log = None
        self._record = check_record_size
        marked = detach_writer(log, exc)
        self._status = LogStatus(
            log.path, False, str(exc), error_errno(exc), 1, marked, self._last_seq
        )
        _logger.error(
            "kvlog: the log %s failed (%s): the recorder detached after seq %d, serving and "
            "the books go on in memory%s",
            log.path,
            exc,
            self._last_seq,
            "; the log ends with a gap record" if marked else "; no gap record could be written",
        )

    def log_status(self) -> LogStatus:
        """Where the recorder stands: attached, or detached after which I/O error."""
        with self._lock:
            status = self._status
            if self._log is not None:
                status = msgspec.structs.replace(status, last_seq=self._last_seq)
            return status

    @property
    def num_checkpoints(self) -> int:
        """Checkpoint records this Engine wrote (the final one of ``close`` included)."""
        return self._num_checkpoints

    @property
    def records_written(self) -> int:
        """Records the log holds (events and checkpoints, a continued log's earlier ones
        too; a closed log's end record not counted); after a detach, up to the last one
        known appended."""
        log = self._log
        if log is None:
            return self._status.last_seq + 1
        return log.next_seq - log.closed  # close() appended one LogEnd

    @property
    def recorder_attached(self) -> bool:
        """Whether records still go to a log (one attribute test: a metric asks every step)."""
        return self._log is not None

    def recorder_lag_s(self) -> float:
        """Seconds the oldest record not yet fsynced has waited (0: none, or no log)."""
        log = self._log
        return 0.0 if log is None else log.unsynced_age_s()

    def check(self, event: Event) -> Ticket:
        """Raise what ``apply(event)`` would raise against the state as it is now (a
        ``KvlogError``); change nothing, log nothing. The ticket it returns, handed to
        ``apply(event, ticket)``, spares that apply a second check while what this one found
        still describes the state (no other event between, or only finished transfers
        before a whole step checked with its blocks free)."""
        with self._lock:
            self._check_open()
            return self._machine.check(event)

    def verdict(
        self, event: Event, expected: tuple[type[InvalidEvent], ...]
    ) -> Ticket | InvalidEvent:
        """:meth:`check`, with a refusal of one of the ``expected`` types returned as a value
        (an outcome the caller plans for, such as a step whose blocks the books must first
        release) instead of raised; any other refusal is raised. Changes nothing."""
        try:
            return self.check(event)
        except expected as refusal:
            return refusal

    def poll(self) -> list[TransferCompletion]:
        """Finished transfers from the executor, each logged and reduced as TransferFinished."""
        with self._lock:
            self._check_open()
            if self.executor is None or not self._view.has_transfers():  # nothing to report
                return []
            return self._drain("poll", None)

    def wait(self, job_ids: Iterable[int] | None = None) -> list[TransferCompletion]:
        """Block until those transfers (all in flight, by default) finish; like ``poll``."""
        with self._lock:
            self._check_open()
            if self.executor is None:
                return []
            ids = None if job_ids is None else [int(j) for j in job_ids]
            if ids is not None and not ids:
                return []
            return self._drain("wait", ids)

    def _drain(self, call: str, ids: list[int] | None) -> list[TransferCompletion]:
        """The executor's finished transfers, applied as one ``TransferFinished`` or one
        ``TransferBatch`` of them (``_finished_event``). From the
        executor's call to the last one applied the engine is busy: completions the
        executor handed over and the log lacks would be lost to a cut-short call."""
        executor = self.executor
        assert executor is not None, "_drain without an executor: engine bug"
        self._busy = call
        try:
            results = executor.poll() if call == "poll" else executor.wait(ids)
            if results:  # one event a call: a TransferBatch of several (reducers/transfer_batch)
                self._apply(_finished_event(results))
        except BaseException:
            self._broken = True
            raise
        self._busy = None
        return list(results)

    # -- reading -------------------------------------------------------------------------
    def resolve(self, block_id: int) -> int:
        """The physical block that logical ``block_id`` lives in now."""
        with self._lock:
            if self._broken:
                self._check_sound()
            self._check_range(block_id)
            return int(self.state.resolve(int(block_id)))

    @overload
    def resolve_all(self, block_tables: list[list[int]]) -> list[list[int]]: ...
    @overload
    def resolve_all(self, block_tables: np.ndarray) -> np.ndarray: ...
    def resolve_all(self, block_tables: Any) -> Any:
        """Resolve whole block tables at once: a list of lists or a 2-D numpy array.

        Returns the same kind (a new list of lists; an array of the same dtype and shape).
        Negative entries in an array are padding and pass through unchanged.
        """
        with self._lock:
            if self._broken:
                self._check_sound()
            if isinstance(block_tables, np.ndarray):
                return self._resolve_array(block_tables)
            return self._resolve_rows(block_tables)

    def _resolve_rows(self, block_tables: Any) -> list[list[int]]:
        rows = [block_table_row(row) for row in block_tables]
        if not rows:
            return []
        if any(row.ndim != 1 for row in rows):
            raise InvalidEvent("block tables must be a list of lists of ints")
        flat = np.concatenate(rows) if len(rows) > 1 else rows[0]
        resolved = self._resolve_array(flat).tolist()
        out: list[list[int]] = []
        start = 0
        for row in rows:
            out.append(resolved[start : start + len(row)])
            start += len(row)
        return out

    def _resolve_array(self, table: np.ndarray) -> np.ndarray:
        if table.size == 0:
            return table.copy()
        check_id_dtype(table.dtype, self.config.num_gpu_blocks)
        valid = table >= 0
        top = int(table.max())
        if top >= self.config.num_gpu_blocks:
            raise BlockOutOfRange(f"block id {top} >= num_gpu_blocks {self.config.num_gpu_blocks}")
        out = table.copy()
        resolved = self.state.resolve_array(table[valid].astype(np.int64))
        out[valid] = resolved.astype(table.dtype)
        return out

    def _check_range(self, block_id: int) -> None:
        if isinstance(block_id, bool) or not isinstance(block_id, (int, np.integer)):
            raise InvalidEvent(f"a block id must be an int, not {type(block_id).__name__}")
        if not 0 <= block_id < self.config.num_gpu_blocks:
            raise BlockOutOfRange(
                f"block id {block_id} is outside [0, {self.config.num_gpu_blocks})"
            )

    def digest(self) -> str:
        """Hex digest of the whole state (equal states, equal digests)."""
        with self._lock:
            self._check_sound()
            return str(reducers.digest(self.state))

    def running_digest(self) -> str:
        """The digest checkpoints record (``"v2:..."``): kept up to date with every change,
        O(1) to read (``kvlog.reducers.running``); equal states, equal running digests."""
        with self._lock:
            self._check_sound()
            return checkpoint.checkpoint_digest(self.state)

    def snapshot(self) -> bytes:
        """The whole state as bytes (checksummed), for ``Engine.restore``."""
        with self._lock:
            self._check_sound()
            return bytes(reducers.snapshot(self.state))

    # -- restore and resume --------------------------------------------------------------
    @classmethod
    def restore(
        cls,
        blob: bytes,
        log_path: str | os.PathLike[str] | None = None,
        executor: Executor | None = None,
        sync: SyncMode = "step",
        checkpoint_every: int = 256,
        snapshot_every: int | None = None,
        *,
        sync_interval_s: float = DEFAULT_SYNC_INTERVAL_S,
        log_options: LogOptions | None = None,
    ) -> Engine:
        """An engine continuing from ``snapshot()`` bytes.

        With ``log_path``, the snapshot must be of the state at the log's end (its last
        checkpoint's digest when that covers the last event, else a verified replay's):
        another one raises ``ConfigError`` and nothing is appended. The engine appends to
        the log, starting with a checkpoint of the restored state. Bytes that are not an
        intact snapshot raise ``CorruptLogError``; a snapshot taken before
        ``CacheConfigured`` raises ``NotConfigured``.
        """
        _check_arguments(sync, checkpoint_every, snapshot_every)
        state = reducers.restore(blob)
        if state.config is None:
            raise NotConfigured(
                "cannot restore an engine from a snapshot taken before CacheConfigured"
            )
        check_state_memory(state.config, resident=True)
        writer = None
        try:  # opened inside: an interrupt anywhere leaves no descriptor or lock behind
            options = log_options or LogOptions()
            writer = (
                None
                if log_path is None
                else open_existing(log_path, sync, sync_interval_s, options)
            )
            last = -1 if writer is None else last_event_seq(writer.path)
            if writer is not None and last < 0:
                raise LogNotFound(
                    2,
                    f"{writer.path} holds no events: a restored engine continues the log its "
                    "snapshot came from (start a new log with Engine(config, log_path))",
                )
            if writer is not None:
                check_snapshot_of(writer.path, state, last)
            return cls._continued(
                state, last, writer, executor, sync, checkpoint_every, snapshot_every, options
            )
        except BaseException:
            if writer is not None:
                writer.close()
            raise

    @classmethod
    def resume(
        cls,
        log_path: str | os.PathLike[str],
        executor: Executor | None = None,
        sync: SyncMode = "step",
        checkpoint_every: int = 256,
        snapshot_every: int | None = None,
        *,
        sync_interval_s: float = DEFAULT_SYNC_INTERVAL_S,
        log_options: LogOptions | None = None,
    ) -> Engine:
        """Reopen an existing log (a torn tail is cut, and reported on ``.recovery``) and
        continue it where it ends.

        The log is locked first, then the state is rebuilt by a verified replay from the
        log's latest snapshot. Transfers that were in flight when the log ended are still in
        flight: the caller decides (``apply(TransferFinished(job_id, success=False))`` when
        their data is gone). A log directory's latest snapshot is found from its manifest,
        in O(segments): only the segment it lies in is read (the segments before it are
        not: damage there does not stop a resume; which were not read is said on the
        ``kvlog`` logger). ``log_options``: segments, retention and ``on_log_error``
        (``LogOptions``) for the continued log; a directory keeps its own segment size,
        retention and compression (its manifest's) where they are None.
        """
        _check_arguments(sync, checkpoint_every, snapshot_every)
        writer = None
        try:  # opened inside: an interrupt anywhere leaves no descriptor or lock behind
            options = log_options or LogOptions()
            writer = open_existing(log_path, sync, sync_interval_s, options)
            fold = fold_to_end(writer.path)
            state, last = fold.state, fold.last_event_seq
            if state.config is None:
                raise LogNotFound(2, f"{writer.path} holds no events to resume")
            say_not_read(fold)
            return cls._continued(
                state, last, writer, executor, sync, checkpoint_every, snapshot_every, options
            )
        except BaseException:
            if writer is not None:
                writer.close()
            raise

    @classmethod
    def _continued(
        cls,
        state: reducers.State,
        last: int,
        writer: Writer | None,
        executor: Executor | None,
        sync: SyncMode,
        checkpoint_every: int,
        snapshot_every: int | None,
        options: LogOptions,
    ) -> Engine:
        """An engine over a rebuilt state, continuing ``writer``'s log (if any)."""
        assert state.config is not None, "only a configured state continues"
        return cls(
            state.config,
            None,
            executor,
            sync,
            checkpoint_every,
            snapshot_every,
            segment_bytes=options.segment_bytes,
            retain_bytes=options.retain_bytes,
            retain_seconds=options.retain_seconds,
            compress=options.compress,
            on_log_error=options.on_log_error,
            _state=state,
            last_event_seq=last,
            _writer=writer,
        )

    # -- checkpoints and closing ---------------------------------------------------------
    def checkpoint(self, snapshot: bool = False) -> None:
        """Append a checkpoint now (with a snapshot if asked); no-op without a log."""
        with self._lock:
            self._check_open()
            self._checkpoint(force_snapshot=snapshot)

    def _checkpoint(self, force_snapshot: bool = False) -> None:
        if self._log is None:
            return
        self._num_checkpoints += 1
        with_snapshot = force_snapshot or self._snapshot_due()
        # a snapshot holds the canonical digest, which its restore checks
        blob = digest_and_snapshot(self.state)[1] if with_snapshot else b""
        if with_snapshot:
            self._snapshot_checkpoint, self._snapshot_seq = self._num_checkpoints, self._last_seq
        digest = checkpoint.checkpoint_digest(self.state)  # O(1): kept up to date as it changes
        record = Checkpoint(
            seq=self._last_seq, digest=digest, step=int(self.state.step), snapshot=blob
        )
        outer, self._busy = self._busy, "checkpoint"
        try:
            self._log.append(record)
        except LogPoisoned as exc:  # the state is still that of every event logged before
            self._busy = outer
            self._log_failed(exc)
        except BaseException:
            self._broken = True  # cut short: appending after it is the writer's guess
            raise
        self._busy = outer

    def _snapshot_due(self) -> bool:
        """Every ``snapshot_every`` checkpoints; by default (None) every
        ``DEFAULT_SNAPSHOT_EVERY`` checkpoints and no sooner than ``num_gpu_blocks //
        SNAPSHOT_BLOCKS_PER_RECORD`` records after the last snapshot, so that a snapshot's
        O(num_gpu_blocks) cost stays a bounded share of each record's, at any pool size."""
        since = self._num_checkpoints - self._snapshot_checkpoint
        every = DEFAULT_SNAPSHOT_EVERY if self.snapshot_every is None else self.snapshot_every
        if every <= 0 or since < every:
            return False
        if self.snapshot_every is None:
            records = self._last_seq - self._snapshot_seq
            if records < self.config.num_gpu_blocks // SNAPSHOT_BLOCKS_PER_RECORD:
                return False
        return True

    def close(self) -> None:
        """Drain transfers (logging them), write a final checkpoint, close the log.

        Idempotent. The executor is the caller's: it is drained, not shut down. A broken
        engine (``EngineBroken``: an earlier call was cut short after its append) or a
        poisoned log gets no checkpoint: the log is only closed, and replays as it ends.
        """
        with self._lock:
            if self._closed:
                if self._log is not None:
                    self._log.close()  # idempotent: finishes a close that was cut short
                return
            try:
                detaching = self._options.on_log_error == "detach"
                if detaching and self._log is not None and self._log.poisoned:
                    self._poisoned()
                if self._busy is None and (self._log is None or not self._log.poisoned):
                    if self.executor is not None:
                        self.wait()
                    self._checkpoint(force_snapshot=True)
            finally:
                self._closed = True
                self._close_log()

    def _close_log(self) -> None:
        if self._log is None:
            return
        try:
            self._log.close()
        except LogPoisoned as exc:  # a detaching engine ends the log with its gap
            self._log_failed(exc)

    def _poisoned(self) -> None:
        """The log was poisoned outside a call (the background flusher's fsync failed):
        ``LogPoisoned``, or the recorder detaches."""
        assert self._log is not None, "only a log is poisoned"
        try:
            self._log.flush()
        except LogPoisoned as exc:
            self._log_failed(exc)
            return
        raise AssertionError("a poisoned writer flushed: writer bug")

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def broken(self) -> bool:
        """An earlier call was cut short after its log append (``EngineBroken``)."""
        return self._broken or self._busy is not None

    def _check_open(self) -> None:
        if self._closed:
            raise LogClosed("the engine is closed")
        if self._log is not None and self._log.poisoned:
            if self._options.on_log_error == "detach":
                self._poisoned()
            else:
                raise LogPoisoned(f"{self._log.path}: an earlier append failed; the engine stopped")
        if self._busy is not None:  # a call cut short (this is no call's own re-entry)
            self._broken = True
        self._check_sound()

    def _check_sound(self) -> None:
        """``EngineBroken`` when an earlier call was cut short after its append (a read
        checks only this: an observer may read the engine inside a call)."""
        if self._broken:
            raise EngineBroken(
                f"{self.log_path or 'the engine'}: an earlier {self._busy or 'call'} was cut "
                "short after its log append (an interrupt or an executor error): the state "
                "may lack what the log holds, so the engine stopped; close it and "
                "Engine.resume the log"
            )

    def __enter__(self) -> Engine:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


def _check_arguments(sync: object, checkpoint_every: object, snapshot_every: object) -> None:
    if sync not in SYNC_MODES:
        raise ConfigError("sync", sync, f"one of {SYNC_MODES}")
    checked = [("checkpoint_every", checkpoint_every)]
    if snapshot_every is not None:
        checked.append(("snapshot_every", snapshot_every))
    for name, value in checked:
        if type(value) is not int or value < 0:
            raise ConfigError(name, value, "an int >= 0 (0 = never)")


def _configured(config: CacheConfigured) -> tuple[CacheConfigured, reducers.State]:
    """The (plain) configuration and the state built from it, before any file is touched:
    ``InvalidEvent`` for a bad configuration, ``StateTooLarge`` for one this machine cannot
    hold."""
    state = reducers.initial_state()
    config = normalize_event(config)
    if type(config) is not CacheConfigured:
        raise NotConfigured("the first event must be CacheConfigured", config)
    checked = reducers.check(state, config)
    check_state_memory(config)
    try:
        reducers.commit(state, checked)
    except MemoryError as exc:
        raise StateTooLarge(f"cannot allocate the state: {exc!r}", config) from exc
    return config, state


def _finished_event(results: list[TransferCompletion]) -> TransferFinished | TransferBatch:
    """One ``TransferFinished`` for one finished transfer, a ``TransferBatch`` of them for
    several (split at ``MAX_TRANSFER_BATCH`` would need more than one event: not reachable,
    as at most ``MAX_JOBS_IN_FLIGHT`` jobs are in flight)."""
    events = [TransferFinished(job_id=r.job_id, success=r.success) for r in results]
    return events[0] if len(events) == 1 else TransferBatch(events=list(events))

"""The Engine: the imperative shell around the pure reducers.

``apply(event)`` is the one way in. Its order, and what it guarantees:

1. **validate**: the log must take the record (a type and a size the writer accepts) and
   ``reducers.validate`` must accept the event against the state; a refused event raises
   (``InvalidEvent``, ``RecordRejected``), is never logged and changes nothing;
2. **append** it to the log. If the write or fsync fails, the writer is poisoned and so is
   the engine (every later call raises ``LogPoisoned``), and the state has not changed: it
   is the state of every event appended before. Events buffered since the last group commit
   may or may not be on disk; ``Engine.resume(log_path)`` rebuilds exactly what is durable;
3. **reduce**: the event is known valid, so this cannot refuse it (if it does, that is a
   reducer bug and an ``AssertionError``);
4. hand the plans to the executor, if any, and return them.

Every ``checkpoint_every`` steps the engine appends a ``Checkpoint`` record (sequence
number of the last applied record and the state digest), with a state snapshot every
``snapshot_every`` checkpoints, so a replay verifies as it goes and can start from the
latest snapshot. ``close()`` drains the executor's transfers, writes a final checkpoint
(with a snapshot) and closes the log.
"""

from __future__ import annotations

import os
import typing
from collections.abc import Iterable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, overload

import numpy as np

from kvlog import reducers
from kvlog.errors import BlockOutOfRange, InvalidEvent, LogClosed, LogPoisoned, RecordRejected
from kvlog.events import (
    CacheConfigured,
    Checkpoint,
    Event,
    Plan,
    StepEnded,
    TransferFinished,
    encode,
)
from kvlog.log import MAX_RECORD_BYTES, LogWriter, SyncMode

if TYPE_CHECKING:
    from kvlog.executors import Executor, TransferResult

__all__ = ["Engine"]

_EVENT_TYPES = typing.get_args(Event)


class Engine:
    """Event-sourced KV-cache bookkeeping: log, reduce, execute (see the module docstring)."""

    def __init__(
        self,
        config: CacheConfigured,
        log_path: str | os.PathLike[str] | None = None,
        executor: Executor | None = None,
        sync: SyncMode = "step",
        checkpoint_every: int = 256,
        snapshot_every: int = 16,
        *,
        meta: dict[str, str] | None = None,
        _state: reducers.State | None = None,
        _last_event_seq: int = -1,
    ) -> None:
        if checkpoint_every < 0 or snapshot_every < 0:
            raise ValueError("checkpoint_every and snapshot_every must be >= 0 (0 = never)")
        self.executor = executor
        self.checkpoint_every = checkpoint_every
        self.snapshot_every = snapshot_every
        self._state = reducers.initial_state() if _state is None else _state
        self._log: LogWriter | None = None
        self._closed = False
        self._num_steps = 0
        self._num_checkpoints = 0
        self._last_seq = -1
        if log_path is not None:
            if _state is None and _holds_records(log_path):
                raise FileExistsError(
                    f"{os.fspath(log_path)} already holds records; use Engine.resume() to "
                    "continue it (the file was not touched)"
                )
            self._log = LogWriter(log_path, sync=sync, meta=meta)
            self._last_seq = _last_event_seq
        if _state is None:
            self.apply(config)
        elif self._log is not None:
            self._checkpoint(force_snapshot=True)

    # -- the way in ----------------------------------------------------------------------
    @property
    def state(self) -> reducers.State:
        """The reducer state (read it; never change it from outside)."""
        return self._state

    @property
    def config(self) -> CacheConfigured:
        config = self._state.config
        assert config is not None, "Engine.config before CacheConfigured: engine bug"
        return config

    @property
    def log_path(self) -> str | None:
        return None if self._log is None else self._log.path

    def apply(self, event: Event) -> list[Plan]:
        """Validate, log, reduce and execute one event; returns the plans."""
        self._check_open()
        if self._log is not None:
            _check_record(event)
            reducers.validate(self._state, event)
            self._last_seq = self._log.append(event)
        try:
            self._state, plans = reducers.reduce(self._state, event)
        except InvalidEvent as exc:
            if self._log is None:
                raise
            raise AssertionError(f"reducer bug: validate accepted, reduce refused: {exc}") from exc
        if self.executor is not None:
            for plan in plans:
                self.executor.execute(plan)
        if type(event) is StepEnded:
            self._num_steps += 1
            if self.checkpoint_every and self._num_steps % self.checkpoint_every == 0:
                self._checkpoint()
        return plans

    def poll(self) -> list[TransferResult]:
        """Finished transfers from the executor, each logged and reduced as TransferFinished."""
        self._check_open()
        if self.executor is None:
            return []
        return self._finish(self.executor.poll())

    def wait(self, job_ids: Iterable[int] | None = None) -> list[TransferResult]:
        """Block until those transfers (all in flight, by default) finish; like ``poll``."""
        self._check_open()
        if self.executor is None:
            return []
        ids = None if job_ids is None else list(job_ids)
        if ids is not None and not ids:
            return []
        return self._finish(self.executor.wait(ids))

    def _finish(self, results: Sequence[TransferResult]) -> list[TransferResult]:
        for result in results:
            self.apply(TransferFinished(job_id=result.job_id, success=result.success))
        return list(results)

    # -- reading -------------------------------------------------------------------------
    def resolve(self, block_id: int) -> int:
        """The physical block that logical ``block_id`` lives in now."""
        self._check_range(block_id)
        return int(self._state.resolve(block_id))

    @overload
    def resolve_all(self, block_tables: list[list[int]]) -> list[list[int]]: ...
    @overload
    def resolve_all(self, block_tables: np.ndarray) -> np.ndarray: ...
    def resolve_all(self, block_tables: Any) -> Any:
        """Resolve whole block tables at once: a list of lists or a 2-D numpy array.

        Returns the same kind (a new list of lists; an array of the same dtype and shape).
        Negative entries in an array are padding and pass through unchanged.
        """
        if isinstance(block_tables, np.ndarray):
            return self._resolve_array(block_tables)
        rows = [np.asarray(row, dtype=np.int64) for row in block_tables]
        if not rows:
            return []
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
        if not np.issubdtype(table.dtype, np.integer):
            raise TypeError(f"block tables must hold integers, not {table.dtype}")
        valid = table >= 0
        top = int(table.max())
        if top >= self.config.num_gpu_blocks:
            raise BlockOutOfRange(f"block id {top} >= num_gpu_blocks {self.config.num_gpu_blocks}")
        out = table.copy()
        out[valid] = self._state.resolve_array(table[valid].astype(np.int64)).astype(table.dtype)
        return out

    def _check_range(self, block_id: int) -> None:
        if not 0 <= block_id < self.config.num_gpu_blocks:
            raise BlockOutOfRange(
                f"block id {block_id} is outside [0, {self.config.num_gpu_blocks})"
            )

    def digest(self) -> str:
        """Hex digest of the whole state (equal states, equal digests)."""
        return str(reducers.digest(self._state))

    def snapshot(self) -> bytes:
        """The whole state as bytes, for ``Engine.restore``."""
        return bytes(reducers.snapshot(self._state))

    # -- restore and resume --------------------------------------------------------------
    @classmethod
    def restore(
        cls,
        blob: bytes,
        log_path: str | os.PathLike[str] | None = None,
        executor: Executor | None = None,
        sync: SyncMode = "step",
        checkpoint_every: int = 256,
        snapshot_every: int = 16,
    ) -> Engine:
        """An engine continuing from ``snapshot()`` bytes.

        With ``log_path``, the log must be the one the snapshot came from: the engine
        appends to it, starting with a checkpoint of the restored state, so a replay of the
        log verifies that the snapshot matches what the log says.
        """
        state = reducers.restore(blob)
        config = state.config
        if config is None:
            raise ValueError(
                "cannot restore an engine from a snapshot taken before CacheConfigured"
            )
        last = -1 if log_path is None else _last_event_seq(log_path)
        if log_path is not None and last < 0:
            raise FileNotFoundError(
                f"{os.fspath(log_path)} holds no events: a restored engine continues the log "
                "its snapshot came from (start a new log with Engine(config, log_path))"
            )
        return cls(
            config,
            log_path,
            executor,
            sync,
            checkpoint_every,
            snapshot_every,
            _state=state,
            _last_event_seq=last,
        )

    @classmethod
    def resume(
        cls,
        log_path: str | os.PathLike[str],
        executor: Executor | None = None,
        sync: SyncMode = "step",
        checkpoint_every: int = 256,
        snapshot_every: int = 16,
    ) -> Engine:
        """Reopen an existing log (a torn tail is cut) and continue it where it ends.

        The state is rebuilt by a verified replay from the log's latest snapshot. Transfers
        that were in flight when the log ended are still in flight: the caller decides
        (``apply(TransferFinished(job_id, success=False))`` when their data is gone).
        """
        from kvlog.replay import replay_state

        LogWriter(log_path, sync="none").close()  # cut a torn tail before reading
        state, last = replay_state(log_path)
        config = state.config
        if config is None:
            raise FileNotFoundError(f"{os.fspath(log_path)} holds no events to resume")
        return cls(
            config,
            log_path,
            executor,
            sync,
            checkpoint_every,
            snapshot_every,
            _state=state,
            _last_event_seq=last,
        )

    # -- checkpoints and closing ---------------------------------------------------------
    def checkpoint(self, snapshot: bool = False) -> None:
        """Append a checkpoint now (with a snapshot if asked); no-op without a log."""
        self._check_open()
        self._checkpoint(force_snapshot=snapshot)

    def _checkpoint(self, force_snapshot: bool = False) -> None:
        if self._log is None:
            return
        self._num_checkpoints += 1
        with_snapshot = force_snapshot or (
            self.snapshot_every > 0 and self._num_checkpoints % self.snapshot_every == 0
        )
        record = Checkpoint(
            seq=self._last_seq,
            digest=self.digest(),
            step=int(self._state.step),
            snapshot=self.snapshot() if with_snapshot else b"",
        )
        self._log.append(record)

    def close(self) -> None:
        """Drain transfers (logging them), write a final checkpoint, close the log.

        Idempotent. The executor is the caller's: it is drained, not shut down.
        """
        if self._closed:
            return
        try:
            if self._log is None or not self._log.poisoned:
                if self.executor is not None:
                    self.wait()
                self._checkpoint(force_snapshot=True)
        finally:
            self._closed = True
            if self._log is not None:
                self._log.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise LogClosed("the engine is closed")
        if self._log is not None and self._log.poisoned:
            raise LogPoisoned(f"{self._log.path}: an earlier append failed; the engine stopped")

    def __enter__(self) -> Engine:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


def _check_record(event: Event) -> None:
    """Raise ``RecordRejected`` now for an event the log writer would refuse."""
    if not isinstance(event, _EVENT_TYPES):
        raise RecordRejected(f"not an event: {type(event).__name__}")
    if len(encode(event)) > MAX_RECORD_BYTES:
        raise RecordRejected(
            f"{type(event).__name__} encodes to more than {MAX_RECORD_BYTES} bytes"
        )


def _holds_records(path: str | os.PathLike[str]) -> bool:
    """Whether a log file exists with at least one record (read only, never modified)."""
    from kvlog.log import LogReader

    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return False
    return next(iter(LogReader(path).records()), None) is not None


def _last_event_seq(path: str | os.PathLike[str]) -> int:
    """Sequence number of the last event in a log (-1 when it holds none)."""
    from kvlog.log import LogReader

    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return -1
    last = -1
    for seq, record in LogReader(path).records():
        if not isinstance(record, Checkpoint):
            last = seq
    return last

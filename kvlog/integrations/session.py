"""The one Engine that the defragmenter facade and the offloading facades share.

Sharing is what makes the combination safe: a store resolves its (logical) GPU ids through
the same forward table that defrag updates, and defrag sees the blocks that unfinished
transfers pin. ``shared_session`` finds the session of a KV cache by its storage, so an
``OnlineDefragmenter`` and a ``KvlogOffloadingConnector`` worker built over the same tensors
in one process share one Engine (and one log), whichever is built first, with no wiring.

The Engine starts lazily, at the first event, so every facade can still declare what it
knows during start-up (the CPU pool, prefix caching, the runner's own tensors): the log's
``CacheConfigured`` then carries the whole geometry.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

import torch

from kvlog.analysis.figures import EngineFigures
from kvlog.analysis.policy import check_byte_budget
from kvlog.errors import ConfigError, LayoutError, LogExists, LogWriterError, MissingExtra
from kvlog.events import (
    BlocksAllocated,
    CacheConfigured,
    Event,
    Plan,
    StepEnded,
    StepScheduled,
    SwapPlan,
)
from kvlog.executors import Executor, TransferCompletion, make_executor
from kvlog.executors.layouts import KVCaches, register_layout
from kvlog.integrations.books import Claim, RequestBooks
from kvlog.integrations.config import FacadeConfig
from kvlog.integrations.holds import LoadHolds
from kvlog.integrations.metrics import (
    RecorderFigures,
    Reporter,
    metrics_enabled,
    recorder_figures,
)
from kvlog.integrations.registry import cache_tensors
from kvlog.log import LogStatus, is_log_directory, list_segments
from kvlog.log.detach import error_errno
from kvlog.runtime.engine import Engine
from kvlog.runtime.machine import Ticket

__all__ = [
    "Backend",
    "JobKind",
    "KvCacheSession",
    "LOOKUP_SENTINEL",
    "MAX_LOOKUP_BLOCKS",
    "derive_num_gpu_blocks",
]

LOOKUP_SENTINEL = -(1 << 62)
"""What ``forward_list`` holds past the pool: any sum of a table holding it is negative."""
MAX_LOOKUP_BLOCKS = 1 << 20
"""Pools up to this size keep ``forward_list`` (2 list entries per block); larger ones
resolve through numpy only."""

_logger = logging.getLogger("kvlog")
Backend = Literal["auto", "cpu", "cuda", "hpu", "fake"]
JobKind = Literal["store", "load"]


def _first_tensor(kv_caches: KVCaches) -> torch.Tensor:
    tensor = next(cache_tensors(kv_caches), None)
    if tensor is None:
        raise LayoutError("kv_caches holds no tensor: give at least one layer")
    return tensor


def derive_num_gpu_blocks(kv_caches: KVCaches, block_size: int) -> int:
    """``num_gpu_blocks`` of HPU-layout caches: first dim is ``(num_blocks + 1) * block_size``."""
    num_slots = int(_first_tensor(kv_caches).shape[0])
    if block_size < 1 or num_slots % block_size or num_slots // block_size < 2:
        raise LayoutError(
            f"key cache of {num_slots} slots is not (num_blocks + 1) * block_size "
            f"with block_size={block_size} and num_blocks >= 1"
        )
    return num_slots // block_size - 1


def _auto_backend(kv_caches: KVCaches) -> str:
    device = _first_tensor(kv_caches).device.type
    return device if device in ("cuda", "hpu") else "cpu"


def _log_path(config: FacadeConfig) -> str | None:
    """``KVLOG_PATH`` with ``{pid}`` replaced (one log per worker process); a path that
    already holds a log (a restarted server) becomes ``name.1.ext``, ``name.2.ext``, ...
    (a log directory: ``name.1/``, ...)."""
    if config.log_path is None:
        return None
    path = config.log_path.replace("{pid}", str(os.getpid()))
    if is_log_directory(path):
        path = path.rstrip("/")
        candidate, n = path, 0
        while os.path.isdir(candidate) and list_segments(candidate):
            n += 1
            candidate = f"{path}.{n}"
        return candidate + "/"
    stem, ext = os.path.splitext(path)
    candidate, n = path, 0
    while os.path.exists(candidate) and os.path.getsize(candidate) > 0:
        n += 1
        candidate = f"{stem}.{n}{ext}"
    return candidate


class _Caches:
    """KV-cache tensors as one facade registered them: their layout and geometry."""

    def __init__(self, kv_caches: KVCaches, block_size: int, num_gpu_blocks: int, layout: str):
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.layout = layout


class KvCacheSession:
    """Owns the Engine, its executor and its log; routes transfer completions to facades."""

    def __init__(
        self,
        config: FacadeConfig,
        *,
        prefix_caching: bool = False,
        backend: Backend = "auto",
        executor_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.config = config
        self.prefix_caching = prefix_caching
        self.backend = backend
        self.executor_options = dict(executor_options or {})
        self._caches: _Caches | None = None
        self.num_cpu_blocks = 0
        self.block_size_factor = 1
        self.quarantine = False
        self._engine: Engine | None = None
        self._log_error: LogStatus | None = None
        self._kinds: dict[int, JobKind] = {}
        self._finished: dict[JobKind, list[TransferCompletion]] = {"store": [], "load": []}
        self.holds = LoadHolds()
        """The placeholders that hold loads' blocks until a request claims them."""
        self.books = RequestBooks()
        """The runner's request tables as the defragmenter facade gave them (see books.py)."""
        self.step = 0
        self._lookup: list[int] | None = None
        self._lookup_moves = -1
        self.reporter: Reporter | None = None
        """The Engine's figures for the metrics (``kvlog.integrations.metrics``), once it
        started (None with ``KVLOG_METRICS=0``)."""
        self.reported_by_connector = False
        """Set by the connector's first ``get_kv_connector_stats``: the defragmenter then
        leaves the reporting to it."""
        self._pending: tuple[StepScheduled, Ticket, Callable[[], None]] | None = None
        """A step ``update_state`` checked, applied as one event by ``end_step`` (or as
        its fine-grained events by ``settle`` if anything else comes first); with the
        requests it releases, for the books."""
        self._kept: list[Callable[[], None]] = []
        """What applies the events facades keep for one batch (``keep``)."""

    # -- start-up ------------------------------------------------------------------------
    @property
    def kv_caches(self) -> KVCaches | None:
        return None if self._caches is None else self._caches.kv_caches

    @property
    def block_size(self) -> int:
        return 0 if self._caches is None else self._caches.block_size

    def bind_caches(
        self,
        kv_caches: KVCaches,
        block_size: int,
        *,
        num_gpu_blocks: int | None = None,
        layout: str = "hpu",
    ) -> None:
        """Remember a facade's caches (the latest before the first event wins: the runner's
        own tensors, with every scale, come after the connector's 4-D views)."""
        if num_gpu_blocks is None:
            num_gpu_blocks = derive_num_gpu_blocks(kv_caches, block_size)
        caches = _Caches(kv_caches, block_size, num_gpu_blocks, layout)
        if self._engine is not None:
            known = self._caches
            assert known is not None, "a started session has caches"
            if (known.num_gpu_blocks, known.block_size) != (num_gpu_blocks, block_size):
                raise ConfigError(
                    "kv_caches",
                    f"{num_gpu_blocks} blocks of {block_size}",
                    f"the shared cache's {known.num_gpu_blocks} blocks of {known.block_size}",
                )
            return
        previous, self._caches = self._caches, caches
        try:  # the layout registered, the policy checked against its pages, now
            self.cache_config()
        except BaseException:
            self._caches = previous
            raise

    def configure(self, config: FacadeConfig, prefix_caching: bool) -> None:
        """A facade's policy; before the first event, or again with the same values."""
        if self._engine is not None and (config, prefix_caching) != (
            self.config,
            self.prefix_caching,
        ):
            raise ConfigError("config", config, "the shared Engine's, set before its first step")
        self.config, self.prefix_caching = config, prefix_caching

    def attach_offload(
        self, num_cpu_blocks: int, block_size_factor: int, *, quarantine: bool = False
    ) -> None:
        """Declare the CPU pool; only before the first step, or again with the same values.
        ``quarantine``: the worker learns of the scheduler's transfers only after the
        runner's defrag call (vLLM's connector flow), so blocks released in a step are no
        defrag destination at its end (``CacheConfigured.quarantine_released``)."""
        quarantine = quarantine or self.quarantine
        if self._engine is not None and quarantine != self.quarantine:
            raise ConfigError("quarantine", quarantine, "attach before the first step")
        same = (num_cpu_blocks, block_size_factor) == (self.num_cpu_blocks, self.block_size_factor)
        if self._engine is not None and not same:
            raise ConfigError("num_cpu_blocks", num_cpu_blocks, "attach before the first step")
        if type(num_cpu_blocks) is not int or num_cpu_blocks < 0:
            raise ConfigError("num_cpu_blocks", num_cpu_blocks, "a non-negative int")
        if type(block_size_factor) is not int or block_size_factor < 1:
            raise ConfigError("block_size_factor", block_size_factor, "a positive int")
        self.num_cpu_blocks = num_cpu_blocks
        self.block_size_factor = block_size_factor
        self.quarantine = quarantine

    @property
    def started(self) -> bool:
        return self._engine is not None

    def cache_config(self) -> CacheConfigured:
        """The log's first event, from the caches and the configuration."""
        caches = self._caches
        if caches is None:
            raise ConfigError("kv_caches", None, "initialize(kv_caches, block_size) first")
        layout = register_layout(
            caches.kv_caches, caches.num_gpu_blocks, caches.block_size, caches.layout
        )
        config = CacheConfigured(
            num_gpu_blocks=caches.num_gpu_blocks,
            block_size=caches.block_size,
            num_cpu_blocks=self.num_cpu_blocks,
            block_size_factor=self.block_size_factor,
            prefix_caching=self.prefix_caching,
            page_size_bytes=layout.page_size_bytes,
            quarantine_released=self.quarantine,
            **self.config.policy_fields(),
        )
        check_byte_budget(config, "max_bytes_per_step")
        return config

    @property
    def engine(self) -> Engine:
        """The Engine, started now if this is its first use."""
        if self._engine is None:
            config = self.cache_config()
            caches = self._caches
            assert caches is not None, "cache_config() checked the caches"
            backend = self.backend
            if backend == "auto":
                backend = _auto_backend(caches.kv_caches)  # type: ignore[assignment]
            executor = make_executor(
                caches.kv_caches,
                config,
                backend=backend,
                layout=caches.layout,
                **self.executor_options,
            )
            self._engine = self._start_engine(config, executor)
            self._watch(self._engine)
        return self._engine

    def _watch(self, engine: Engine) -> None:
        """Figures for the metrics: an observer on the Engine's machine from its first
        event on, and the worker's recorder."""
        if not metrics_enabled():
            return
        figures = EngineFigures(clock=time.monotonic, hold_prefix=self.holds.prefix)
        engine.machine.observers.append(figures)
        reporter = Reporter()
        reporter.watch_engine(engine, figures)

        def recorder() -> RecorderFigures:
            status = self.log_status()
            return recorder_figures(
                status, engine.num_checkpoints, engine.recorder_lag_s(), engine.records_written
            )

        reporter.watch_recorder("worker", recorder, lambda: engine.recorder_attached)
        self.reporter = reporter

    def _start_engine(self, config: CacheConfigured, executor: Executor) -> Engine:
        """The Engine, recording to the configured log; a log that cannot be opened (a
        full disk, a bad path) is said once and the Engine goes on without it: the
        recorder never takes serving down (``log_status`` says so)."""
        facade = self.config
        path = _log_path(facade)
        directory = path is not None and is_log_directory(path)
        options: dict[str, Any] = {}
        if directory:
            options = {
                "segment_bytes": facade.segment_bytes,
                "retain_bytes": facade.retain_bytes,
                "retain_seconds": facade.retain_seconds,
                "compress": facade.compress,
            }
        try:
            return Engine(
                config,
                log_path=path,
                executor=executor,
                sync=facade.sync,
                sync_interval_s=facade.sync_interval_s,
                on_log_error="detach",
                **options,
            )
        except (LogWriterError, MissingExtra) as exc:  # no log; never ConfigError
            if isinstance(exc, LogExists):
                raise
            _logger.error(
                "kvlog: cannot open the log %s (%s): serving goes on unrecorded", path, exc
            )
            self._log_error = LogStatus(path, False, str(exc), error_errno(exc), 1)
            return Engine(config, executor=executor)

    def log_status(self) -> LogStatus:
        """Where the recorder stands (``Engine.log_status``; a log that never opened is
        reported detached with its error)."""
        if self._log_error is not None:
            return self._log_error
        if self._engine is None:
            return LogStatus(_log_path(self.config), self.config.log_path is not None)
        return self._engine.log_status()

    # -- running -------------------------------------------------------------------------
    def keep(self, flush: Callable[[], None]) -> None:
        """A facade keeps events for one batch (``OffloadingWorker.batched``, whose batch
        may span the connector's ``bind_connector_metadata`` and ``start_load_kv``): until
        ``let_go(flush)``, ``flush`` applies them, and the session calls it before anything
        else reaches the Engine through it (an event, a step's check or its apply, a poll, a
        wait), so that they come first, in the order of the calls."""
        if flush not in self._kept:
            self._kept.append(flush)

    def let_go(self, flush: Callable[[], None]) -> None:
        """The facade's batch ended (``keep``)."""
        if flush in self._kept:
            self._kept.remove(flush)

    def _apply_kept(self) -> None:
        if self._kept:
            for flush in tuple(self._kept):  # a flush applies through this session
                flush()

    def apply(self, event: Event) -> list[Plan]:
        self.settle()  # kept events, then a pending step (a facade's own flush: neither)
        return self.engine.apply(event)

    def pend(self, event: StepScheduled, ticket: Ticket, kept: Callable[[], None]) -> None:
        """Hold a whole step (``ticket``: the Engine's check of it against the state) for
        ``end_step``; ``kept`` keeps the books of it once it is applied (as one event
        there, or as its fine-grained events by ``settle``)."""
        assert self._pending is None, "pend() after settle(): facade bug"
        self._pending = (event, ticket, kept)

    def settle(self) -> None:
        """Apply a pending step's changes now, as the fine-grained events it stands for
        (without its ``StepEnded``): something else reached the Engine before the step's
        end, and must come after them. Kept events (``keep``) are applied first: the
        defragmenter settles before it checks a step."""
        self._apply_kept()
        if self._pending is None:
            return
        event, _, kept = self._pending
        self._pending = None
        engine = self.engine
        for fine in engine.view.expand_step(event)[:-1]:
            engine.apply(fine)
        kept()

    def end_step(self) -> list[Plan]:
        """Finished transfers first, then the step: the pending one as one
        ``StepScheduled`` event, else ``StepEnded``. The step's plans."""
        self._apply_kept()  # kept events came before the step's end (its check re-runs)
        view = self.engine.view
        if view.has_transfers():  # else the executor has nothing to report
            self.poll()
        pending = self._pending
        moves = view.num_moves
        if pending is None:
            plans = self.engine.apply(StepEnded(step=self.step))
        else:
            event, ticket, kept = pending
            plans = self.engine.apply(event, ticket)
            self._pending = None
            kept()
        self.step += 1
        if plans and self._lookup is not None and self._lookup_moves == moves:
            self._follow_moves(plans)
        return plans

    def forward_list(self) -> list[int]:
        """The forward table as a Python list (logical -> physical), followed by as many
        ``LOOKUP_SENTINEL`` entries, so that a negative id or one past the pool indexes a
        sentinel (negative) instead of a block. Rebuilt only when the mapping changed
        other than by a step's plan, which ``end_step`` follows in O(pairs)."""
        view = self.engine.view
        if self._lookup is None or self._lookup_moves != view.num_moves:
            size = view.num_gpu_blocks
            self._lookup = view.forward().tolist() + [LOOKUP_SENTINEL] * size
            self._lookup_moves = view.num_moves
        return self._lookup

    def _follow_moves(self, plans: list[Plan]) -> None:
        """Update the lookup list by a step's swap plan: only the logical ids now at its
        pairs' blocks changed."""
        lookup, view = self._lookup, self.engine.view
        assert lookup is not None, "_follow_moves() only follows a built lookup"
        bwd = view.backward()
        for plan in plans:
            if type(plan) is SwapPlan:
                for src, dst in plan.pairs:
                    lookup[bwd[src]] = src
                    lookup[bwd[dst]] = dst
        self._lookup_moves = view.num_moves

    def submitted(self, job_id: int, kind: JobKind) -> None:
        self._kinds[job_id] = kind

    def known(self, job_id: int) -> bool:
        """Whether this job was declared or submitted (it may have finished since)."""
        return self._engine is not None and job_id <= self._engine.view.last_job_id

    def poll(self) -> None:
        """Collect finished transfers (the Engine logs them) into per-direction queues.
        A pending step stays pending: finished transfers only unpin blocks, so they may
        come before its changes (the log records the order that happened)."""
        if self._engine is None:
            return
        self._apply_kept()
        self._route(self._engine.poll())

    def take_finished(self, kinds: Iterable[JobKind]) -> list[tuple[JobKind, TransferCompletion]]:
        """Poll once, then hand over the finished transfers of these kinds, kind by kind."""
        self.poll()
        out: list[tuple[JobKind, TransferCompletion]] = []
        for kind in kinds:
            queue = self._finished[kind]
            out.extend((kind, result) for result in queue)
            queue.clear()
        return out

    def wait(self, job_ids: Iterable[int] | None) -> None:
        """Block until those jobs (every job, for None) finish; results stay queued."""
        if self._engine is None:
            return
        self._apply_kept()
        ids = None if job_ids is None else [j for j in job_ids if j in self._kinds]
        if ids is not None and not ids:
            return
        self._route(self._engine.wait(ids))

    def _route(self, results: Iterable[TransferCompletion]) -> None:
        reporter = self.reporter
        for result in results:
            kind = self._kinds.pop(result.job_id, "store")
            self._finished[kind].append(result)
            if reporter is not None:
                reporter.note_finished(kind, result.num_bytes, result.elapsed_s)

    # -- blocks a load writes before the runner sees their request -----------------------
    def hold(
        self,
        job_id: int,
        gpu_block_ids: list[int],
        req_id: str | None = None,
        sync: bool | None = None,
        *,
        evict: bool = True,
    ) -> bool:
        """Keep a load's destination blocks used until a request claims them; True once
        done (``evict`` False: False, with nothing applied, where a stale holder would
        first have to be released).

        vLLM allocates a request's blocks, loads into them, and reports the request to the
        runner only when it is scheduled, possibly steps after the load ended. Until then
        the blocks must count as used, or defrag would move other blocks into them: a
        placeholder request holds them. Call this BEFORE the load's event (a block an
        unfinished load writes cannot be allocated).

        A sync load's request runs this step: blocks it already holds need no hold. An async
        load's request is waiting, so a block the books say it holds is stale (it was
        preempted and got the block back for the load). Without prefix caching, any stale
        holder (the loading request ``req_id`` itself included, for an async load) was
        preempted: ``books.evict`` releases what that proves. Where the loading request is
        not known, only blocks no request holds are held.
        """
        self.settle()  # kept events first, then a pending step
        engine = self.engine
        view = engine.view
        blocks = self.holds.not_held(gpu_block_ids)
        if req_id is not None and sync is not False:
            blocks = [b for b in blocks if not self.books.holds(req_id, b)]
        used = view.in_use(blocks)  # only a block some table holds can have a stale holder
        if req_id is not None and not self.prefix_caching and any(used):
            if not evict:
                return False
            stale = [b for b, u in zip(blocks, used, strict=True) if u]
            for step in self.books.evict(view, stale):
                assert not isinstance(step, Claim), "evict only releases"
                engine.apply(step)
            self.books.commit()
            used = view.in_use(blocks)
        if req_id is None or not self.prefix_caching:
            blocks = [b for b, u in zip(blocks, used, strict=True) if not u]
        if blocks:
            self._apply_hold(self.holds.hold(job_id, blocks))
        return True

    def _apply_hold(self, event: Event) -> None:
        self.apply(event)
        if type(event) is BlocksAllocated:
            self.holds.held(event)

    def claim(self, block_ids: Iterable[int]) -> None:
        """A request is being given these blocks: the placeholders that hold any of them
        let go, and hold on to the rest of their blocks under a new name."""
        for event in self.holds.claim(block_ids):
            self._apply_hold(event)

    @property
    def held_blocks(self) -> dict[int, str]:
        """Logical block -> the placeholder request that holds it for a load (a copy)."""
        return dict(self.holds.by_block)

    def close(self) -> None:
        if self._engine is not None:
            self.settle()
            self._engine.close()

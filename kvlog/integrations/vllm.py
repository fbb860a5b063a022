"""``KvlogOffloadingConnector``: vLLM's ``OffloadingConnector`` with kvlog's worker.

Selected by configuration alone::

    KVTransferConfig(
        kv_connector="KvlogOffloadingConnector",
        kv_connector_module_path="kvlog.integrations.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"cpu_bytes_to_use": ..., "blocks_per_chunk": ...},
    )

The scheduler side is vLLM's own (its CPU offloading manager decides every store and
load). The worker side is vLLM's ``OffloadingConnectorWorker`` over a kvlog
:class:`~kvlog.integrations.offload.OffloadingWorker` on the Engine that an
``OnlineDefragmenter`` over the same tensors uses, so defrag and transfers see each other:

- Every job of a step is declared (``deferred=True``: pinned, not yet run) in job-id order
  as soon as the worker learns of it: at ``handle_preemptions`` or, where the runner never
  calls it (vllm-gaudi), at ``bind_connector_metadata``. A store then reads the blocks the
  scheduler meant even though it runs a step later, after the runner's next defrag call.
- vLLM fences its own reuse of a block a store still reads with ``jobs_to_flush`` in
  ``handle_preemptions``; where the runner does not call it, binding the metadata does the
  same (submit, then wait), and kvlog's own reducer flushes such a store when the block is
  reallocated (``FencePlan``).
- ``submit_store`` / ``submit_load`` (``expedited`` too) run declared jobs; ``get_finished``
  reports ``job_id, success, transfer_size, transfer_time`` as vLLM's ``TransferResult``.

On the scheduler side, with ``KVLOG_PATH`` set, every call the scheduler makes of vLLM's
CPU offloading manager is recorded (``kvlog.tier.record``) into the scheduler process's own
log, ``scheduler_log_path(KVLOG_PATH)``: the CPU tier's inputs and answers, which
``kvlog.tier.replay.replay_tier`` replays exactly and ``kvlog sweep --cpu-bytes`` asks.

This module is the only one in kvlog that imports vLLM; every difference between the vLLM
releases it runs on (``SUPPORTED_VLLM``: 0.26, 0.33, 0.34) goes through
``kvlog.util.vllm_compat``. Under any other vLLM the connector's start (or this import, where
vLLM's modules moved) raises ``UnsupportedVllm``, one line naming those releases.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping
from typing import Any

import msgspec
import torch

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingConnectorMetadata,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
        OffloadingConnectorWorker,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )
except ImportError:  # a release whose connector modules moved: say which ones kvlog runs on
    from kvlog.errors import UnsupportedVllm
    from kvlog.util.vllm_compat import SUPPORTED_VLLM, unsupported

    found = unsupported()
    if found is not None:
        raise UnsupportedVllm(found, SUPPORTED_VLLM) from None
    raise

from kvlog.errors import UnsupportedVllm
from kvlog.events import CacheConfigured
from kvlog.integrations.config import config_from_env
from kvlog.integrations.metrics import PromMetrics, Reporter, metrics_enabled, recorder_figures
from kvlog.integrations.offload import DeclaredJob, OffloadingWorker
from kvlog.integrations.registry import shared_session
from kvlog.integrations.session import JobKind, KvCacheSession
from kvlog.log import LogStatus
from kvlog.reducers.tier_misses import TierExplainer
from kvlog.runtime.engine import Engine
from kvlog.tier.record import TierRecorder, tier_config_of
from kvlog.util import vllm_compat

__all__ = [
    "KvlogConnectorWorker",
    "KvlogOffloadingConnector",
    "check_vllm",
    "record_tier",
    "scheduler_log_path",
]


def check_vllm() -> str:
    """The installed vLLM's version, or ``UnsupportedVllm``: one line naming the supported
    releases (``kvlog.integrations.SUPPORTED_VLLM``)."""
    found = vllm_compat.unsupported()
    if found is not None:
        raise UnsupportedVllm(found, vllm_compat.SUPPORTED_VLLM)
    return vllm_compat.installed_vllm()


def _layers(kv_caches: Mapping[str, Any]) -> list[Any]:
    """Each layer as a tensor or a tuple of tensors (vllm-gaudi hands ``TensorTuple``s)."""
    out: list[Any] = []
    for layer in kv_caches.values():
        if isinstance(layer, torch.Tensor):
            out.append(layer)
        else:
            out.append(tuple(t for t in layer if isinstance(t, torch.Tensor)))
    return out


class KvlogConnectorWorker(OffloadingConnectorWorker):  # type: ignore[misc]
    """vLLM's connector worker, with kvlog's Engine doing the transfers."""

    def __init__(self, spec: Any, vllm_config: Any, kv_cache_config: Any) -> None:
        base = OffloadingConnectorWorker
        super().__init__(
            *vllm_compat.connector_worker_args(base, spec, vllm_config, kv_cache_config)
        )
        self.vllm_config = vllm_config  # vLLM 0.26's worker does not keep it
        self.session: KvCacheSession | None = None
        self.kvlog_worker: OffloadingWorker | None = None
        """kvlog's worker; ``self.worker`` is what vLLM calls (the same, or on vLLM 0.34
        the same behind ``vllm_compat.IdentityPointers``)."""
        self._bound = False
        """``bind`` (or ``handle_preemptions``) opened the worker's batch, for
        ``start_kv_transfers`` to apply."""

    # -- start-up -------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:  # type: ignore[override]
        """Join (or start) the session of these tensors and give vLLM a kvlog worker."""
        prefix_caching = bool(self.vllm_config.cache_config.enable_prefix_caching)
        backend = self.spec.extra_config.get("kvlog_backend", "auto")

        def new_session() -> KvCacheSession:
            return KvCacheSession(config_from_env(), prefix_caching=prefix_caching, backend=backend)

        layers = _layers(kv_caches)
        session, new = shared_session(layers, new_session)
        if session.kv_caches is None:  # the runner's own tensors (with scales) win
            session.bind_caches(
                layers,
                self.vllm_config.cache_config.block_size,
                num_gpu_blocks=int(self.kv_cache_config.num_blocks),
                layout="auto",
            )
        if not new and not session.started:
            session.configure(session.config, prefix_caching)
        self.session = session
        num_chunks = vllm_compat.spec_num_chunks(self.spec)
        blocks_per_chunk = int(self.spec.blocks_per_chunk)
        worker = OffloadingWorker(session, num_chunks, blocks_per_chunk, quarantine=True)
        self.kvlog_worker = worker
        vllm_compat.attach_worker(self, worker, OffloadingConnectorWorker, self.kv_cache_config)

    @property
    def engine(self) -> Engine:
        assert self.session is not None, "register_kv_caches() first"
        return self.session.engine

    # -- the step -------------------------------------------------------------------------
    def declare(self, metadata: OffloadingConnectorMetadata) -> None:
        """Pin every job of this step not declared yet, in job-id order."""
        worker = self.kvlog_worker
        assert worker is not None, "register_kv_caches() first"
        jobs: list[tuple[int, JobKind, Any]] = [
            (job_id, "load", entry) for job_id, entry in metadata.load_jobs.items()
        ]
        if vllm_compat.is_store_writer(self):  # other ranks never submit stores
            jobs += [(job_id, "store", entry) for job_id, entry in metadata.store_jobs.items()]
        assert self.session is not None, "register_kv_caches() first"
        declared: list[DeclaredJob] = [
            (kind, job_id, entry.src_spec, entry.dst_spec, str(entry.req_id),
             vllm_compat.load_is_sync(entry))
            for job_id, kind, entry in sorted(jobs, key=lambda job: job[0])
            if not worker.knows(job_id)
        ]  # fmt: skip
        with worker.batched():  # one TransferBatch for the step's declarations
            worker.declare_step(declared)

    def handle_preemptions(self, kv_connector_metadata: OffloadingConnectorMetadata) -> None:
        """vLLM's fence of ``jobs_to_flush``, after declaring the step's jobs; what it
        declares and submits stays in the batch for ``start_kv_transfers`` (see ``bind``),
        unless its ``jobs_to_flush`` wait needs it applied."""
        self._declare_kept(kv_connector_metadata, fence=True)

    def start_kv_transfers(self, metadata: OffloadingConnectorMetadata) -> None:
        """vLLM's submissions of the step, applied with the step's declarations (``bind``)
        as one ``TransferBatch`` (before a sync load's wait, which needs them)."""
        try:
            with self._batched():
                super().start_kv_transfers(metadata)
        finally:
            self._end_bound()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """vLLM's ``get_finished`` (a ``bind`` no ``start_kv_transfers`` followed is
        applied first)."""
        self._end_bound()
        return super().get_finished(finished_req_ids)  # type: ignore[no-any-return]

    def _batched(self) -> contextlib.AbstractContextManager[None]:
        worker = self.kvlog_worker
        assert worker is not None, "register_kv_caches() first"
        return worker.batched()

    def bind(self, metadata: OffloadingConnectorMetadata) -> None:
        """Declare the step's jobs, and fence ``jobs_to_flush`` (again, if the runner called
        ``handle_preemptions``: then the jobs are done and this costs nothing).

        The declarations stay in the worker's batch for ``start_kv_transfers``: vLLM's
        runners and vllm-gaudi's call it right after, and the step's declarations and
        submissions are then one ``TransferBatch``, one check and one log record. Whatever
        else reaches the Engine first (the defragmenter, a poll, a wait) applies them
        before itself (``KvCacheSession.keep``); a refused declaration raises there."""
        self._declare_kept(metadata, fence=bool(metadata.jobs_to_flush))

    def _declare_kept(self, metadata: OffloadingConnectorMetadata, fence: bool) -> None:
        """Declare the step's jobs into the worker's batch for ``start_kv_transfers`` (a
        new one, or the one ``handle_preemptions`` or a ``bind`` no ``start_kv_transfers``
        followed opened), then, with ``fence``, vLLM's ``handle_preemptions`` (its deferred
        stores submitted, its ``jobs_to_flush`` waited for). On an exception what was kept
        is applied, as the calls one by one would have, and the batch is closed."""
        worker = self.kvlog_worker
        assert worker is not None, "register_kv_caches() first"
        if not self._bound:
            self._bound = worker.begin_batch()
        try:
            self.declare(metadata)
            if fence:
                super().handle_preemptions(metadata)
        except BaseException:
            self._end_bound()
            raise

    def _end_bound(self) -> None:
        """Apply the batch ``bind`` or ``handle_preemptions`` opened (if one did) and close
        it."""
        if self._bound:
            self._bound = False
            worker = self.kvlog_worker
            assert worker is not None, "bound by bind()"
            worker.end_batch()


def scheduler_log_path(log_path: str) -> str:
    """Where the scheduler process logs the CPU tier, next to the workers' log: a
    ``scheduler`` log inside a log directory, else ``NAME.scheduler.EXT`` beside ``NAME.EXT``."""
    if log_path.endswith(os.sep) or os.path.isdir(log_path):
        return os.path.join(log_path, "scheduler.kvlog")
    root, ext = os.path.splitext(log_path)
    return f"{root}.scheduler{ext or '.kvlog'}"


def _tier_config(scheduler: Any, vllm_config: Any) -> Any:
    spec = getattr(scheduler, "config", None)
    blocks_per_chunk = int(getattr(spec, "blocks_per_chunk", 1) or 1)
    block_size = int(vllm_config.cache_config.block_size)
    tier = tier_config_of(scheduler.manager, blocks_per_chunk)
    return msgspec.structs.replace(tier, tokens_per_chunk=blocks_per_chunk * block_size)


def record_tier(
    scheduler: Any, vllm_config: Any, kv_cache_config: Any, reporter: Reporter | None = None
) -> Engine | None:
    """With ``KVLOG_PATH`` set, wrap the scheduler side's CPU offloading manager in a
    ``TierRecorder`` that logs every call into the scheduler process's own log (an Engine
    with no GPU books to keep: defrag off); None without ``KVLOG_PATH`` or a CPU manager.
    With a ``reporter``, the calls are explained for the metrics too (``TierExplainer``:
    the code that explains the log offline) and the log's recorder is reported."""
    config = config_from_env()
    manager = getattr(scheduler, "manager", None)
    if manager is None or not vllm_compat.is_cpu_manager(manager):
        return None
    if config.log_path is None:
        if reporter is not None:  # no log: the calls are explained all the same
            try:
                tier = _tier_config(scheduler, vllm_config)
            except AttributeError as exc:  # a manager kvlog cannot read: no tier figures
                logging.getLogger("kvlog").warning("kvlog: no CPU tier metrics: %r", exc)
                return None
            explainer = TierExplainer()
            reporter.watch_tier(explainer)
            scheduler.manager = TierRecorder(manager, explainer.feed, tier)
        return None
    block_size = int(vllm_config.cache_config.block_size)
    cache = CacheConfigured(
        num_gpu_blocks=max(1, int(kv_cache_config.num_blocks)), block_size=block_size, defrag=False
    )
    path = scheduler_log_path(config.log_path)
    try:
        engine = Engine(cache, log_path=path, sync="none", on_log_error="detach")
    except Exception as exc:  # the recorder never takes serving down
        logging.getLogger("kvlog").error("kvlog: no CPU tier log: %r", exc)
        return None
    tier = _tier_config(scheduler, vllm_config)
    sink: Any = engine.apply
    if reporter is not None:
        explainer = TierExplainer()
        reporter.watch_tier(explainer)

        def sink(event: Any) -> None:
            engine.apply(event)
            explainer.feed(event)

        def figures() -> Any:
            status = engine.log_status()
            return recorder_figures(
                status, engine.num_checkpoints, engine.recorder_lag_s(), engine.records_written
            )

        reporter.watch_recorder("scheduler", figures, lambda: engine.recorder_attached)
    scheduler.manager = TierRecorder(manager, sink, tier, batched=True)
    return engine


class KvlogOffloadingConnector(OffloadingConnector):  # type: ignore[misc]
    """vLLM's ``OffloadingConnector``; on the worker, kvlog keeps the books and moves bytes."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        check_vllm()
        super().__init__(vllm_config, role, kv_cache_config)
        self.tier_engine: Engine | None = None
        self.tier_reporter: Reporter | None = None
        if role == KVConnectorRole.SCHEDULER:
            vllm_compat.clamp_finished_stores(self.connector_scheduler)
            self.tier_reporter = Reporter() if metrics_enabled() else None
            self.tier_engine = record_tier(
                self.connector_scheduler, vllm_config, kv_cache_config, self.tier_reporter
            )
        if role == KVConnectorRole.WORKER:
            worker: Any = getattr(self, "connector_worker", None)
            assert worker is not None, "the WORKER role builds a connector worker"
            self.connector_worker: Any = KvlogConnectorWorker(
                worker.spec, vllm_config, worker.kv_cache_config
            )

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        worker = self.connector_worker
        if isinstance(worker, KvlogConnectorWorker):
            assert isinstance(connector_metadata, OffloadingConnectorMetadata)
            worker.bind(connector_metadata)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        """vLLM's metadata; then the CPU tier's calls of the step go to the scheduler's
        log as one record (those of ``update_from_output`` go with the next step's)."""
        metadata = super().build_connector_meta(scheduler_output)
        self._flush_tier()
        return metadata

    def _flush_tier(self) -> None:
        recorder = getattr(self.connector_scheduler, "manager", None)
        if self.tier_engine is not None and isinstance(recorder, TierRecorder):
            recorder.flush()

    def shutdown(self) -> None:
        super().shutdown()
        if self.tier_engine is not None:  # the scheduler's log of the CPU tier
            self._flush_tier()
            engine, self.tier_engine = self.tier_engine, None
            engine.close()

    # -- metrics (kvlog.integrations.metrics) ---------------------------------------------
    def get_kv_connector_stats(self) -> Any:
        """vLLM's offloading stats (scheduler side), with kvlog's figures merged in when a
        payload is due: the worker's Engine and recorder, the scheduler's CPU tier and tier
        log. vLLM sums the workers' payloads and merges the scheduler's."""
        stats = super().get_kv_connector_stats()
        payload = self._kvlog_payload()
        if payload is None:
            return stats
        ours = self.build_kv_connector_stats(payload)
        if stats is None or stats.is_empty():
            return ours
        return stats.aggregate(ours)

    def _kvlog_payload(self) -> dict[str, Any] | None:
        if self.tier_reporter is not None:
            return self.tier_reporter.take()
        worker = self.connector_worker
        session = worker.session if isinstance(worker, KvlogConnectorWorker) else None
        if session is None or session.reporter is None:
            return None
        session.reported_by_connector = True
        return session.reporter.take()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> Any:
        """kvlog's ``kvlog_`` series next to vLLM's own (its ``OffloadPromMetrics``)."""
        inner = super().build_prom_metrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues
        )
        return PromMetrics(metric_types, labelnames, per_engine_labelvalues, inner)

    @property
    def engine(self) -> Engine:
        """The shared kvlog Engine (worker side)."""
        worker = self.connector_worker
        assert isinstance(worker, KvlogConnectorWorker), "the worker side has the Engine"
        return worker.engine

    def log_status(self) -> LogStatus:
        """Where the worker's recorder stands (the connector serves on either way)."""
        worker = self.connector_worker
        assert isinstance(worker, KvlogConnectorWorker), "the worker side has the log"
        assert worker.session is not None, "register_kv_caches() first"
        return worker.session.log_status()

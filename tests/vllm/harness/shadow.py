"""The plain vLLM worker beside kvlog's connector: what the runner's connector calls cost
without kvlog (``RunResult.plain_s``), timed in the same loop on the same calls.

vLLM's own ``OffloadingConnector`` (WORKER role) with the harness's :class:`ReferenceWorker`
(vLLM's CPU worker semantics on plain tensors, copies at submit) over its own copy of the KV
tensors, so it never touches kvlog's bytes. Each step it gets its own copy of the scheduler's
metadata (vLLM's ``handle_preemptions`` pops ``store_jobs``: neither connector may see the
other's changes). Like the seed shadow of the defragmenter: its decisions are not checked,
and a failure only ends the shadow with a note, never the run.
"""

from __future__ import annotations

import copy
import time
from typing import Any

from kvlog.util import vllm_compat
from tests.vllm.harness.configs import RunConfig
from tests.vllm.harness.kvcache import KvCache, ReferenceWorker
from tests.vllm.harness.results import RunResult

__all__ = ["PlainShadow", "own_metadata"]

NOTE = "plain shadow"
"""The ``RunResult.details`` kind of the shadow's notes (its presence: the shadow stopped)."""


def own_metadata(meta: Any) -> Any:
    """A copy of the scheduler's connector metadata whose containers (``load_jobs``,
    ``store_jobs``, ``jobs_to_flush``) are the copy's own; the jobs themselves are shared
    (neither worker changes a job)."""
    twin = copy.copy(meta)
    for name, value in vars(twin).items():
        if isinstance(value, (dict, set, list)):
            setattr(twin, name, copy.copy(value))
    return twin


class PlainShadow:
    """vLLM's connector worker with no kvlog, fed the runner's connector calls."""

    def __init__(self, connector: Any, result: RunResult) -> None:
        self.connector: Any = connector
        self.result = result
        self._theirs: Any = None  # the step's metadata as the scheduler handed it
        self._ours: Any = None  # the shadow's copy of it

    @classmethod
    def build(
        cls, vllm_config: Any, kv_cache_config: Any, kv: KvCache, cfg: RunConfig, result: RunResult
    ) -> PlainShadow | None:
        """Built as the "reference" configurations build theirs; None (with a note) where
        this vLLM will not build it."""
        from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
            OffloadingConnector,
        )

        try:
            connector = OffloadingConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
            conn_worker = connector.connector_worker
            num_chunks = vllm_compat.spec_num_chunks(conn_worker.spec)
            worker = ReferenceWorker(kv.clone(), cfg.blocks_per_chunk, num_chunks)
            vllm_compat.attach_worker(conn_worker, worker, type(conn_worker), kv_cache_config)
        except Exception as exc:
            result.note(NOTE, f"not built: {exc!r}")
            return None
        return cls(connector, result)

    @property
    def running(self) -> bool:
        return self.connector is not None

    def begin_step(self, meta: Any) -> None:
        """The step's metadata, before any connector sees it (not timed: a plain runner
        has no second connector to copy it for)."""
        if self.connector is not None:
            self._theirs, self._ours = meta, own_metadata(meta)

    def call(self, name: str, *args: Any) -> None:
        """The connector call ``name`` the runner just made on kvlog's, on the shadow's
        connector with the shadow's metadata, timed into ``plain_s``."""
        if self.connector is None:
            return
        args = tuple(self._ours if a is self._theirs else a for a in args)
        t0 = time.perf_counter()
        try:
            getattr(self.connector, name)(*args)
        except Exception as exc:  # the comparison stops there; kvlog's run goes on
            self.connector = None
            self.result.plain_s = 0.0
            self.result.note(NOTE, f"stopped at {name}: {exc!r}")
            return
        self.result.plain_s += time.perf_counter() - t0

    def shutdown(self) -> None:
        """The connector's shutdown (not timed: the end of the run)."""
        connector, self.connector = self.connector, None
        if connector is None:
            return
        try:
            connector.shutdown()
        except Exception as exc:
            self.result.note(NOTE, f"shutdown raised {exc!r}")

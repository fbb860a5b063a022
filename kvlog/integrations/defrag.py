"""``OnlineDefragmenter``: the Gaudi plugin's defragmenter surface, backed by a kvlog Engine.

A drop-in for ``vllm_gaudi.extension.defragmentation.OnlineDefragmenter`` as the HPU model
runner uses it, per step::

    defragmenter.update_state(new | cached, scheduler_output.finished_req_ids)
    defragmenter.defragment()
    block_tables = defragmenter.resolve_all(block_tables)

Every call becomes events on one Engine (``RequestFinished`` before ``BlocksAllocated``,
DESIGN.md's order rule, then ``StepEnded``), so with ``KVLOG_PATH`` set the server records
its log for free and the log replays offline to the same swaps. The swaps themselves are
plans that the executor applies to the runner's ``kv_caches``. The offloading facades in
``kvlog.integrations.offload`` attach to the same Engine through :attr:`session`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import numpy as np

from kvlog.engine import Engine
from kvlog.errors import BlockInUse, ConfigError
from kvlog.events import (
    DEFAULT_PAD_SIZES,
    BlocksAllocated,
    RequestFinished,
    RequestPreempted,
    StepEnded,
    SwapPlan,
)
from kvlog.executors import Executor
from kvlog.executors.layouts import KVCaches
from kvlog.integrations.config import FacadeConfig, config_from_env
from kvlog.integrations.session import Backend, KvCacheSession

__all__ = ["CacheSwapHandle", "OnlineDefragmenter"]


def _ids(blocks: Iterable[Any]) -> list[int]:
    """Plain ints from a list, tuple or numpy array of block ids."""
    return [int(b) for b in blocks]


class CacheSwapHandle:
    """What the plugin's runner expects at ``defragmenter.cache_utils``.

    ``kv_caches`` is there because the worker's sleep mode clears it; ``swap`` runs pairs on
    the tensors without bookkeeping, so it refuses while any block is live or pinned.
    """

    def __init__(self, defragmenter: OnlineDefragmenter, kv_caches: KVCaches) -> None:
        self._defragmenter = defragmenter
        self.kv_caches: KVCaches | None = kv_caches

    def swap(self, to_swap: Sequence[tuple[int, int]], threshold: int) -> None:
        """Warm-up only: run ``to_swap`` padded to ``threshold`` (no block may be in use)."""
        self._defragmenter.run_unlogged_swap([(int(s), int(d)) for s, d in to_swap], threshold)


class OnlineDefragmenter:
    """The seed's surface over :class:`~kvlog.integrations.session.KvCacheSession`.

    Arguments not given come from the environment (``VLLM_DEFRAG``,
    ``VLLM_DEFRAG_THRESHOLD``, ``VLLM_DEFRAG_WITH_GRAPHS``, ``KVLOG_PATH``, ``KVLOG_SYNC``);
    ``prefix_caching`` is the plugin's ``get_config().prefix_caching``.
    """

    def __init__(
        self,
        *,
        prefix_caching: bool = False,
        config: FacadeConfig | None = None,
        environ: Mapping[str, str] | None = None,
        backend: Backend = "auto",
        executor_options: Mapping[str, Any] | None = None,
        **overrides: Any,
    ) -> None:
        self.config = config or config_from_env(environ, **overrides)
        self.to_swap_pad_thresholds = list(DEFAULT_PAD_SIZES)
        self.session = KvCacheSession(
            self.config,
            prefix_caching=prefix_caching,
            backend=backend,
            pad_sizes=self.to_swap_pad_thresholds,
            executor_options=executor_options,
        )
        self.cache_utils: CacheSwapHandle | None = None
        self.last_swap: SwapPlan | None = None
        self.debug = None

    # -- the seed's attributes -----------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return self.config.defrag

    @property
    def threshold(self) -> int:
        return self.config.threshold

    @property
    def graphed(self) -> bool:
        return self.config.with_graphs

    @property
    def engine(self) -> Engine:
        """The shared Engine (started on first use)."""
        return self.session.engine

    # -- the runner's calls --------------------------------------------------------------
    def initialize(self, kv_caches: KVCaches, block_size: int) -> None:
        """Bind the runner's KV caches (HPU layout); ``num_gpu_blocks`` comes from their shape."""
        self.session.bind_caches(kv_caches, block_size)
        self.cache_utils = CacheSwapHandle(self, kv_caches)

    def update_state(
        self,
        new_blocks: Mapping[str, Sequence[int]],
        finished_reqs: Iterable[str],
        preempted_reqs: Iterable[str] = (),
    ) -> None:
        """Finished, then preempted requests release their blocks; then the new blocks."""
        for req_id in finished_reqs:
            self.session.apply(RequestFinished(req_id=str(req_id)))
        for req_id in preempted_reqs:
            self.session.apply(RequestPreempted(req_id=str(req_id)))
        for req_id, blocks in new_blocks.items():
            block_ids = _ids(blocks)
            if block_ids:
                self.session.release_holds(block_ids)
                self._allocate(str(req_id), block_ids)

    def _allocate(self, req_id: str, block_ids: list[int]) -> None:
        """``BlocksAllocated``. A block still held by a live request (without prefix caching)
        means the scheduler preempted that request without the runner saying so (vLLM's
        runner does not pass preemptions; a resumed request even gets its own blocks back):
        release the holders, then allocate."""
        try:
            self.session.apply(BlocksAllocated(req_id=req_id, block_ids=block_ids))
        except BlockInUse:
            state = self.session.engine.state
            wanted = set(block_ids)
            owners = [
                owner
                for owner in state.live_requests()
                if wanted.intersection(state.request_blocks(owner))
            ]
            if not owners:
                raise
            for owner in owners:
                self.session.apply(RequestPreempted(req_id=owner))
            self.session.apply(BlocksAllocated(req_id=req_id, block_ids=block_ids))

    def defragment(self) -> None:
        """End the step: collect finished transfers, then ``StepEnded`` (swaps run now)."""
        self.session.poll()
        plans = self.session.apply(StepEnded(step=self.session.step))
        self.session.step += 1
        swaps = [p for p in plans if isinstance(p, SwapPlan)]
        self.last_swap = swaps[-1] if swaps else None

    def resolve(self, block_id: int) -> int:
        """Logical -> physical; ids the Engine does not know (pads, -1) pass unchanged."""
        if not self.session.started:
            return block_id
        return int(self.session.engine.state.resolve(block_id))

    def resolve_all(self, block_table_list: Sequence[Sequence[int]]) -> list[list[int]]:
        """:meth:`resolve` over every table, vectorized (one numpy pass for all tables)."""
        if not self.session.started or not block_table_list:
            return [_ids(table) for table in block_table_list]
        lengths = [len(t) for t in block_table_list]
        chained = itertools.chain.from_iterable(block_table_list)
        flat = np.fromiter(chained, np.int64, sum(lengths))
        resolved = self.session.engine.state.resolve_array(flat).tolist()
        ends = itertools.accumulate(lengths)
        return [resolved[end - n : end] for end, n in zip(ends, lengths, strict=True)]

    def unresolve(self, block_id: int) -> int:
        """Physical -> logical."""
        if not self.session.started:
            return block_id
        return int(self.session.engine.state.unresolve(block_id))

    # -- views for debugging and the plugin's tests --------------------------------------
    @property
    def used_blocks(self) -> dict[int, int]:
        """Physical block -> reference count, like the seed's ``used_blocks``."""
        if not self.session.started:
            return {}
        refs = self.session.engine.state.refs
        return {int(b): int(refs[b]) for b in np.flatnonzero(refs)}

    @property
    def req_blocks(self) -> dict[str, list[int]]:
        """Request -> its logical block table."""
        if not self.session.started:
            return {}
        state = self.session.engine.state
        return {r: list(state.request_blocks(r)) for r in state.live_requests()}

    # -- warm-up -------------------------------------------------------------------------
    def warmup(self) -> None:
        """One data-neutral swap per pad bucket, not logged, before serving.

        This traces or compiles every padded swap shape, like the plugin's warm-up, and
        leaves every byte and the state as they were, so replay stays exact: in ``"swap"``
        mode blocks 1 and 2 are swapped twice; in ``"move"`` mode block 1 is moved onto
        block 2 and block 2's bytes are put back.
        """
        if not self.enabled or self.session.cache_config().num_gpu_blocks < 3:
            return
        executor = self._idle_executor()
        for pad in self.to_swap_pad_thresholds:
            if self.session.prefix_caching:
                self._execute_swap([(1, 2)], pad)
                self._execute_swap([(1, 2)], pad)
            else:
                saved = executor.read_gpu_block(2)
                self._execute_swap([(1, 2)], pad)
                executor.write_gpu_block(2, saved)

    def run_unlogged_swap(self, pairs: list[tuple[int, int]], padded_to: int) -> None:
        """The plugin's ``cache_utils.swap``: only while no block is in use or pinned."""
        self._idle_executor()
        self._execute_swap(pairs, padded_to)

    def _idle_executor(self) -> Executor:
        engine = self.session.engine
        if engine.state.live_requests() or engine.state.jobs_in_flight():
            raise ConfigError("swap", "<warm-up>", "warm-up swaps only while no block is in use")
        assert engine.executor is not None, "the session always gives the Engine an executor"
        return engine.executor

    def _execute_swap(self, pairs: list[tuple[int, int]], padded_to: int) -> None:
        mode: Literal["swap", "move"] = "swap" if self.session.prefix_caching else "move"
        plan = SwapPlan(step=-1, pairs=pairs, padded_to=padded_to, mode=mode)
        self._idle_executor().execute(plan)

    def close(self) -> None:
        """Close the Engine and its log (flushes and syncs)."""
        self.session.close()

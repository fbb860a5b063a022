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

from collections.abc import Callable, Iterable, Mapping, Sequence
from operator import itemgetter
from typing import Any, Literal

import numpy as np
import torch

from kvlog.errors import BlockInUse, BlockOutOfRange, ConfigError, InvalidEvent
from kvlog.events import StepScheduled, SwapPlan
from kvlog.executors import Executor
from kvlog.executors.layouts import KVCaches
from kvlog.integrations import books as books_plan
from kvlog.integrations.books import Claim
from kvlog.integrations.config import FacadeConfig, config_from_env
from kvlog.integrations.debug_lines import DefragLines
from kvlog.integrations.holds import Claims
from kvlog.integrations.metrics import MultiprocessExporter, process_exporter
from kvlog.integrations.registry import shared_session
from kvlog.integrations.session import (
    MAX_LOOKUP_BLOCKS,
    Backend,
    KvCacheSession,
    derive_num_gpu_blocks,
)
from kvlog.log import LogStatus
from kvlog.reducers.ranges import holds_pool_ids
from kvlog.runtime.engine import Engine
from kvlog.runtime.machine import Ticket
from kvlog.runtime.tables import block_table_row

__all__ = ["CacheSwapHandle", "OnlineDefragmenter", "detect_prefix_caching"]


def _ids(blocks: Iterable[Any]) -> list[int]:
    """Block ids as a new list, never cast: a list copied, a 1-D integer numpy array or
    tensor as plain ints, a tuple or other iterable as a list of its items; the step's
    validation refuses anything that is not an int (a float, a bool, a string)."""
    if type(blocks) is list:
        return blocks.copy()
    if isinstance(blocks, torch.Tensor):
        blocks = blocks.cpu().numpy()
    if isinstance(blocks, np.ndarray):
        if blocks.ndim != 1 or blocks.dtype.kind not in "iu":
            raise InvalidEvent(
                f"block ids must be a 1-D integer array, not {blocks.dtype} of shape {blocks.shape}"
            )
        return blocks.tolist()  # type: ignore[no-any-return]
    return [int(b) if isinstance(b, np.integer) else b for b in blocks]


def _table_ids(table: Any) -> np.ndarray:
    """One block table as an int64 array, checked by ``Engine.resolve_all``'s row rule
    (``block_table_row``: integers only, no float, bool or string cast on the way), and
    one-dimensional."""
    if isinstance(table, torch.Tensor):
        table = table.cpu().numpy()
    ids = block_table_row(table)
    if ids.size == 0:
        return ids.reshape(0)
    if ids.ndim != 1:
        raise BlockOutOfRange(f"a block table must be a 1-D list of int ids, not {ids.shape}")
    return ids


def _allocations(new_blocks: Mapping[str, Sequence[int]]) -> dict[str, list[int]]:
    """The runner's ``new_blocks`` as request id -> plain block ids (``_ids``: new lists,
    never cast)."""
    return {r if type(r) is str else str(r): _ids(b) for r, b in new_blocks.items()}


def _req_ids(req_ids: Iterable[Any]) -> list[str]:
    """Request ids as plain strings; a set's (vLLM's ``finished_req_ids``) sorted, so the
    log does not depend on the process's string hash seed: every tensor-parallel rank logs
    the same events (``kvlog ranks``)."""
    ids = [r if type(r) is str else str(r) for r in req_ids]
    return sorted(ids) if isinstance(req_ids, (set, frozenset)) else ids


def _fast_step(
    session: KvCacheSession, engine: Engine, event: StepScheduled, released: set[str],
    claims: Claims,
) -> Ticket | None:  # fmt: skip
    """The Engine's ticket for the step as one event, when it can be one: the step states
    every placeholder its blocks take over (``claims``), the books infer nothing, and the
    Engine's check accepts it. None where the books must step in (a block still counted
    as used: the caller infers); any other refusal is raised (nothing changed)."""
    new = event.allocated
    holds = session.holds.by_block
    if not claims.released and holds and any(not holds.keys().isdisjoint(b) for b in new.values()):
        return None  # a placeholder's block the step does not release: fine-grained
    prefix_caching = session.prefix_caching
    verdict = engine.verdict(event, () if prefix_caching else (BlockInUse,))
    if not isinstance(verdict, Ticket):
        return None  # a block still counted as used: the books infer what freed it
    # A block an unfinished store still reads is fenced when the step applies, at
    # defragment(), before the forward writes it (the runner calls the two back to back).
    if prefix_caching and engine.view.held_by_receiver(new, released):
        return None
    return verdict


def _claiming(step: StepScheduled, claims: Claims) -> StepScheduled:
    """``step`` releasing the placeholders ``claims`` names (first, among its finished) and
    holding the rest of their blocks again (first among its allocations)."""
    if not claims.released:
        return step
    return StepScheduled(
        step=step.step, allocated={**claims.held, **step.allocated},
        finished=[*step.finished, *claims.released], preempted=step.preempted,
        resumed=step.resumed,
    )  # fmt: skip


def detect_prefix_caching() -> bool:
    """Prefix caching as the Gaudi plugin (``get_config().prefix_caching``) or vLLM's
    current config says; False where neither is importable or configured."""
    try:
        from vllm_gaudi.extension.runtime import get_config  # type: ignore[import-not-found]

        return bool(get_config().prefix_caching)
    except Exception:  # no plugin, or no config yet
        pass
    try:
        from vllm.config import get_current_vllm_config

        return bool(get_current_vllm_config().cache_config.enable_prefix_caching)
    except Exception:  # no vLLM, or no current config
        return False


class CacheSwapHandle:
    """What the plugin's runner expects at ``defragmenter.cache_utils``.

    ``kv_caches`` is there because the worker's sleep mode clears it. Calling it as the
    plugin's ``CacheSwapUtils`` (``cache_utils(srcs, dsts, caches, block_size)``, ids padded
    with -1) or ``swap(to_swap, threshold)`` moves blocks WITHOUT bookkeeping, so both
    refuse while any block is live or pinned: they are for warm-up only.
    """

    def __init__(self, defragmenter: OnlineDefragmenter, kv_caches: KVCaches) -> None:
        self._defragmenter = defragmenter
        self.kv_caches: KVCaches | None = kv_caches

    def swap(self, to_swap: Sequence[tuple[int, int]], threshold: int) -> None:
        """Warm-up only: run ``to_swap`` padded to ``threshold`` (no block may be in use)."""
        self._defragmenter.run_unlogged_swap([(int(s), int(d)) for s, d in to_swap], threshold)

    def __call__(
        self,
        srcs: torch.Tensor | Sequence[int],
        dsts: torch.Tensor | Sequence[int],
        caches: Sequence[torch.Tensor],
        block_size: int,
    ) -> None:
        """Move (or, with prefix caching, swap) blocks ``srcs[i] -> dsts[i]`` in exactly
        ``caches`` (slot-major tensors); -1 entries are padding."""
        self._defragmenter._idle_executor()
        pairs = [
            (int(s), int(d))
            for s, d in zip(
                torch.as_tensor(srcs).tolist(), torch.as_tensor(dsts).tolist(), strict=True
            )
            if s >= 0 and d >= 0
        ]
        swap = self._defragmenter.session.prefix_caching
        for cache in caches:
            blocks = cache.view(-1, block_size, *cache.shape[1:])
            for s, d in pairs:
                moved = blocks[s].clone()
                if swap:
                    blocks[s].copy_(blocks[d])
                blocks[d].copy_(moved)


class OnlineDefragmenter:
    """The plugin's defragmenter surface over a shared :class:`KvCacheSession`.

    ``OnlineDefragmenter(kv_caches, block_size)`` as vllm-gaudi's runner builds it, or the
    older ``OnlineDefragmenter()`` plus ``initialize(kv_caches, block_size)``. Every policy
    field of ``CacheConfigured`` is a keyword (``threshold=``, ``policy="tail"``,
    ``max_bytes_per_step=``...); arguments not given come from the environment
    (``VLLM_DEFRAG``, ``VLLM_DEFRAG_THRESHOLD``, ``KVLOG_POLICY``..., ``KVLOG_PATH``,
    ``KVLOG_SYNC``: see ``kvlog.integrations.config``); ``prefix_caching`` from the
    plugin's ``get_config()`` or vLLM's current config when not given. A
    ``KvlogOffloadingConnector`` worker over the same tensors shares this Engine.
    """

    def __init__(
        self,
        kv_caches: KVCaches | None = None,
        block_size: int | None = None,
        *,
        prefix_caching: bool | None = None,
        config: FacadeConfig | None = None,
        environ: Mapping[str, str] | None = None,
        backend: Backend = "auto",
        executor_options: Mapping[str, Any] | None = None,
        **overrides: Any,
    ) -> None:
        self.config = config or config_from_env(environ, **overrides)
        self.to_swap_pad_thresholds = list(self.config.pad_sizes)
        self._prefix_caching = prefix_caching
        self.session = KvCacheSession(
            self.config,
            prefix_caching=bool(prefix_caching),
            backend=backend,
            executor_options=executor_options,
        )
        self.cache_utils: CacheSwapHandle | None = None
        self.last_swap: SwapPlan | None = None
        self._resolve_id: Callable[[int], int] | None = None
        """The books' resolve of one int id, once the Engine started (``resolve``)."""
        self.lines = DefragLines(environ if environ is not None else None)
        self.debug = self.lines.say if self.lines.debug else None
        """The plugin's debug logger (``VLLM_DEBUG=defrag``), else None."""
        self._exporter: MultiprocessExporter | None = process_exporter()
        if kv_caches is not None:
            if block_size is None:
                raise ConfigError("block_size", None, "given with kv_caches")
            self.initialize(kv_caches, block_size)
        self.lines.initialized()

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
        """The shared Engine (started on first use), with a pending step's changes applied
        (see ``update_state``)."""
        self.session.settle()
        return self.session.engine

    def log_status(self) -> LogStatus:
        """Where the recorder stands: attached, or detached after an I/O error (the
        defragmenter goes on either way)."""
        return self.session.log_status()

    @property
    def kv_caches(self) -> KVCaches | None:
        return self.session.kv_caches

    @property
    def block_size(self) -> int:
        return self.session.block_size

    # -- the runner's calls --------------------------------------------------------------
    def initialize(self, kv_caches: KVCaches, block_size: int) -> None:
        """Bind the runner's KV caches (HPU layout); join the session of a connector built
        over the same tensors, if there is one."""
        derive_num_gpu_blocks(kv_caches, block_size)
        own = self.session
        session, new = shared_session(kv_caches, lambda: own)
        if not new:
            prefix = self._prefix_caching
            session.configure(self.config, session.prefix_caching if prefix is None else prefix)
            self.session = session
        elif self._prefix_caching is None:
            session.configure(self.config, detect_prefix_caching())
        session.bind_caches(kv_caches, block_size)
        self.cache_utils = CacheSwapHandle(self, kv_caches)

    def update_state(
        self,
        new_blocks: Mapping[str, Sequence[int]],
        finished_reqs: Iterable[str],
        preempted_reqs: Iterable[str] = (),
        resumed_reqs: Iterable[str] = (),
    ) -> None:
        """One scheduler step's changes: finished, then preempted requests release their
        blocks; then the new blocks (a resumed request's are its whole new table).

        Checked now, all or nothing (a bad input raises and changes nothing); applied with
        ``defragment()`` as ONE ``StepScheduled`` event. The placeholders of loads whose
        blocks the step gives let go in that event (finished, the rest of their blocks held
        again under a new name among its allocations), and so do the preemptions the books
        infer where the runner passes none (module ``kvlog.integrations.books``); only a
        step that releases part of a request's table is applied as fine-grained events."""
        session = self.session
        session.settle()  # an earlier update_state that no defragment() ended
        new = _allocations(new_blocks)
        finished, preempted = _req_ids(finished_reqs), _req_ids(preempted_reqs)
        if self.lines.debug:
            self.lines.updating_state(sum(map(len, new.values())), len(finished))
        resumed = _req_ids(resumed_reqs)
        engine = session.engine
        released = {*finished, *preempted, *(r for r in resumed if new.get(r))}
        claims = session.holds.plan(new.values())
        event = StepScheduled(
            step=session.step, allocated=new, finished=finished, preempted=preempted,
            resumed=resumed,
        )  # fmt: skip
        event = _claiming(event, claims)
        ticket = _fast_step(session, engine, event, released, claims)
        if ticket is not None:
            session.holds.claimed(claims)
            books, prefix_caching = session.books, session.prefix_caching
            session.pend(event, ticket, lambda: books.record_step(new, released, prefix_caching))
            return
        self._update_with_inference(new, finished, preempted, set(resumed))

    def _update_with_inference(
        self, new: dict[str, list[int]], finished: list[str], preempted: list[str],
        resumed: set[str],
    ) -> None:  # fmt: skip
        """The step's changes with what the books infer: one ``StepScheduled`` where the
        plan releases whole tables only (``books.fold``), else fine-grained events."""
        session = self.session
        books = session.books
        engine = session.engine
        plan = books.plan(engine.view, new, finished, preempted, resumed)
        folded = books_plan.fold(plan, session.step)
        if folded is not None:
            claims = session.holds.plan(folded.allocated.values())
            event = _claiming(folded, claims)
            verdict = engine.verdict(event, (InvalidEvent,))
            if isinstance(verdict, Ticket):
                session.holds.claimed(claims)
                session.pend(event, verdict, books.commit)
                return
        for step in plan:
            if isinstance(step, Claim):
                session.claim(step.block_ids)
            else:
                session.apply(step)
        books.commit()

    def defragment(self) -> None:
        """End the step: collect finished transfers, then the step's event (the pending
        ``StepScheduled``, else ``StepEnded``); its swaps run now."""
        session = self.session
        plans = session.end_step()
        swaps = [p for p in plans if isinstance(p, SwapPlan)]
        self.last_swap = swaps[-1] if swaps else None
        if swaps and self.lines.debug:
            self._say_done(swaps)
        exporter, reporter = self._exporter, session.reporter
        if exporter is not None and reporter is not None and not session.reported_by_connector:
            exporter.observe(reporter.take())

    def _say_done(self, swaps: list[SwapPlan]) -> None:
        """The plugin's ``defragmentation done`` line: the highest used id before (the
        first source: defrag moves the highest used block first) and after."""
        state = self.session.engine.state
        moved = [p for p in swaps if p.pairs]
        if not moved:
            return
        pre = max(state.max_used, *(src for p in moved for src, _ in p.pairs))
        pairs = sum(len(p.pairs) for p in moved)
        self.lines.done(pre, state.max_used, state.num_used, pairs, moved[-1].padded_to)

    def resolve(self, block_id: int) -> int:
        """Logical -> physical; ids the Engine does not know (pads, -1) pass unchanged; a
        non-integer id (a float, a bool) is refused (``BlockOutOfRange``)."""
        resolve_id = self._resolve_id
        if resolve_id is not None and type(block_id) is int:  # the runner's per-id calls
            return resolve_id(block_id)
        if isinstance(block_id, bool) or not isinstance(block_id, (int, np.integer)):
            raise BlockOutOfRange(f"a block id must be an int, not {type(block_id).__name__}")
        if not self.session.started:
            return block_id
        self._resolve_id = self.session.engine.view.resolver()  # the session's one Engine
        return int(self._resolve_id(int(block_id)))

    def resolve_all(self, block_table_list: Sequence[Sequence[int]]) -> list[list[int]]:
        """:meth:`resolve` over every table (new lists). The runner's usual tables (lists
        of ids in the pool) are looked up in one C call per table (``itemgetter`` over
        the forward table as a Python list, kept up to date by the session); a table
        that holds anything else (a pad id, -1, a numpy array, a float) goes through
        ``Engine.resolve_all``'s checked path, where ids outside the pool pass unchanged
        and non-integers are refused (``BlockOutOfRange``)."""
        if not self.session.started:
            return [_ids(table) for table in block_table_list]
        if self.session.engine.view.num_gpu_blocks > MAX_LOOKUP_BLOCKS:
            return [self._resolve_checked(table) for table in block_table_list]
        lookup = self.session.forward_list()
        out: list[list[int]] = []
        append = out.append
        for table in block_table_list:
            try:
                if type(table) is not list or not table:
                    raise TypeError
                if len(table) == 1:
                    resolved = [lookup[table[0]]]
                else:
                    resolved = list(itemgetter(*table)(lookup))
                if sum(resolved) < 0:  # a negative id wrapped into the sentinel tail
                    raise IndexError
            except (TypeError, IndexError):
                resolved = self._resolve_checked(table)
            append(resolved)
        return out

    def resolve_table(self, table: Any, rows: int | None = None, columns: int | None = None) -> Any:
        """:meth:`resolve` over a whole block-table array: a CPU ``torch.Tensor`` or numpy
        array of integers, 1-D or 2-D (any strides), resolved in one compiled pass into a
        new one of the same kind and dtype. ``rows`` / ``columns``: only the leading ones
        (a 2-D table; sliced as numpy views, cheaper than a tensor's indexing), the shape
        of the result. Ids outside the pool (pads, -1) pass unchanged, as in
        :meth:`resolve`. Refused (``BlockOutOfRange``): a tensor off the CPU, a dtype that
        is not an integer one or cannot hold every block id of the pool (a resolved id
        would wrap). The Gaudi switch resolves the runner's decode table with it
        (``gaudi_decode``)."""
        as_tensor = isinstance(table, torch.Tensor)
        if as_tensor and not table.is_cpu:
            raise BlockOutOfRange(f"a block table must be on the CPU, not {table.device}")
        ids = table.numpy() if as_tensor else np.asarray(table)
        if ids.dtype.kind not in "iu" or ids.ndim not in (1, 2):
            raise BlockOutOfRange(
                f"a block table must be a 1-D or 2-D integer array, not {ids.dtype} of "
                f"shape {ids.shape}"
            )
        if rows is not None or columns is not None:
            if ids.ndim != 2:
                raise BlockOutOfRange(f"rows and columns bound a 2-D table, not {ids.shape}")
            ids = ids[:rows, :columns]
        out = np.empty(ids.shape, dtype=ids.dtype)
        if not self.session.started or ids.size == 0:
            out[...] = ids
        else:
            view = self.session.engine.view
            if not holds_pool_ids(ids.dtype, view.num_gpu_blocks):
                raise BlockOutOfRange(
                    f"a block table of {ids.dtype} cannot hold the ids of a "
                    f"{view.num_gpu_blocks}-block pool"
                )
            flat = ids.reshape(1, -1) if ids.ndim == 1 else ids
            view.resolve_into(flat, out.reshape(flat.shape))
        return torch.from_numpy(out) if as_tensor else out

    def _resolve_checked(self, table: Sequence[int]) -> list[int]:
        """One table through the checked path: ids outside the pool pass unchanged."""
        ids = _table_ids(table)
        if ids.size == 0:
            return []
        inside = (ids >= 0) & (ids < self.session.engine.view.num_gpu_blocks)
        out = ids.copy()
        out[inside] = self.session.engine.resolve_all(ids[inside][None, :])[0]
        return out.tolist()  # type: ignore[no-any-return]

    def unresolve(self, block_id: int) -> int:
        """Physical -> logical."""
        if not self.session.started:
            return block_id
        return int(self.session.engine.view.unresolve(int(block_id)))

    # -- views for debugging and the plugin's tests --------------------------------------
    @property
    def used_blocks(self) -> dict[int, int]:
        """Physical block -> reference count, like the seed's ``used_blocks``."""
        if not self.session.started:
            return {}
        self.session.settle()
        refs = self.session.engine.view.references()
        return {int(b): int(refs[b]) for b in np.flatnonzero(refs)}

    @property
    def req_blocks(self) -> dict[str, list[int]]:
        """Request -> its logical block table."""
        if not self.session.started:
            return {}
        self.session.settle()
        view = self.session.engine.view
        return {
            r: view.request_blocks(r)
            for r in view.live_requests()
            if not self.session.holds.is_placeholder(r)
        }

    # -- warm-up -------------------------------------------------------------------------
    def warmup(self) -> None:
        """One data-neutral swap per pad bucket, not logged, before serving.

        This traces or compiles every padded swap shape, like the plugin's warm-up, and
        leaves every byte and the state as they were, so replay stays exact: in ``"swap"``
        mode blocks 1 and 2 are swapped twice; in ``"move"`` mode block 1 is moved onto
        block 2 and block 2's bytes are put back.
        """
        if not self.enabled:
            return
        num_blocks = self.session.cache_config().num_gpu_blocks
        if num_blocks < 3:
            self.lines.warmup_skipped(num_blocks)
            return
        executor = self._idle_executor()
        self.lines.warming_up(self.to_swap_pad_thresholds)
        for pad in self.to_swap_pad_thresholds:
            if self.session.prefix_caching:
                self._execute_swap([(1, 2)], pad)
                self._execute_swap([(1, 2)], pad)
            else:
                saved = executor.read_gpu_block(2)
                self._execute_swap([(1, 2)], pad)
                executor.write_gpu_block(2, saved)
        self.lines.warmed_up()

    def run_unlogged_swap(self, pairs: list[tuple[int, int]], padded_to: int) -> None:
        """The plugin's ``cache_utils.swap``: only while no block is in use or pinned."""
        self._idle_executor()
        self._execute_swap(pairs, padded_to)

    def _swap(self, to_swap: Sequence[tuple[int, int]], threshold: int) -> None:
        """The plugin's ``_swap(to_swap, threshold)`` (warm-up only, see ``cache_utils``)."""
        self.run_unlogged_swap([(int(s), int(d)) for s, d in to_swap], threshold)

    def _idle_executor(self) -> Executor:
        self.session.settle()
        engine = self.session.engine
        if engine.view.live_requests() or engine.view.jobs_in_flight():
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

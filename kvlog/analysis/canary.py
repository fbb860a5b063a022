"""Per-block canary bytes: prove that every live block still holds its own KV data.

Each time a logical GPU block gets fresh content, :class:`CanaryTracker` writes bytes that
only that (block, generation) can have into its physical block, and remembers the token.
Swaps, stores and loads then move those bytes around on real tensors; ``check`` reads every
live block of every request back and compares. A defrag that forgets a pin, or an executor
that indexes tensors with unresolved ids, shows up as a block holding someone else's bytes.

The tracker only reads the engine state and watches the events and the plans they made
(a machine observer); it never changes either. Which CPU sub-block a GPU block goes to or
comes from is read from each ``TransferPlan`` (the reducers' rule, ``group_sizes`` and
deferred jobs included), never restated here. Rules (from the data each block must hold in
a correct system):
- a block that goes from no owner to an owner gets fresh bytes, except with prefix caching
  where a free block may hold cached data that swap-mode defrag keeps (so its bytes stay);
  ``RequestFinished``, ``RequestPreempted`` and ``BlocksReleased`` drop owners;
- a store copies the tokens its GPU blocks hold when its plan runs (a flushed store's plan
  runs before the new owner's fresh bytes) into its CPU sub-blocks when it succeeds;
- a load gives its GPU blocks the tokens its CPU sub-blocks hold when its plan runs, when
  it succeeds; a failed transfer leaves its destinations unknown;
- a block that a load is still writing (from its plan on: a deferred load has not
  touched it before) is not checked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
import numpy as np

from kvlog.events import (
    BlocksAllocated,
    BlocksReleased,
    CacheConfigured,
    Event,
    Plan,
    RequestFinished,
    RequestPreempted,
    StepPacked,
    StepScheduled,
    TransferBatch,
    TransferFinished,
    TransferPlan,
)
from kvlog.reducers import State
from kvlog.reducers import step as step_reducer
from kvlog.util.splitmix import GOLDEN, mix64_array

if TYPE_CHECKING:
    from kvlog.executors import Executor

__all__ = [
    "PENDING",
    "UNKNOWN",
    "BlockReader",
    "CanaryFailure",
    "CanaryReport",
    "CanaryTracker",
    "canary_bytes",
    "canary_rows",
    "make_canary_executor",
]

UNKNOWN = -1
"""Token of a block whose content nobody can know (never written, or a failed transfer)."""
PENDING = -2
"""Token of a GPU block that an unfinished load is writing."""


def canary_rows(tokens: np.ndarray, num_bytes: int) -> np.ndarray:
    """``(len(tokens), num_bytes)`` uint8: row ``i`` depends only on ``tokens[i]`` (>= 0)."""
    tokens = np.asarray(tokens, dtype=np.int64)
    assert tokens.size == 0 or int(tokens.min()) >= 0, "canary tokens must be >= 0"
    num_words = (num_bytes + 7) // 8
    with np.errstate(over="ignore"):
        base = tokens.astype(np.uint64) * np.uint64(GOLDEN)
        words = mix64_array(np.arange(num_words, dtype=np.uint64)[None, :] + base[:, None])
    rows: np.ndarray = words.view(np.uint8).reshape(len(tokens), num_words * 8)[:, :num_bytes]
    return rows


def canary_bytes(token: int, num_bytes: int) -> bytes:
    """``num_bytes`` pseudo-random bytes that depend only on ``token`` (>= 0)."""
    assert token >= 0, f"canary token must be >= 0, got {token}"
    return bytes(canary_rows(np.array([token]), num_bytes)[0].tobytes())


class BlockReader(Protocol):
    """What the tracker needs from an executor (``kvlog.executors.Executor`` has it)."""

    def read_gpu_block(self, block_id: int) -> bytes: ...
    def write_gpu_block(self, block_id: int, data: bytes) -> None: ...
    def read_cpu_block(self, cpu_block_id: int) -> bytes: ...


class _StateView(Protocol):
    """What the tracker reads from the reducer state."""

    def resolve(self, block_id: int) -> int: ...
    def unresolve(self, physical: int) -> int: ...
    def request_blocks(self, req_id: str) -> list[int]: ...
    def live_requests(self) -> list[str]: ...


@dataclass(frozen=True)
class CanaryFailure:
    """A block whose bytes are not the ones it should hold."""

    where: str  # "gpu" or "cpu"
    req_id: str  # owning request ("" for a CPU block)
    block_id: int  # logical GPU block id, or CPU block id
    physical_id: int  # physical GPU block id (CPU: same as block_id)
    expected_token: int
    found_token: int  # token whose bytes the block holds (UNKNOWN if none we know)


@dataclass
class CanaryReport:
    """Result of one :meth:`CanaryTracker.check`."""

    num_checked: int = 0
    num_skipped: int = 0
    num_failed: int = 0
    failures: list[CanaryFailure] = field(default_factory=list)
    num_cpu_checked: int = 0
    """Of ``num_checked``: CPU sub-blocks (what successful stores wrote)."""
    num_cpu_skipped: int = 0
    """Of ``num_skipped``: CPU sub-blocks whose store carried unknown bytes."""

    @property
    def ok(self) -> bool:
        return self.num_failed == 0


@dataclass
class _Job:
    kind: str
    gpu_block_ids: list[int]  # logical
    sub_block_ids: list[int]  # CPU sub-blocks, paired with gpu_block_ids
    tokens: list[int]  # source tokens at submit time


class CanaryTracker:
    """Writes and checks canary bytes of logical blocks on an executor's tensors."""

    def __init__(
        self,
        reader: BlockReader,
        config: CacheConfigured,
        max_failures: int = 16,
        tensor_page_bytes: list[int] | None = None,
    ):
        """``tensor_page_bytes``: bytes of one GPU block in each tensor, in the order the
        executor concatenates them; needed to check CPU blocks (skipped when None)."""
        self.reader = reader
        self.tensor_page_bytes = tensor_page_bytes
        self.config = config
        self.max_failures = max_failures
        n = config.num_gpu_blocks
        self.gpu_tokens = np.full(n, UNKNOWN, dtype=np.int64)
        self.generation = np.zeros(n, dtype=np.int64)
        self.refs = np.zeros(n, dtype=np.int32)
        factor = config.block_size_factor
        self.cpu_tokens = np.full(config.num_cpu_blocks * factor, UNKNOWN, dtype=np.int64)
        self.jobs: dict[int, _Job] = {}
        self.num_writes = 0
        self._page_bytes = -1
        self._released: list[int] = []
        self._step_events: list[Event] = []
        self._step_released: list[list[int]] = []

    # -- tokens --------------------------------------------------------------------------
    def token(self, block_id: int, generation: int) -> int:
        """The token of the ``generation``-th content of logical ``block_id``."""
        return generation * self.config.num_gpu_blocks + block_id

    def _owner_of_token(self, token: int) -> int:
        return token % self.config.num_gpu_blocks if token >= 0 else UNKNOWN

    def page_bytes(self) -> int:
        """Bytes of one physical GPU block, as the executor reads it."""
        if self._page_bytes < 0:
            self._page_bytes = len(self.reader.read_gpu_block(0))
        return self._page_bytes

    def write(self, state: _StateView, block_ids: list[int]) -> None:
        """Give ``block_ids`` (logical) fresh content now: a new generation each."""
        if not block_ids:
            return
        ids = np.asarray(block_ids, dtype=np.int64)
        self.generation[ids] += 1
        tokens = self.generation[ids] * self.config.num_gpu_blocks + ids
        self.gpu_tokens[ids] = tokens
        physical = [state.resolve(int(b)) for b in ids]
        rows = canary_rows(tokens, self.page_bytes())
        views = _canonical_views(self.reader)
        if views is None:
            for p, row in zip(physical, rows, strict=True):
                self.reader.write_gpu_block(p, row.tobytes())
        else:
            _write_views(views, physical, rows)
        self.num_writes += len(block_ids)

    # -- event hooks ---------------------------------------------------------------------
    def before(self, state: _StateView, event: Event) -> None:
        """Call before the engine applies ``event`` (captures what a release frees; a
        ``StepScheduled``: its fine-grained events and what each of its releases frees)."""
        if isinstance(event, (RequestFinished, RequestPreempted)):
            self._released = list(state.request_blocks(event.req_id))
        elif isinstance(event, (StepScheduled, StepPacked)):
            assert isinstance(state, State), "a StepScheduled comes from a machine's state"
            self._step_events = step_reducer.expand(state, event)[:-1]
            self._step_released = [
                list(state.request_blocks(e.req_id))
                for e in self._step_events
                if isinstance(e, (RequestFinished, RequestPreempted))
            ]

    def after(self, state: _StateView, event: Event, plans: Sequence[Plan] = ()) -> None:
        """Call after the engine applied ``event`` successfully, with its plans (a machine
        observer). Transfer plans first: a store flushed by an allocation reads its blocks
        before their new owner's fresh bytes land."""
        for plan in plans:
            if type(plan) is TransferPlan:
                self._planned(state, plan)
        if isinstance(event, (StepScheduled, StepPacked)):
            released = iter(self._step_released)
            for fine in self._step_events:  # the step's own order; writes land where the
                if isinstance(fine, BlocksAllocated):  # blocks are after its defrag moves
                    self._allocated(state, fine.block_ids)
                else:
                    self._release(next(released))
            self._step_events, self._step_released = [], []
        elif isinstance(event, BlocksAllocated):
            self._allocated(state, event.block_ids)
        elif isinstance(event, (RequestFinished, RequestPreempted)):
            self._release(self._released)
            self._released = []
        elif isinstance(event, BlocksReleased):
            self._release(event.block_ids)
        elif isinstance(event, TransferFinished):
            self.finished(event.job_id, event.success)
        elif isinstance(event, TransferBatch):  # its finishes, in order
            for fine in event.events:
                if isinstance(fine, TransferFinished):
                    self.finished(fine.job_id, fine.success)

    def _release(self, block_ids: list[int]) -> None:
        for b in block_ids:
            self.refs[b] -= 1
            assert self.refs[b] >= 0, f"canary tracker: block {b} released below zero"

    def _allocated(self, state: _StateView, block_ids: list[int]) -> None:
        fresh = []
        for b in block_ids:
            if self.refs[b] == 0:
                keep = self.config.prefix_caching and self.gpu_tokens[b] != UNKNOWN
                if not keep and self.gpu_tokens[b] != PENDING:
                    fresh.append(b)
            self.refs[b] += 1
        self.write(state, fresh)

    def _planned(self, state: _StateView, plan: TransferPlan) -> None:
        """A transfer's plan runs now: the tokens it carries are those its sources hold
        (GPU blocks by their logical ids: pinned, defrag never moved them)."""
        sources = [src for src, _ in plan.pairs]
        targets = [dst for _, dst in plan.pairs]
        if plan.kind == "store":
            gpu = [state.unresolve(p) for p in sources]
            tokens = [self._stored_token(b) for b in gpu]
            self.jobs[plan.job_id] = _Job("store", gpu, targets, tokens)
        else:
            gpu = [state.unresolve(p) for p in targets]
            tokens = [int(self.cpu_tokens[s]) for s in sources]
            self.gpu_tokens[np.asarray(gpu, dtype=np.int64)] = PENDING
            self.jobs[plan.job_id] = _Job("load", gpu, sources, tokens)

    def _stored_token(self, block_id: int) -> int:
        """What a store planned now reads from a GPU block: its token, or, while a load
        writes it, the load's (the reducers fence the store behind that load)."""
        token = int(self.gpu_tokens[block_id])
        if token != PENDING:
            return token
        for job in self.jobs.values():
            if job.kind == "load" and block_id in job.gpu_block_ids:
                return job.tokens[job.gpu_block_ids.index(block_id)]
        raise AssertionError(f"canary tracker: block {block_id} pending without its load")

    def finished(self, job_id: int, success: bool) -> None:
        """A transfer finished: move the tokens it carried (or forget them on failure: a
        store that read a failed load's blocks carries unknown bytes too)."""
        job = self.jobs.pop(job_id, None)
        if job is None:
            return
        if job.kind == "load" and not success:
            for other in self.jobs.values():
                if other.kind == "store":
                    for i, b in enumerate(other.gpu_block_ids):
                        if b in job.gpu_block_ids and other.tokens[i] in job.tokens:
                            other.tokens[i] = UNKNOWN
        for gpu, sub, tok in zip(job.gpu_block_ids, job.sub_block_ids, job.tokens, strict=True):
            value = tok if success else UNKNOWN
            if job.kind == "store":
                self.cpu_tokens[sub] = value
            else:
                self.gpu_tokens[gpu] = value

    # -- checks --------------------------------------------------------------------------
    def _identify(self, data: bytes, expected: int) -> int:
        """Which token's bytes ``data`` is (only guesses among the same block's tokens)."""
        size = len(data)
        owner = self._owner_of_token(expected)
        for gen in range(int(self.generation[owner]), -1, -1):
            tok = self.token(owner, gen)
            if canary_bytes(tok, size) == data:
                return tok
        return UNKNOWN

    def _fail(self, report: CanaryReport, failure: CanaryFailure) -> None:
        report.num_failed += 1
        if len(report.failures) < self.max_failures:
            report.failures.append(failure)

    def check(self, state: _StateView, include_cpu: bool = True) -> CanaryReport:
        """Read back every live block of every request (and the CPU blocks) and compare."""
        report = CanaryReport()
        size = self.page_bytes()
        owners, logical = [], []
        for req_id in state.live_requests():
            for b in state.request_blocks(req_id):
                if self.gpu_tokens[b] < 0:
                    report.num_skipped += 1
                    continue
                owners.append(req_id)
                logical.append(b)
        tokens = self.gpu_tokens[np.asarray(logical, dtype=np.int64)]
        physical = [state.resolve(b) for b in logical]
        found = self._read_gpu(physical, size)
        expected = canary_rows(tokens, size)
        report.num_checked += len(logical)
        bad = (found != expected).any(axis=1) if len(logical) else np.zeros(0, dtype=bool)
        for i in np.flatnonzero(bad).tolist():
            tok = int(tokens[i])
            seen = self._identify(found[i].tobytes(), tok)
            self._fail(report, CanaryFailure("gpu", owners[i], logical[i], physical[i], tok, seen))
        if include_cpu and self.tensor_page_bytes is not None:
            self._check_cpu(report, size, self.tensor_page_bytes)
        return report

    def _read_gpu(self, physical: list[int], size: int) -> np.ndarray:
        views = _canonical_views(self.reader)
        if views is None:
            out = np.zeros((len(physical), size), dtype=np.uint8)
            for i, p in enumerate(physical):
                out[i] = np.frombuffer(self.reader.read_gpu_block(p), dtype=np.uint8)
            return out
        return _read_views(views, physical)

    def _check_cpu(self, report: CanaryReport, size: int, pages: list[int]) -> None:
        factor = self.config.block_size_factor
        busy = {s for job in self.jobs.values() if job.kind == "store" for s in job.sub_block_ids}
        for cpu_block in range(self.config.num_cpu_blocks):
            subs = range(cpu_block * factor, (cpu_block + 1) * factor)
            if any(s in busy for s in subs):
                continue
            tokens = [int(self.cpu_tokens[s]) for s in subs]
            if all(t < 0 for t in tokens):
                continue
            data = self.reader.read_cpu_block(cpu_block)
            for k, tok in enumerate(tokens):
                if tok < 0:
                    report.num_skipped += 1
                    report.num_cpu_skipped += 1
                    continue
                report.num_checked += 1
                report.num_cpu_checked += 1
                if _cpu_part(data, k, factor, pages) != canary_bytes(tok, size):
                    self._fail(report, CanaryFailure("cpu", "", cpu_block, cpu_block, tok, -1))


def _cpu_part(data: bytes, k: int, factor: int, pages: list[int]) -> bytes:
    """Sub-block ``k`` of a CPU block's bytes, as one GPU block's bytes.

    A CPU block is laid out tensor by tensor, each tensor holding ``factor`` GPU pages;
    a GPU block is the concatenation of one page of each tensor.
    """
    parts = []
    offset = 0
    for page in pages:
        parts.append(data[offset + k * page : offset + (k + 1) * page])
        offset += page * factor
    return b"".join(parts)


def make_canary_executor(
    config: CacheConfigured, backend: str = "cpu"
) -> tuple[Executor, CanaryTracker]:
    """A small CPU-tensor executor for ``config`` (2 layers, K and V, slot-major) and its
    canary tracker. Page bytes are tiny: canaries need distinct bytes, not real sizes."""
    import torch

    from kvlog.executors import make_executor

    head_size = 4
    rows = (config.num_gpu_blocks + 1) * config.block_size
    kv_caches = [
        (
            torch.zeros(rows, 1, head_size, dtype=torch.int8),
            torch.zeros(rows, 1, head_size, dtype=torch.int8),
        )
        for _ in range(2)
    ]
    page = config.block_size * head_size
    small = msgspec.structs.replace(config, page_size_bytes=4 * page)
    executor = make_executor(kv_caches, small, backend=backend)  # type: ignore[arg-type]
    tracker = CanaryTracker(executor, small, tensor_page_bytes=[page] * 4)
    return executor, tracker


def _canonical_views(reader: object) -> list[Any] | None:
    """The executor's canonical ``(rows, page_bytes)`` int8 views, for batched reads and
    writes (the same bytes ``read_gpu_block`` concatenates); None for other readers."""
    layout = getattr(reader, "layout", None)
    tensors = getattr(layout, "tensors", None)
    if not tensors:
        return None
    return [t.view for t in tensors]


def _write_views(views: list[Any], physical: list[int], rows: np.ndarray) -> None:
    import torch

    index = torch.as_tensor(physical, dtype=torch.long)
    offset = 0
    for view in views:
        page = int(view.shape[1])
        part = torch.from_numpy(np.ascontiguousarray(rows[:, offset : offset + page])).view(
            torch.int8
        )
        view.index_copy_(0, index.to(view.device), part.to(view.device))
        offset += page


def _read_views(views: list[Any], physical: list[int]) -> np.ndarray:
    import torch

    index = torch.as_tensor(physical, dtype=torch.long)
    parts = [view.index_select(0, index.to(view.device)).cpu() for view in views]
    joined = torch.cat(parts, dim=1) if parts else torch.zeros((len(physical), 0), dtype=torch.int8)
    return joined.view(torch.uint8).numpy()

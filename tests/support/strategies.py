"""Hypothesis strategies shared by the test suite.

Add new strategies at the end of this file; do not rewrite existing ones (other tests use them).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from hypothesis import strategies as st

import kvlog.events
from kvlog.events import (
    BlocksAllocated,
    CacheConfigured,
    Checkpoint,
    Event,
    LoadRequested,
    Record,
    RequestFinished,
    RequestPreempted,
    StepEnded,
    StoreRequested,
    SwapPlan,
    TransferFinished,
    TransferSubmitted,
)
from tests.support.model import ModelRejected, cpu_sub_blocks

__all__ = [
    "any_event",
    "any_record",
    "block_lists",
    "cache_configs",
    "distinct_blocks",
    "group_spec",
    "req_ids",
    "swap_plans",
]

LOADS_DEFER = "deferred" in LoadRequested.__struct_fields__
"""Whether this schema lets a load be declared now and submitted later, like a store."""
BlocksReleased: Any = getattr(kvlog.events, "BlocksReleased", None)
"""The partial release event, where the schema has it (None otherwise)."""

req_ids = st.text(alphabet="abcdefghij0123456789-", min_size=1, max_size=12)


def block_lists(max_block: int = 1 << 20, max_size: int = 64) -> st.SearchStrategy[list[int]]:
    """Distinct non-negative block ids."""
    return st.lists(st.integers(0, max_block), max_size=max_size, unique=True)


@st.composite
def cache_configs(draw: st.DrawFn, max_gpu_blocks: int = 4096) -> CacheConfigured:
    """Valid cache configurations, small enough for fast tests."""
    pads = draw(st.lists(st.integers(1, 512), min_size=1, max_size=7, unique=True).map(sorted))
    return CacheConfigured(
        num_gpu_blocks=draw(st.integers(2, max_gpu_blocks)),
        block_size=draw(st.sampled_from([1, 16, 128])),
        num_cpu_blocks=draw(st.integers(0, 1024)),
        block_size_factor=draw(st.integers(1, 8)),
        prefix_caching=draw(st.booleans()),
        defrag=draw(st.booleans()),
        threshold=draw(st.integers(0, 64)),
        max_swaps=draw(st.integers(1, pads[-1])),
        pad_sizes=tuple(pads),
        page_size_bytes=draw(st.integers(0, 1 << 20)),
        quarantine_released=draw(st.booleans()),
    )


_ids = st.integers(0, 2**63 - 1)


@st.composite
def _transfers(draw: st.DrawFn, kind: type[StoreRequested] | type[LoadRequested]) -> Event:
    """A store or load, well-formed on its own: sometimes deferred, sometimes with KV-cache
    groups whose sizes add up to the GPU blocks."""
    gpu, cpu = draw(block_lists()), draw(block_lists())
    fields: dict[str, Any] = {}
    if gpu and draw(st.booleans()):
        cuts = sorted(draw(st.lists(st.integers(0, len(gpu)), max_size=3)))
        bounds = [0, *cuts, len(gpu)]
        sizes = tuple(b - a for a, b in itertools.pairwise(bounds))
        indices = tuple(draw(st.integers(0, 1 << 20)) for _ in sizes)
        fields.update(group_sizes=sizes, block_indices=indices)
    if kind is StoreRequested or LOADS_DEFER:
        fields["deferred"] = draw(st.booleans())
    return kind(job_id=draw(_ids), gpu_block_ids=gpu, cpu_block_ids=cpu, **fields)


any_event: st.SearchStrategy[Event] = st.one_of(
    cache_configs(),
    st.builds(BlocksAllocated, req_id=req_ids, block_ids=block_lists()),
    st.builds(RequestFinished, req_id=req_ids),
    st.builds(RequestPreempted, req_id=req_ids),
    st.builds(StepEnded, step=_ids),
    _transfers(StoreRequested),
    _transfers(LoadRequested),
    st.builds(TransferFinished, job_id=_ids, success=st.booleans()),
    st.builds(TransferSubmitted, job_id=_ids),
)
"""Any single event, each well-formed on its own (not necessarily valid for a state)."""

any_record: st.SearchStrategy[Record] = st.one_of(
    any_event,
    st.builds(
        Checkpoint,
        seq=st.integers(0, 2**40),
        digest=st.text(alphabet="0123456789abcdef", min_size=64, max_size=64),
        step=st.integers(-1, 2**40),
        snapshot=st.binary(max_size=64),
    ),
)
"""Any record the log may hold."""


def group_spec(
    randint: Callable[[int, int], int], num_cpu: int, factor: int, max_groups: int = 3
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(group_sizes, block_indices)`` whose chunks use exactly ``num_cpu`` CPU blocks
    under vLLM 0.33's rule (see tests/support/model.py ``cpu_sub_blocks``).

    Up to ``max_groups`` non-empty groups split the CPU blocks; each starts at a first block
    index with a random offset ``skip`` into its chunk (unaligned when ``factor > 1``) and
    holds any size that needs exactly its CPU blocks (a partial last chunk included); now
    and then an empty group sits among them. ``randint(a, b)`` draws from ``[a, b]``.
    """
    f = factor
    groups = randint(1, min(max_groups, num_cpu))
    counts, left = [], num_cpu
    for g in range(groups - 1):
        count = randint(1, left - (groups - 1 - g))
        counts.append(count)
        left -= count
    counts.append(left)
    sizes, indices = [], []
    for count in counts:
        skip = randint(0, f - 1)
        sizes.append(randint(max(1, (count - 1) * f - skip + 1), count * f - skip))
        indices.append(f * randint(0, 6) + skip)
    if randint(0, 3) == 0:
        at = randint(0, len(sizes))
        sizes.insert(at, 0)
        indices.insert(at, randint(0, 20))
    return tuple(sizes), tuple(indices)


# --- Stateful fuzzing: configs, realistic events and one-defect events ----------------------
# Used by tests/properties/test_engine_*.py and tests/properties/test_replay.py. The helpers take a
# ``draw`` function (``data.draw`` inside a state machine rule) and the plain model of
# tests/support/model.py, so that generated programs are realistic: they allocate free blocks that
# no load is writing (now and then on purpose one a store still reads, which the engine flushes and
# fences), share only with prefix caching, defer stores (and loads, where the schema has it) and
# submit them later, use vLLM's KV-cache groups with unaligned first blocks and partial chunks, keep
# CPU sub-blocks of stores and loads apart, and finish submitted jobs.

MACHINE_REQ_IDS = tuple(f"r{i}" for i in range(10))
"""A small pool of request ids: drawing one again appends to it or resumes it."""

INVALID_KINDS = (
    "out_of_range",
    "negative",
    "duplicate_in_event",
    "block_in_use",
    "unknown_job",
    "reused_job",
    "size_mismatch",
    "cpu_out_of_range",
    "second_config",
    "empty_transfer",
    "negative_step",
    "empty_req_id",
    "load_pinned_alloc",
    "cpu_conflict",
    "unknown_submit",
    "finish_unsubmitted",
    "bad_groups",
    "group_size_mismatch",
    "release_unheld",
)
"""The defects ``draw_invalid_event`` plants, one per event."""


@st.composite
def machine_configs(
    draw: st.DrawFn,
    min_gpu_blocks: int = 16,
    max_gpu_blocks: int = 200,
    page_size_bytes: int | None = None,
) -> CacheConfigured:
    """Small pools, low thresholds and small pads, so that defrag fires often; a quarter
    of them quarantine released blocks for a step."""
    pads = draw(st.lists(st.integers(1, 16), min_size=1, max_size=4, unique=True).map(sorted))
    small = st.integers(min_gpu_blocks, min(max_gpu_blocks, 40))
    return CacheConfigured(
        num_gpu_blocks=draw(st.one_of(small, st.integers(min_gpu_blocks, max_gpu_blocks))),
        block_size=draw(st.sampled_from([1, 2, 16])),
        num_cpu_blocks=draw(st.integers(4, 24)),
        block_size_factor=draw(st.integers(1, 4)),
        prefix_caching=draw(st.booleans()),
        defrag=draw(st.sampled_from([True, True, True, False])),
        threshold=draw(st.integers(0, 8)),
        max_swaps=draw(st.integers(1, pads[-1])),
        pad_sizes=tuple(pads),
        page_size_bytes=(
            draw(st.integers(0, 4096)) if page_size_bytes is None else page_size_bytes
        ),
        quarantine_released=draw(st.sampled_from([False, False, False, True])),
    )


def _model_views(model: Any) -> tuple[Any, list[int], set[int]]:
    """(refs, allocatable logical ids, physical ids pinned by any job) of a plain model.

    Allocatable: no live request holds it (refs 0) and no unfinished load writes it; a
    block an unfinished store reads is allocatable (the engine flushes and fences)."""
    refs, load_pins, pins = model.refs(), model.pins("load"), model.pins()
    free = [
        b
        for b in range(model.config.num_gpu_blocks)
        if refs[model.resolve(b)] == 0 and load_pins[model.resolve(b)] == 0
    ]
    return refs, free, {b for b, n in pins.items() if n > 0}


def _sample(draw: st.DrawFn, pool: list[int], min_size: int, max_size: int) -> list[int]:
    """Distinct elements of ``pool`` (``[]`` when it is too small)."""
    if len(pool) < min_size or not pool:
        return []
    return draw(
        st.lists(
            st.sampled_from(pool), min_size=min_size, max_size=min(max_size, len(pool)), unique=True
        )
    )


def _randint(draw: st.DrawFn) -> Callable[[int, int], int]:
    return lambda lo, hi: draw(st.integers(lo, hi))


def draw_allocation(draw: st.DrawFn, model: Any) -> BlocksAllocated:
    """A request gets free blocks; with prefix caching it may share others' blocks (not
    those a load is writing); now and then it gets free blocks that unfinished stores still
    read (the scheduler reusing them: the engine flushes and fences those stores)."""
    req_id = draw(st.sampled_from(MACHINE_REQ_IDS))
    _, free, _ = _model_views(model)
    load_pins = model.pins("load")
    own = set(model.tables.get(req_id, []))
    shared: list[int] = []
    if model.config.prefix_caching and draw(st.integers(0, 2)) == 0:
        others = sorted({b for r, t in model.tables.items() if r != req_id for b in t} - own)
        others = [b for b in others if load_pins[model.resolve(b)] == 0]
        shared = _sample(draw, others, 1, 4)
    fresh_pool = [b for b in free if b not in own and b not in shared]
    count = draw(st.sampled_from([1, 2, 4, 8]))
    where = draw(st.sampled_from(["anywhere", "anywhere", "highest", "lowest", "reuse"]))
    store_pins = model.pins("store")
    reusable = [b for b in fresh_pool if store_pins[model.resolve(b)] > 0]
    if where == "reuse" and reusable:
        fresh = _sample(draw, reusable, 1, count)
    elif where in ("anywhere", "reuse") or len(fresh_pool) <= count:
        fresh = _sample(draw, fresh_pool, 0 if shared else 1, count)
    else:  # a FIFO free queue hands out runs from one end: fragmentation builds up fast
        fresh = fresh_pool[-count:] if where == "highest" else fresh_pool[:count]
    return BlocksAllocated(req_id=req_id, block_ids=shared + fresh)


def draw_release(draw: st.DrawFn, model: Any, preempt: bool) -> RequestFinished | RequestPreempted:
    """Finish or preempt a live request (now and then one that holds nothing: a no-op)."""
    live = sorted(model.tables)
    pool = live if live and draw(st.integers(0, 5)) else list(MACHINE_REQ_IDS)
    req_id = draw(st.sampled_from(pool))
    return RequestPreempted(req_id=req_id) if preempt else RequestFinished(req_id=req_id)


def draw_step(draw: st.DrawFn, model: Any) -> StepEnded:
    """The next step, sometimes skipping a few numbers."""
    return StepEnded(step=model.step + 1 + draw(st.sampled_from([0, 0, 0, 1, 5])))


def next_job_id(draw: st.DrawFn, model: Any) -> int:
    """Job ids grow strictly (vLLM uses one counter), sometimes with gaps."""
    return int(model.last_job_id) + 1 + draw(st.sampled_from([0, 0, 1, 3]))


def _cpu_clear_of(model: Any, subs_in_use: set[int]) -> list[int]:
    """CPU blocks none of whose sub-blocks is in ``subs_in_use``."""
    f = model.config.block_size_factor
    return [
        c
        for c in range(model.config.num_cpu_blocks)
        if not any(c * f + k in subs_in_use for k in range(f))
    ]


def _shape(
    draw: st.DrawFn, model: Any, kind: str, max_gpu: int, num_cpu: int, groups: bool | None
) -> tuple[int, dict[str, Any]] | None:
    """(GPU block count, group fields) of a transfer over ``num_cpu`` CPU blocks that needs
    at most ``max_gpu`` GPU blocks; fewer CPU blocks are tried when it does not fit."""
    f = model.config.block_size_factor
    grouped = draw(st.integers(0, 2)) == 0 if groups is None else groups
    for n in range(num_cpu, 0, -1):
        if grouped:
            sizes, indices = group_spec(_randint(draw), n, f)
            if sum(sizes) <= max_gpu:
                return n, {"group_sizes": sizes, "block_indices": indices}
        else:
            num_gpu = n * f if kind == "store" else n * f - draw(st.integers(0, f - 1))
            if num_gpu <= max_gpu:
                return n, {"num_gpu": num_gpu}
    return None


def _finish_transfer(
    draw: st.DrawFn,
    model: Any,
    kind: str,
    gpu_pool: list[int],
    cpu_pool: list[int],
    shape: tuple[int, dict[str, Any]],
    conflicting: set[int],
) -> StoreRequested | LoadRequested | None:
    """Draw the blocks of a transfer of ``shape``; None if its CPU sub-blocks meet
    ``conflicting`` (those the other direction's unfinished jobs use)."""
    num_cpu, fields = shape
    num_gpu = fields.pop("num_gpu", None)
    if num_gpu is None:
        num_gpu = sum(fields["group_sizes"])
    gpu = draw(st.permutations(gpu_pool).map(lambda p: p[:num_gpu]))
    cpu = _sample(draw, cpu_pool, num_cpu, num_cpu)
    if kind == "store" or LOADS_DEFER:
        fields["deferred"] = draw(st.integers(0, 2)) == 0
    event: StoreRequested | LoadRequested
    job_id = next_job_id(draw, model)
    if kind == "store":
        event = StoreRequested(job_id=job_id, gpu_block_ids=gpu, cpu_block_ids=cpu, **fields)
    else:
        event = LoadRequested(job_id=job_id, cpu_block_ids=cpu, gpu_block_ids=gpu, **fields)
    try:
        subs = cpu_sub_blocks(event, model.config.block_size_factor)
    except ModelRejected:  # pragma: no cover - the shapes are built to fit
        raise AssertionError(f"test bug: {event!r} does not fit") from None
    return None if conflicting & set(subs) else event


def _written_by_loads(model: Any, submitted_too: bool) -> set[int]:
    """Physical blocks unfinished loads write: the unsubmitted ones' only, or all."""
    return {
        b
        for job in model.jobs.values()
        if job.kind == "load" and (submitted_too or not job.submitted)
        for b in job.gpu_blocks
    }


def draw_store(
    draw: st.DrawFn,
    model: Any,
    cpu_pool: list[int] | None = None,
    groups: bool | None = None,
    over_loads: bool = True,
) -> StoreRequested | None:
    """Offload blocks of live requests into CPU sub-blocks no unfinished load reads
    (sometimes deferred, sometimes in KV-cache groups: ``groups`` None draws it); None if
    there is nothing to store now. With ``over_loads`` it may read blocks that unfinished
    loads write (vLLM stores a chunk a sync load just filled: the two run in submission
    order, each plan fencing the other direction's submitted jobs)."""
    over = over_loads and draw(st.integers(0, 2)) == 0
    avoid = set() if over else _written_by_loads(model, submitted_too=True)
    held = sorted({b for t in model.tables.values() for b in t})
    readable = [b for b in held if model.resolve(b) not in avoid]
    loads_read = model.cpu_subs_in_use("load")
    if cpu_pool is None:
        every = list(range(model.config.num_cpu_blocks))
        cpu_pool = _cpu_clear_of(model, loads_read) if draw(st.integers(0, 4)) else every
    if not cpu_pool or not readable:
        return None
    num_cpu = draw(st.integers(1, min(3, len(cpu_pool))))
    shape = _shape(draw, model, "store", len(readable), num_cpu, groups)
    if shape is None:
        return None
    event = _finish_transfer(draw, model, "store", readable, cpu_pool, shape, loads_read)
    assert event is None or isinstance(event, StoreRequested)
    return event


def draw_load(
    draw: st.DrawFn, model: Any, cpu_pool: list[int] | None = None, groups: bool | None = None
) -> LoadRequested | None:
    """Load CPU sub-blocks that no unfinished store writes into GPU blocks no load writes (a
    partial first CPU block when the sizes call for it; sometimes in KV-cache groups); a
    third of them may write blocks unfinished stores read (vLLM loads into a block whose
    flushed store has not run: submission order decides)."""
    _, free, pinned = _model_views(model)
    if draw(st.integers(0, 2)) == 0:
        pinned = _written_by_loads(model, submitted_too=True)
    held = {b for t in model.tables.values() for b in t}
    targets = sorted(b for b in held | set(free) if model.resolve(b) not in pinned)
    stores_write = model.cpu_subs_in_use("store")
    if cpu_pool is None:
        every = list(range(model.config.num_cpu_blocks))
        cpu_pool = _cpu_clear_of(model, stores_write) if draw(st.integers(0, 4)) else every
    if not cpu_pool or not targets:
        return None
    num_cpu = draw(st.integers(1, min(2, len(cpu_pool))))
    shape = _shape(draw, model, "load", len(targets), num_cpu, groups)
    if shape is None:
        return None
    event = _finish_transfer(draw, model, "load", targets, cpu_pool, shape, stores_write)
    assert event is None or isinstance(event, LoadRequested)
    return event


def draw_transfer_finished(draw: st.DrawFn, model: Any) -> TransferFinished | None:
    """Finish any submitted job in flight, in any order; now and then it failed."""
    done = sorted(j for j, job in model.jobs.items() if job.submitted)
    if not done:
        return None
    job_id = draw(st.sampled_from(done))
    return TransferFinished(job_id=job_id, success=draw(st.sampled_from([True, True, True, False])))


def draw_blocks_released(draw: st.DrawFn, model: Any) -> Event | None:
    """Some blocks of a live request freed, the rest kept (``BlocksReleased``, where the
    schema has it); None if there is no such event or no live request."""
    live = sorted(model.tables)
    if BlocksReleased is None or not live:
        return None
    req_id = draw(st.sampled_from(live))
    table = sorted(set(model.tables[req_id]))
    blocks = draw(st.lists(st.sampled_from(table), min_size=1, max_size=len(table), unique=True))
    event: Event = BlocksReleased(req_id=req_id, block_ids=blocks)
    return event


def draw_submit(draw: st.DrawFn, model: Any) -> TransferSubmitted | None:
    """Submit a deferred job (now and then one already submitted or flushed: a no-op)."""
    waiting = model.unsubmitted()
    pool = waiting if waiting and draw(st.integers(0, 4)) else sorted(model.jobs)
    return TransferSubmitted(job_id=draw(st.sampled_from(pool))) if pool else None


def draw_valid_event(draw: st.DrawFn, model: Any) -> Event:
    """One realistic event the model accepts (allocations and steps most often)."""
    kind = draw(
        st.sampled_from(
            [
                *("alloc",) * 3,
                "finish",
                "preempt",
                "step",
                "step",
                "store",
                "load",
                "submit",
                "done",
                "done",
                "release_some",
            ]
        )
    )
    event: Event | None = None
    if kind == "alloc":
        event = draw_allocation(draw, model)
    elif kind in ("finish", "preempt"):
        event = draw_release(draw, model, preempt=kind == "preempt")
    elif kind == "store":
        event = draw_store(draw, model)
    elif kind == "load":
        event = draw_load(draw, model)
    elif kind == "submit":
        event = draw_submit(draw, model)
    elif kind == "release_some":
        event = draw_blocks_released(draw, model)
    elif kind == "done":
        event = draw_transfer_finished(draw, model)
    return event if event is not None else draw_step(draw, model)


EXPECTED_ERROR = {
    "out_of_range": "BlockOutOfRange",
    "negative": "BlockOutOfRange",
    "duplicate_in_event": "DuplicateBlock",
    "block_in_use": "BlockInUse",
    "unknown_job": "UnknownJob",
    "reused_job": "DuplicateJob",
    "size_mismatch": "TransferSizeMismatch",
    "cpu_out_of_range": "BlockOutOfRange",
    "second_config": "AlreadyConfigured",
    "empty_transfer": "InvalidEvent",
    "negative_step": "InvalidEvent",
    "empty_req_id": "InvalidEvent",
    "load_pinned_alloc": "BlockInUse",
    "cpu_conflict": "BlockInUse",
    "unknown_submit": "UnknownJob",
    "finish_unsubmitted": "UnknownJob",
    "bad_groups": "InvalidEvent",
    "group_size_mismatch": "TransferSizeMismatch",
    "release_unheld": "InvalidEvent",
}
"""The error class (a name in kvlog.errors) each planted defect must raise."""


def _replace_one(draw: st.DrawFn, ids: list[int], bad: int) -> list[int]:
    out = list(ids)
    out[draw(st.integers(0, len(out) - 1))] = bad
    return out


def _any_transfer(
    draw: st.DrawFn, model: Any, **kwargs: Any
) -> StoreRequested | LoadRequested | None:
    if draw(st.booleans()):
        return draw_store(draw, model, **kwargs)
    return draw_load(draw, model, **kwargs)


def _bad_block_event(draw: st.DrawFn, model: Any, bad: int, cpu: bool = False) -> Event | None:
    """A valid allocation or transfer with one block id replaced by ``bad``."""
    transfer = _any_transfer(draw, model)
    if transfer is None or (not cpu and draw(st.booleans())):
        if cpu:
            return None
        _, free, _ = _model_views(model)
        ids = [*_sample(draw, free, 0, 2), bad]
        return BlocksAllocated(req_id=draw(st.sampled_from(MACHINE_REQ_IDS)), block_ids=ids)
    if cpu:
        return _with(transfer, cpu_block_ids=_replace_one(draw, transfer.cpu_block_ids, bad))
    return _with(transfer, gpu_block_ids=_replace_one(draw, transfer.gpu_block_ids, bad))


def _with(event: Any, **changes: Any) -> Any:
    import msgspec

    return msgspec.structs.replace(event, **changes)


def _in_use_event(draw: st.DrawFn, model: Any) -> Event | None:
    """A block that is taken: by a live request (no prefix caching) or by a load."""
    pinned = _written_by_loads(model, submitted_too=True)
    held = sorted({b for t in model.tables.values() for b in t})
    if not model.config.prefix_caching and held:
        _, free, _ = _model_views(model)
        ids = [*_sample(draw, free, 0, 2), draw(st.sampled_from(held))]
        return BlocksAllocated(req_id=draw(st.sampled_from(MACHINE_REQ_IDS)), block_ids=ids)
    if not pinned:
        return None
    taken = model.unresolve(draw(st.sampled_from(sorted(pinned))))
    load = draw_load(draw, model)
    if load is None or taken in load.gpu_block_ids:
        return None
    return _with(load, gpu_block_ids=_replace_one(draw, load.gpu_block_ids, taken))


def _load_pinned_allocation(draw: st.DrawFn, model: Any) -> Event | None:
    """An allocation (with any prefix caching mode) of a block an unfinished load writes,
    submitted or not, held or free."""
    written = sorted(b for b, n in model.pins("load").items() if n > 0)
    if not written:
        return None
    _, free, _ = _model_views(model)
    taken = model.unresolve(draw(st.sampled_from(written)))
    ids = [b for b in _sample(draw, free, 0, 2) if b != taken] + [taken]
    return BlocksAllocated(req_id=draw(st.sampled_from(MACHINE_REQ_IDS)), block_ids=ids)


def _cpu_conflict(draw: st.DrawFn, model: Any) -> Event | None:
    """A store writing a CPU sub-block an unfinished load reads, or a load reading one an
    unfinished store (deferred or not) writes; its GPU side is valid."""
    f = model.config.block_size_factor
    loads_read, stores_write = model.cpu_subs_in_use("load"), model.cpu_subs_in_use("store")
    options = [k for k, subs in (("store", loads_read), ("load", stores_write)) if subs]
    if not options:
        return None
    kind = draw(st.sampled_from(options))
    sub = draw(st.sampled_from(sorted(loads_read if kind == "store" else stores_write)))
    base = draw_store(draw, model, groups=False) if kind == "store" else None
    if kind == "load":
        base = draw_load(draw, model, groups=False)
    if base is None:
        return None
    if kind == "store":  # the seed's rule: f GPU blocks fill CPU block sub // f
        gpu = base.gpu_block_ids
        if len(gpu) < f:
            return None
        return _with(base, gpu_block_ids=gpu[:f], cpu_block_ids=[sub // f])
    _, free, pinned = _model_views(model)
    held = {b for t in model.tables.values() for b in t}
    targets = sorted(b for b in held | set(free) if model.resolve(b) not in pinned)
    if len(targets) < f:
        return None
    gpu = draw(st.permutations(targets).map(lambda p: p[:f]))
    return _with(base, gpu_block_ids=gpu, cpu_block_ids=[sub // f])


def _size_mismatch_event(draw: st.DrawFn, model: Any) -> Event | None:
    f = model.config.block_size_factor
    store = draw_store(draw, model, groups=False)
    if store is not None and draw(st.booleans()):
        gpu = store.gpu_block_ids
        if len(gpu) > 1 and draw(st.booleans()):
            return _with(store, gpu_block_ids=gpu[:-1])
        load_pins = model.pins("load")
        extra = [
            b
            for b in range(model.config.num_gpu_blocks)
            if b not in gpu and load_pins[model.resolve(b)] == 0
        ]
        if extra:
            return _with(store, gpu_block_ids=[*gpu, draw(st.sampled_from(extra))])
    load = draw_load(draw, model, groups=False)
    if load is None:
        return None
    num_cpu = len(load.cpu_block_ids)
    bad = draw(st.sampled_from([n for n in (num_cpu * f + 1, num_cpu * f - f) if n >= 1]))
    _, _, pinned = _model_views(model)
    pool = [b for b in range(model.config.num_gpu_blocks) if model.resolve(b) not in pinned]
    if len(pool) < bad:
        return None
    return _with(load, gpu_block_ids=draw(st.permutations(pool).map(lambda p: p[:bad])))


def _group_size_mismatch(draw: st.DrawFn, model: Any) -> Event | None:
    """A grouped transfer with one CPU block too many or too few for its groups' chunks."""
    transfer = _any_transfer(draw, model, groups=True)
    if transfer is None:
        return None
    cpu = transfer.cpu_block_ids
    spare = [c for c in range(model.config.num_cpu_blocks) if c not in cpu]
    if len(cpu) > 1 and (not spare or draw(st.booleans())):
        return _with(transfer, cpu_block_ids=cpu[:-1])
    if not spare:
        return None
    return _with(transfer, cpu_block_ids=[*cpu, draw(st.sampled_from(spare))])


def _bad_groups(draw: st.DrawFn, model: Any) -> Event | None:
    """Group fields that do not describe the GPU blocks: sizes that do not add up to them,
    or a size without its first block index."""
    transfer = _any_transfer(draw, model)
    if transfer is None:
        return None
    n = len(transfer.gpu_block_ids)
    sizes, indices = transfer.group_sizes or (n,), transfer.block_indices or (0,)
    how = draw(st.sampled_from(["sum", "lengths"]))
    if how == "sum":
        delta = draw(st.sampled_from([-1, 1, 2]))
        sizes = (*sizes[:-1], sizes[-1] + delta) if sizes[-1] + delta >= 0 else (*sizes, 1)
        return _with(transfer, group_sizes=sizes, block_indices=(*indices, 0)[: len(sizes)])
    return _with(transfer, group_sizes=sizes, block_indices=(*indices, 0))


def draw_invalid_event(draw: st.DrawFn, model: Any, kind: str) -> Event | None:
    """An event with exactly the defect ``kind`` (see INVALID_KINDS); None if impossible now."""
    config = model.config
    if kind == "out_of_range":
        return _bad_block_event(draw, model, config.num_gpu_blocks + draw(st.integers(0, 3)))
    if kind == "negative":
        return _bad_block_event(draw, model, -draw(st.integers(1, 3)))
    if kind == "cpu_out_of_range":
        return _bad_block_event(draw, model, config.num_cpu_blocks + draw(st.integers(0, 3)), True)
    if kind == "duplicate_in_event":
        _, free, _ = _model_views(model)
        ids = _sample(draw, free, 1, 3)
        if not ids:
            return None
        return BlocksAllocated(req_id=draw(st.sampled_from(MACHINE_REQ_IDS)), block_ids=ids + ids)
    if kind == "block_in_use":
        return _in_use_event(draw, model)
    if kind == "load_pinned_alloc":
        return _load_pinned_allocation(draw, model)
    if kind == "cpu_conflict":
        return _cpu_conflict(draw, model)
    if kind in ("unknown_job", "unknown_submit"):
        gone = [j for j in range(model.last_job_id + 1) if j not in model.jobs]
        pool = [*gone[-3:], model.last_job_id + 1 + draw(st.integers(0, 5))]
        job_id = draw(st.sampled_from(pool))
        if kind == "unknown_submit":
            return TransferSubmitted(job_id=job_id)
        return TransferFinished(job_id=job_id, success=draw(st.booleans()))
    if kind == "finish_unsubmitted":
        waiting = model.unsubmitted()
        if not waiting:
            return None
        return TransferFinished(job_id=draw(st.sampled_from(waiting)), success=draw(st.booleans()))
    if kind == "reused_job":
        transfer = _any_transfer(draw, model)
        if transfer is None or model.last_job_id < 0:
            return None
        return _with(transfer, job_id=draw(st.integers(0, model.last_job_id)))
    if kind == "size_mismatch":
        return _size_mismatch_event(draw, model)
    if kind == "group_size_mismatch":
        return _group_size_mismatch(draw, model)
    if kind == "bad_groups":
        return _bad_groups(draw, model)
    if kind == "release_unheld":
        if BlocksReleased is None:
            return None
        req_id = draw(st.sampled_from(MACHINE_REQ_IDS))
        own = set(model.tables.get(req_id, []))
        others = [b for b in range(model.config.num_gpu_blocks) if b not in own]
        if not others:
            return None
        block_ids = [*sorted(own)[:1], draw(st.sampled_from(others))]
        return BlocksReleased(req_id=req_id, block_ids=block_ids)
    if kind == "second_config":
        return draw(st.sampled_from([config, _with(config, threshold=config.threshold + 1)]))
    if kind == "empty_transfer":
        store = draw_store(draw, model)
        if store is None:
            return None
        return _with(store, **{draw(st.sampled_from(["gpu_block_ids", "cpu_block_ids"])): []})
    if kind == "negative_step":
        return StepEnded(step=-draw(st.integers(1, 2**62)))
    assert kind == "empty_req_id", kind
    return draw(
        st.sampled_from([RequestFinished(req_id=""), BlocksAllocated(req_id="", block_ids=[])])
    )


# --- executor tests (kvlog.executors) -------------------------------------------------------


@st.composite
def swap_plans(
    draw: st.DrawFn,
    num_gpu_blocks: int,
    pad_sizes: tuple[int, ...] = (8, 16, 32, 64),
    exclude: frozenset[int] = frozenset(),
    step: int = 0,
) -> SwapPlan:
    """Defrag-like ``SwapPlan``s over blocks ``1..num_gpu_blocks-1`` minus ``exclude``.

    Sources and destinations are disjoint (as defrag guarantees); half the time they are
    ordered like defrag's (highest used into lowest free, i.e. reversed runs), else shuffled.
    ``padded_to`` is the smallest pad size that fits, or the pair count when none does.
    """
    pool = [b for b in range(1, num_gpu_blocks) if b not in exclude]
    chosen = draw(st.lists(st.sampled_from(pool), unique=True, max_size=len(pool))) if pool else []
    half = len(chosen) // 2
    src, dst = chosen[:half], chosen[half : 2 * half]
    if draw(st.booleans()):
        src, dst = sorted(src, reverse=True), sorted(dst)
    pairs = list(zip(src, dst, strict=True))
    padded_to = next((p for p in pad_sizes if p >= len(pairs)), len(pairs))
    mode = draw(st.sampled_from(["move", "swap"]))
    return SwapPlan(step=step, pairs=pairs, padded_to=padded_to, mode=mode)


def distinct_blocks(pool: list[int], max_size: int) -> st.SearchStrategy[list[int]]:
    """Up to ``max_size`` distinct elements of ``pool``, in any order (empty pool: [])."""
    if not pool:
        return st.just([])
    return st.lists(st.sampled_from(pool), unique=True, max_size=min(max_size, len(pool)))


# --- Reducer programs: realistic event sequences from a tiny simulated scheduler ------------
# Used by tests/reducers/ and tests/properties/. ``random_program`` drives the same
# simulation from a ``random.Random``, so hypothesis examples and the long seeded workloads
# share one generator.


class _Job:
    """A job of the simulated scheduler: logical GPU blocks, CPU sub-blocks, submitted."""

    __slots__ = ("blocks", "kind", "submitted", "subs")

    def __init__(self, kind: str, blocks: list[int], subs: list[int], submitted: bool) -> None:
        self.kind, self.blocks, self.subs, self.submitted = kind, blocks, subs, submitted


def random_program(
    rng: Any,
    config: CacheConfigured,
    num_events: int,
    transfers: bool = True,
    *,
    deferred: bool = True,
    groups: bool = True,
    reuse: bool = True,
) -> list[Event]:
    """``CacheConfigured`` then ``num_events`` events a vLLM-like scheduler could send.

    Logical blocks come from a FIFO free list (released blocks go to its end), requests
    append and finish in random order (so defrag has holes to fill), prefix caching shares
    held blocks, stores read held blocks and loads write unpinned ones (now and then a store
    and a load share a block) with a partial first CPU block when the sizes call for it;
    jobs finish in any order once submitted. No allocation takes a block a load writes, no
    two loads write one block, and no store writes a CPU sub-block a load reads (nor the
    other way round). Pins are tracked in logical space,
    which is exact: defrag never moves a pinned block.

    ``deferred``: some stores (and loads, where the schema has it) are deferred and later
    submitted with ``TransferSubmitted`` (now and then twice). ``groups``: some transfers
    use vLLM's KV-cache groups (unaligned first blocks, partial chunks, empty groups).
    ``reuse``: some allocations take free blocks that unfinished stores still read (the
    engine flushes and fences those stores).
    """
    n = config.num_gpu_blocks
    free = list(range(1, n))
    refs: dict[int, int] = {}
    tables: dict[str, list[int]] = {}
    jobs: dict[int, _Job] = {}
    events: list[Event] = [config]
    next_job, step, next_req = 0, 0, 0
    ops = ["alloc", "alloc", "alloc", "extend", "finish", "step", "step", "store", "load", "done"]
    if transfers and deferred:
        ops.append("submit")
    if transfers and reuse:
        ops.append("reuse")

    def pins(kind: str | None = None) -> set[int]:
        return {b for job in jobs.values() if kind in (None, job.kind) for b in job.blocks}

    def subs_in_use(kind: str) -> set[int]:
        return {s for job in jobs.values() if job.kind == kind for s in job.subs}

    while len(events) <= num_events:
        op = rng.choice(ops)
        if op in ("alloc", "extend", "reuse"):
            live = sorted(tables)
            if op == "extend" and live:
                req_id = rng.choice(live)
            else:
                req_id, next_req = f"req-{next_req}", next_req + 1
            loading, reading = pins("load"), pins("store")
            pool = [b for b in free if b not in loading]
            if op == "reuse":
                pool = [b for b in pool if b in reading]
            k = min(len(pool), rng.choice((1, 1, 2, 3, 5, 8, 13)))
            picked = pool[:k] if rng.random() < 0.7 else rng.sample(pool, k)
            shared: list[int] = []
            if config.prefix_caching and refs and rng.random() < 0.3:
                own = set(tables.get(req_id, []))
                others = sorted(b for b in refs if b not in own and b not in loading)
                shared = rng.sample(others, min(len(others), rng.randint(1, 3)))
            block_ids = shared + picked
            if not block_ids:
                continue
            for job in jobs.values():  # the engine flushes stores that read reused blocks
                if job.kind == "store" and not set(job.blocks).isdisjoint(picked):
                    job.submitted = True
            for b in picked:
                free.remove(b)
            for b in block_ids:
                refs[b] = refs.get(b, 0) + 1
            tables.setdefault(req_id, []).extend(block_ids)
            events.append(BlocksAllocated(req_id=req_id, block_ids=block_ids))
        elif op == "finish":
            if not tables:
                continue
            req_id = rng.choice(sorted(tables))
            for b in tables.pop(req_id):
                refs[b] -= 1
                if refs[b] == 0:
                    del refs[b]
                    free.append(b)
            kind = RequestPreempted if rng.random() < 0.3 else RequestFinished
            events.append(kind(req_id=req_id))
        elif op == "step":
            events.append(StepEnded(step=step))
            step += 1
        elif op == "done":
            done = sorted(j for j, job in jobs.items() if job.submitted)
            if done:
                job_id = rng.choice(done)
                del jobs[job_id]
                events.append(TransferFinished(job_id=job_id, success=rng.random() < 0.9))
        elif op == "submit":
            waiting = sorted(j for j, job in jobs.items() if not job.submitted)
            pool = waiting if waiting and rng.random() < 0.9 else sorted(jobs)
            if pool:
                job_id = rng.choice(pool)
                jobs[job_id].submitted = True
                events.append(TransferSubmitted(job_id=job_id))
        elif transfers and config.num_cpu_blocks and len(jobs) < 8:
            event = _random_transfer(
                rng,
                config,
                next_job,
                refs,
                free,
                pins,
                subs_in_use,
                deferred,
                groups,
            )
            if event is not None:
                kind_name = "store" if isinstance(event, StoreRequested) else "load"
                subs = cpu_sub_blocks(event, config.block_size_factor)
                submitted = not getattr(event, "deferred", False)
                jobs[event.job_id] = _Job(kind_name, list(event.gpu_block_ids), subs, submitted)
                next_job = event.job_id + 1
                events.append(event)
    return events


def _random_transfer(
    rng: Any,
    config: CacheConfigured,
    next_job: int,
    refs: dict[int, int],
    free: list[int],
    pins: Any,
    subs_in_use: Any,
    deferred: bool,
    groups: bool,
) -> Event | None:
    f = config.block_size_factor
    job_id = next_job + rng.choice((0, 0, 1, 4))
    store = rng.random() < 0.5
    conflicting = subs_in_use("load" if store else "store")
    clear = [
        c
        for c in range(config.num_cpu_blocks)
        if not any(c * f + k in conflicting for k in range(f))
    ]
    cpu_pool = clear if rng.random() < 0.9 else range(config.num_cpu_blocks)
    if not cpu_pool:
        return None
    num_cpu = rng.randint(1, min(2, len(cpu_pool)))
    cpu = rng.sample(cpu_pool, num_cpu)
    fields: dict[str, Any] = {}
    if groups and rng.random() < 0.3:
        sizes, indices = group_spec(rng.randint, num_cpu, f)
        fields.update(group_sizes=sizes, block_indices=indices)
        num_gpu = sum(sizes)
    else:
        num_gpu = num_cpu * f if store else num_cpu * f - rng.randint(0, f - 1)
    if deferred and (store or LOADS_DEFER) and rng.random() < (0.4 if store else 0.25):
        fields["deferred"] = True
    if store:  # now and then over blocks loads write (submission order, fences)
        avoid = set() if rng.random() < 0.3 else pins("load")
        pool = sorted(b for b in refs if b not in avoid)
    else:  # now and then into blocks stores read (submission order, fences)
        busy = pins("load") if rng.random() < 0.3 else pins()
        pool = sorted(b for b in [*refs, *free] if b not in busy)
    if len(pool) < num_gpu:
        return None
    gpu = rng.sample(pool, num_gpu)
    event: StoreRequested | LoadRequested
    if store:
        event = StoreRequested(job_id=job_id, gpu_block_ids=gpu, cpu_block_ids=cpu, **fields)
    else:
        event = LoadRequested(job_id=job_id, cpu_block_ids=cpu, gpu_block_ids=gpu, **fields)
    if conflicting & set(cpu_sub_blocks(event, f)):
        return None
    return event


@st.composite
def reducer_programs(
    draw: st.DrawFn,
    max_gpu_blocks: int = 160,
    max_events: int = 150,
    transfers: bool = True,
    **features: bool,
) -> list[Event]:
    """A config (small pools, low thresholds, small pads) and a realistic program for it
    (``features``: the keyword options of ``random_program``)."""
    config = draw(machine_configs(max_gpu_blocks=max_gpu_blocks))
    rng = draw(st.randoms(use_true_random=False))
    num_events = draw(st.integers(1, max_events))
    return random_program(rng, config, num_events, transfers, **features)


# -- the CPU tier ---------------------------------------------------------------------------
TIER_CALL_KINDS = 10
"""Kinds of a tier call in ``tier_calls`` (see the driver in
``tests/vllm/test_cpu_offloading_manager.py``)."""


_TIER_CALL_MIX = (0, 1, 2, 3, 3, 3, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 7, 7, 8, 9)
"""Each kind as often as it appears: the stores, loads and their completions that make
evictions, reuse (ARC's T2) and ghost hits, more often than the rest."""


@st.composite
def tier_calls(
    draw: st.DrawFn,
    eviction: str = "lru",
    store_threshold: int = 0,
    min_calls: int = 1,
    max_calls: int = 60,
) -> tuple[dict[str, Any], list[tuple[int, int, int, int]]]:
    """A CPU tier's configuration and abstract calls ``(kind, a, b, c)``: a driver turns
    each into a call the manager can take (which request, which keys, which pending job)."""
    config = {
        "num_chunks": draw(st.integers(1, 8)),
        "cache_policy": eviction,
        "store_threshold": store_threshold,
        "max_tracker_size": draw(st.integers(2, 12)),
    }
    call = st.tuples(
        st.sampled_from(_TIER_CALL_MIX),
        st.integers(0, 63),
        st.integers(0, 63),
        st.integers(0, 63),
    )
    return config, draw(st.lists(call, min_size=min_calls, max_size=max_calls))


@st.composite
def tier_traces(draw: st.DrawFn, max_requests: int = 30, max_keys: int = 24) -> list[list[int]]:
    """Requests as key sequences over a small key space, with shared prefixes (a request
    often starts with an earlier request's keys, as prompts share system prompts)."""
    num_keys = draw(st.integers(1, max_keys))
    requests: list[list[int]] = []
    for _ in range(draw(st.integers(1, max_requests))):
        prefix: list[int] = []
        if requests and draw(st.booleans()):
            earlier = requests[draw(st.integers(0, len(requests) - 1))]
            prefix = earlier[: draw(st.integers(0, len(earlier)))]
        tail = draw(st.lists(st.integers(0, num_keys - 1), max_size=8))
        keys = list(dict.fromkeys(prefix + tail))
        if keys:
            requests.append(keys)
    return requests or [[0]]


# -- transfer batches (the connector's one event a call) ----------------------------------
_TRANSFER_TYPES = (StoreRequested, LoadRequested, TransferSubmitted, TransferFinished)


@st.composite
def transfer_batch_programs(draw: st.DrawFn, max_events: int = 120) -> list[list[Event] | Event]:
    """A realistic program (``reducer_programs``) whose runs of transfer events are cut into
    batches at random (a ``list`` stands for one ``TransferBatch``), now and then with a
    stray transfer event (any job id, blocks out of range: refusals), the order inside a
    batch shuffled (ids out of order, a submit before its request) or a job finished twice."""
    program = draw(reducer_programs(max_gpu_blocks=48, max_events=max_events))
    out: list[list[Event] | Event] = [program[0]]
    run: list[Event] = []

    def cut() -> None:
        while run:
            size = draw(st.integers(1, max(1, len(run))))
            batch = run[:size]
            del run[:size]
            if draw(st.integers(0, 9)) == 0:
                batch.append(draw(st.one_of(any_event.filter(_is_transfer))))
            if len(batch) > 1 and draw(st.integers(0, 9)) == 0:
                batch = draw(st.permutations(batch))
            if draw(st.integers(0, 14)) == 0:
                batch.append(batch[0])  # the same event twice
            out.append(list(batch))

    for event in program[1:]:
        if type(event) in _TRANSFER_TYPES:
            run.append(event)
        else:
            cut()
            out.append(event)
    cut()
    return out


def _is_transfer(event: Event) -> bool:
    return type(event) in _TRANSFER_TYPES

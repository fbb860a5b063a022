"""Hypothesis strategies shared by the test suite.

Add new strategies at the end of this file; do not rewrite existing ones (other tests use them).
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

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
)

__all__ = [
    "any_event",
    "any_record",
    "block_lists",
    "cache_configs",
    "distinct_blocks",
    "req_ids",
    "swap_plans",
]

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
    )


_ids = st.integers(0, 2**63 - 1)

any_event: st.SearchStrategy[Event] = st.one_of(
    cache_configs(),
    st.builds(BlocksAllocated, req_id=req_ids, block_ids=block_lists()),
    st.builds(RequestFinished, req_id=req_ids),
    st.builds(RequestPreempted, req_id=req_ids),
    st.builds(StepEnded, step=_ids),
    st.builds(
        StoreRequested, job_id=_ids, gpu_block_ids=block_lists(), cpu_block_ids=block_lists()
    ),
    st.builds(LoadRequested, job_id=_ids, cpu_block_ids=block_lists(), gpu_block_ids=block_lists()),
    st.builds(TransferFinished, job_id=_ids, success=st.booleans()),
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


# --- Stateful fuzzing: configs, realistic events and one-defect events ----------------------
# Used by tests/test_machine_*.py and tests/test_replay_properties.py. The helpers take a
# ``draw`` function (``data.draw`` inside a state machine rule) and the plain model of
# tests/model.py, so that generated programs are realistic: they allocate mostly free blocks,
# share only with prefix caching, and finish jobs that are in flight.

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
)
"""The defects ``draw_invalid_event`` plants, one per event."""


@st.composite
def machine_configs(
    draw: st.DrawFn,
    min_gpu_blocks: int = 16,
    max_gpu_blocks: int = 200,
    page_size_bytes: int | None = None,
) -> CacheConfigured:
    """Small pools, low thresholds and small pads, so that defrag fires often."""
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
    )


def _model_views(model: Any) -> tuple[Any, list[int], set[int]]:
    """(refs, free logical ids, physical ids pinned by any job) of a plain model."""
    refs, store_pins, pins = model.refs(), model.pins("store"), model.pins()
    free = [
        b
        for b in range(model.config.num_gpu_blocks)
        if refs[model.resolve(b)] == 0
        and (model.config.prefix_caching or store_pins[model.resolve(b)] == 0)
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


def draw_allocation(draw: st.DrawFn, model: Any) -> BlocksAllocated:
    """A request gets mostly free blocks; with prefix caching it may share others' blocks."""
    req_id = draw(st.sampled_from(MACHINE_REQ_IDS))
    _, free, _ = _model_views(model)
    own = set(model.tables.get(req_id, []))
    shared: list[int] = []
    if model.config.prefix_caching and draw(st.integers(0, 2)) == 0:
        others = sorted({b for r, t in model.tables.items() if r != req_id for b in t} - own)
        shared = _sample(draw, others, 1, 4)
    fresh_pool = [b for b in free if b not in own and b not in shared]
    count = draw(st.sampled_from([1, 2, 4, 8]))
    where = draw(st.sampled_from(["anywhere", "anywhere", "highest", "lowest"]))
    if where == "anywhere" or len(fresh_pool) <= count:
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


def draw_store(
    draw: st.DrawFn, model: Any, cpu_pool: list[int] | None = None
) -> StoreRequested | None:
    """Offload blocks of live requests that no load is writing; None if there are none."""
    f = model.config.block_size_factor
    load_pins = model.pins("load")
    held = sorted({b for t in model.tables.values() for b in t})
    readable = [b for b in held if load_pins[model.resolve(b)] == 0]
    cpu_pool = list(range(model.config.num_cpu_blocks)) if cpu_pool is None else cpu_pool
    num_cpu = draw(st.integers(1, 2))
    while num_cpu > 1 and (num_cpu * f > len(readable) or num_cpu > len(cpu_pool)):
        num_cpu -= 1
    if num_cpu * f > len(readable) or not cpu_pool:
        return None
    gpu = draw(st.permutations(readable).map(lambda p: p[: num_cpu * f]))
    cpu = _sample(draw, cpu_pool, num_cpu, num_cpu)
    return StoreRequested(job_id=next_job_id(draw, model), gpu_block_ids=gpu, cpu_block_ids=cpu)


def draw_load(
    draw: st.DrawFn, model: Any, cpu_pool: list[int] | None = None
) -> LoadRequested | None:
    """Load CPU blocks into unpinned GPU blocks (a partial first block when ``skip`` > 0)."""
    f = model.config.block_size_factor
    _, free, pinned = _model_views(model)
    held = {b for t in model.tables.values() for b in t}
    targets = sorted(b for b in held | set(free) if model.resolve(b) not in pinned)
    cpu_pool = list(range(model.config.num_cpu_blocks)) if cpu_pool is None else cpu_pool
    if not cpu_pool:
        return None
    num_cpu = draw(st.integers(1, min(2, len(cpu_pool))))
    num_gpu = num_cpu * f - draw(st.integers(0, f - 1))
    if num_gpu > len(targets):
        return None
    gpu = draw(st.permutations(targets).map(lambda p: p[:num_gpu]))
    cpu = _sample(draw, cpu_pool, num_cpu, num_cpu)
    return LoadRequested(job_id=next_job_id(draw, model), cpu_block_ids=cpu, gpu_block_ids=gpu)


def draw_transfer_finished(draw: st.DrawFn, model: Any) -> TransferFinished | None:
    """Finish any job in flight, in any order; now and then it failed."""
    if not model.jobs:
        return None
    job_id = draw(st.sampled_from(sorted(model.jobs)))
    return TransferFinished(job_id=job_id, success=draw(st.sampled_from([True, True, True, False])))


def draw_valid_event(draw: st.DrawFn, model: Any) -> Event:
    """One realistic event the model accepts (allocations and steps most often)."""
    kind = draw(
        st.sampled_from(
            [*("alloc",) * 3, "finish", "preempt", "step", "step", "store", "load", "done", "done"]
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
}
"""The error class (a name in kvlog.errors) each planted defect must raise."""


def _replace_one(draw: st.DrawFn, ids: list[int], bad: int) -> list[int]:
    out = list(ids)
    out[draw(st.integers(0, len(out) - 1))] = bad
    return out


def _bad_block_event(draw: st.DrawFn, model: Any, bad: int, cpu: bool = False) -> Event | None:
    """A valid allocation or transfer with one block id replaced by ``bad``."""
    transfer = draw(st.sampled_from([draw_store, draw_load]))(draw, model)
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
    """A block that is taken: by a live request (no prefix caching) or by a transfer."""
    _, _, pinned = _model_views(model)
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


def _size_mismatch_event(draw: st.DrawFn, model: Any) -> Event | None:
    f = model.config.block_size_factor
    store = draw_store(draw, model)
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
    load = draw_load(draw, model)
    if load is None:
        return None
    num_cpu = len(load.cpu_block_ids)
    bad = draw(st.sampled_from([n for n in (num_cpu * f + 1, num_cpu * f - f) if n >= 1]))
    _, _, pinned = _model_views(model)
    pool = [b for b in range(model.config.num_gpu_blocks) if model.resolve(b) not in pinned]
    if len(pool) < bad:
        return None
    return _with(load, gpu_block_ids=draw(st.permutations(pool).map(lambda p: p[:bad])))


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
    if kind == "unknown_job":
        gone = [j for j in range(model.last_job_id + 1) if j not in model.jobs]
        pool = [*gone[-3:], model.last_job_id + 1 + draw(st.integers(0, 5))]
        return TransferFinished(job_id=draw(st.sampled_from(pool)), success=draw(st.booleans()))
    if kind == "reused_job":
        transfer = draw(st.sampled_from([draw_store, draw_load]))(draw, model)
        if transfer is None or model.last_job_id < 0:
            return None
        return _with(transfer, job_id=draw(st.integers(0, model.last_job_id)))
    if kind == "size_mismatch":
        return _size_mismatch_event(draw, model)
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
# Used by tests/test_reducer_*.py. ``random_program`` drives the same simulation from a
# ``random.Random``, so hypothesis examples and the long seeded workloads share one generator.


def random_program(
    rng: Any, config: CacheConfigured, num_events: int, transfers: bool = True
) -> list[Event]:
    """``CacheConfigured`` then ``num_events`` events a vLLM-like scheduler could send.

    Logical blocks come from a FIFO free list (released blocks go to its end), requests
    append and finish in random order (so defrag has holes to fill), prefix caching shares
    held blocks, stores read held blocks and loads write unpinned ones (with a partial first
    CPU block when the sizes call for it); jobs finish in any order. Pins are tracked in
    logical space, which is exact: defrag never moves a pinned block.
    """
    n = config.num_gpu_blocks
    free = list(range(1, n))
    refs: dict[int, int] = {}
    tables: dict[str, list[int]] = {}
    jobs: dict[int, tuple[str, list[int]]] = {}
    events: list[Event] = [config]
    next_job, step, next_req = 0, 0, 0

    def pins(kind: str | None = None) -> set[int]:
        return {b for k, ids in jobs.values() if kind in (None, k) for b in ids}

    def allocatable() -> list[int]:
        if config.prefix_caching:
            return free
        reading = pins("store")
        return [b for b in free if b not in reading]

    while len(events) <= num_events:
        op = rng.choice(
            ("alloc", "alloc", "alloc", "extend", "finish", "step", "step", "store", "load", "done")
        )
        if op in ("alloc", "extend"):
            live = sorted(tables)
            if op == "extend" and live:
                req_id = rng.choice(live)
            else:
                req_id, next_req = f"req-{next_req}", next_req + 1
            pool = allocatable()
            k = min(len(pool), rng.choice((1, 1, 2, 3, 5, 8, 13)))
            picked = pool[:k] if rng.random() < 0.7 else rng.sample(pool, k)
            shared: list[int] = []
            if config.prefix_caching and refs and rng.random() < 0.3:
                own = set(tables.get(req_id, []))
                others = sorted(b for b in refs if b not in own)
                shared = rng.sample(others, min(len(others), rng.randint(1, 3)))
            block_ids = shared + picked
            if not block_ids:
                continue
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
            if jobs:
                job_id = rng.choice(sorted(jobs))
                del jobs[job_id]
                events.append(TransferFinished(job_id=job_id, success=rng.random() < 0.9))
        elif transfers and config.num_cpu_blocks and len(jobs) < 8:
            event = _random_transfer(rng, config, next_job, refs, free, pins)
            if event is not None:
                kind_name = "store" if isinstance(event, StoreRequested) else "load"
                jobs[event.job_id] = (kind_name, list(event.gpu_block_ids))
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
) -> Event | None:
    f = config.block_size_factor
    job_id = next_job + rng.choice((0, 0, 1, 4))
    num_cpu = rng.randint(1, min(2, config.num_cpu_blocks))
    cpu = rng.sample(range(config.num_cpu_blocks), num_cpu)
    if rng.random() < 0.5:
        loading = pins("load")
        readable = sorted(b for b in refs if b not in loading)
        if len(readable) < num_cpu * f:
            return None
        gpu = rng.sample(readable, num_cpu * f)
        return StoreRequested(job_id=job_id, gpu_block_ids=gpu, cpu_block_ids=cpu)
    busy = pins()
    targets = sorted(b for b in [*refs, *free] if b not in busy)
    num_gpu = num_cpu * f - rng.randint(0, f - 1)
    if len(targets) < num_gpu:
        return None
    gpu = rng.sample(targets, num_gpu)
    return LoadRequested(job_id=job_id, cpu_block_ids=cpu, gpu_block_ids=gpu)


@st.composite
def reducer_programs(
    draw: st.DrawFn, max_gpu_blocks: int = 160, max_events: int = 150, transfers: bool = True
) -> list[Event]:
    """A config (small pools, low thresholds, small pads) and a realistic program for it."""
    config = draw(machine_configs(max_gpu_blocks=max_gpu_blocks))
    rng = draw(st.randoms(use_true_random=False))
    num_events = draw(st.integers(1, max_events))
    return random_program(rng, config, num_events, transfers)

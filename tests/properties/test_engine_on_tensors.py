"""The Engine with a real executor on small tensors, as a state machine with canary bytes.

Every block gets fresh canary bytes when it is allocated (or the bytes a load brings); the
machine tracks what each LOGICAL block must hold, independently of the engine, and after
every rule reads each one through ``engine.resolve`` and ``executor.read_gpu_block``. Each
finished store must hold, in its CPU sub-blocks, the bytes its GPU blocks held when its
plan was handed out: at ``StoreRequested``, or for a deferred store at ``TransferSubmitted``
or at the flush of an allocation that reuses one of its blocks. Between a deferred store's
request and its submission the ``compute`` rule writes new bytes into its blocks (the KV it
waits for), so a store that read its blocks too early shows up. The fake backend defers
every copy until a late, seeded completion and reads the source only then, so a missing pin
(defrag moving a block a transfer has yet to read, or moving something into a block a load
has yet to write) or a missing fence (a reused block overwritten by its new owner before a
store read it: the store must read the old bytes) shows up as wrong bytes.

What a block must hold: without prefix caching (``"move"`` swaps) the blocks of live
requests and the blocks unfinished stores read keep their bytes; with prefix caching
(``"swap"``) every block does, free ones included (they may be cached prefixes), which the
machine checks too.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass
from typing import Any

import msgspec
import torch
from hypothesis import event as note_event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvlog import Engine, reducers
from kvlog.events import (
    BlocksAllocated,
    CacheConfigured,
    Event,
    FencePlan,
    LoadRequested,
    Plan,
    RequestFinished,
    RequestPreempted,
    StoreRequested,
    TransferFinished,
    TransferPlan,
)
from kvlog.executors import make_executor
from tests.support.model import PlainModel, cpu_sub_blocks
from tests.support.strategies import (
    MACHINE_REQ_IDS,
    draw_allocation,
    draw_blocks_released,
    draw_load,
    draw_release,
    draw_step,
    draw_store,
    draw_submit,
    machine_configs,
)

WIDTH = 4  # int8 per slot per tensor; two layers of key and value: 16 * block_size bytes


def make_kv_caches(layout: str, config: CacheConfigured) -> list[Any]:
    """Two layers of zeroed key/value caches in one of three layouts."""
    n, bs = config.num_gpu_blocks, config.block_size
    if layout == "hpu":  # flat slots, one pad block
        shape: tuple[int, ...] = ((n + 1) * bs, WIDTH)
        return [tuple(torch.zeros(shape, dtype=torch.int8) for _ in "kv") for _ in range(2)]
    if layout == "vllm":  # (2, num_blocks, block_size, ...)
        return [torch.zeros((2, n, bs, WIDTH), dtype=torch.int8) for _ in range(2)]
    return [
        (
            torch.zeros((n, bs, WIDTH), dtype=torch.int8),
            torch.zeros((n, bs, WIDTH), dtype=torch.int8),
        )
        for _ in range(2)
    ]


@dataclass
class JobRecord:
    """A transfer the machine requested; ``captured`` is what a store must deliver, set
    when its plan is handed out (None until then)."""

    event: StoreRequested | LoadRequested
    captured: list[bytes | None] | None = None


class EngineOnTensors(RuleBasedStateMachine):
    """An Engine with a cpu or fake executor; the model generates and checks the events."""

    def __init__(self) -> None:
        super().__init__()
        self.model = PlainModel()
        self.engine: Any = None
        self.executor: Any = None
        self.expected: dict[int, bytes | None] = {}  # logical GPU block -> its bytes
        self.cpu_expected: dict[int, bytes | None] = {}  # CPU sub-block -> its bytes
        self.jobs: dict[int, JobRecord] = {}
        self.num_canaries = 0

    @initialize(
        config=machine_configs(max_gpu_blocks=64, page_size_bytes=0),
        layout=st.sampled_from(["block_major", "hpu", "vllm"]),
        backend=st.sampled_from(["fake", "fake", "cpu"]),
        seed=st.integers(0, 2**16),
        max_delay_polls=st.integers(1, 6),
        failure_rate=st.sampled_from([0.0, 0.0, 0.2]),
        warm_up=st.integers(0, 6),
        data=st.data(),
    )
    def configure(
        self,
        config: CacheConfigured,
        layout: str,
        backend: str,
        seed: int,
        max_delay_polls: int,
        failure_rate: float,
        warm_up: int,
        data: st.DataObject,
    ) -> None:
        """Small real tensors, an executor, an engine; then ``warm_up`` allocations and
        steps, so that transfers and defrag have blocks to work on from the start."""
        config = msgspec.structs.replace(config, page_size_bytes=4 * config.block_size * WIDTH)
        self.model.apply(config)
        self.page = config.page_size_bytes
        self.executor = make_executor(
            make_kv_caches(layout, config),
            config,
            backend=backend,
            seed=seed,
            failure_rate=failure_rate,
            max_delay_polls=max_delay_polls,
        )
        self.engine = Engine(config, executor=self.executor)
        for _ in range(warm_up):
            self.allocate(data)
            self.allocate(data)
            self.end_step(data)

    # -- helpers -------------------------------------------------------------------------
    @property
    def swap_mode(self) -> bool:
        return bool(self.model.config.prefix_caching)

    def apply(self, event: Event | None) -> list[Plan] | None:
        """Apply a generated (valid) event to the model and the engine; record a transfer
        and capture what each store plan handed out now must deliver. None: no event."""
        if event is None:
            return None
        expected = self.model.apply(event)  # generated events are valid: the model agrees
        plans = self.engine.apply(event)
        assert plans == expected, f"{event!r}: engine planned {plans!r}, model {expected!r}"
        if isinstance(event, (StoreRequested, LoadRequested)):
            self.jobs[event.job_id] = JobRecord(event)
        for plan in plans:
            note_event(f"plan {type(plan).__name__}")
            if isinstance(plan, TransferPlan) and plan.kind == "store":
                record = self.jobs[plan.job_id]
                assert record.captured is None, f"store {plan.job_id} planned twice"
                record.captured = [self.expected.get(b) for b in record.event.gpu_block_ids]
                if not isinstance(event, StoreRequested):
                    note_event(f"deferred store planned at {type(event).__name__}")
            elif isinstance(plan, FencePlan):
                note_event("fence before a reused block is overwritten")
        return plans

    def canary(self) -> bytes:
        self.num_canaries += 1
        return random.Random(self.num_canaries).randbytes(self.page)

    def write(self, block: int) -> None:
        """New bytes for a logical block (its request computes KV into it)."""
        self.expected[block] = self.canary()
        self.executor.write_gpu_block(self.engine.resolve(block), self.expected[block])

    def held(self) -> set[int]:
        return {b for table in self.model.tables.values() for b in table}

    def store_read(self) -> set[int]:
        """Logical blocks that unfinished stores read (their bytes stay put until then)."""
        pins = self.model.pins("store")
        return {b for b in self.expected if pins[self.model.resolve(b)] > 0}

    def forget_free(self) -> None:
        """Under ``"move"`` swaps a free block may be overwritten by defrag once no store
        reads it: its bytes are no longer known."""
        if self.swap_mode:
            return
        keep = self.held() | self.store_read()
        for block in [b for b in self.expected if b not in keep]:
            self.expected[block] = None

    def cpu_in_flight(self, kind: str) -> set[int]:
        return {
            c
            for record in self.jobs.values()
            if (kind == "store") == isinstance(record.event, StoreRequested)
            for c in record.event.cpu_block_ids
        }

    # -- rules ---------------------------------------------------------------------------
    @rule(data=st.data())
    def allocate(self, data: st.DataObject) -> None:
        held, store_pins = self.held(), self.model.pins("store")
        event = draw_allocation(data.draw, self.model)
        reused = {b for b in event.block_ids if store_pins[self.model.resolve(b)] > 0}
        self.apply(event)
        for block in event.block_ids:
            if block in held:
                continue  # a shared prefix block keeps its bytes
            if self.swap_mode and data.draw(st.booleans()):
                continue  # a prefix-cache hit: the block keeps its (cached) bytes
            if block in reused:
                note_event("a block a store reads is overwritten by its new owner")
            self.write(block)  # after the engine's fence: the store read the old bytes

    @rule(data=st.data(), preempt=st.booleans())
    def hand_over(self, data: st.DataObject, preempt: bool) -> None:
        """The scheduler frees a request whose blocks a store still reads (submitted or
        deferred) and hands some of them to another request in the same step; the new
        owner writes its KV into them at once. The engine must flush and fence first."""
        read = self.model.pins("store")
        owners = sorted(
            r for r, t in self.model.tables.items() if any(read[self.model.resolve(b)] for b in t)
        )
        if not owners:
            return
        owner = data.draw(st.sampled_from(owners))
        self.apply(RequestPreempted(req_id=owner) if preempt else RequestFinished(req_id=owner))
        refs, loads = self.model.refs(), self.model.pins("load")
        free = [
            b
            for b in range(self.model.config.num_gpu_blocks)
            if refs[p := self.model.resolve(b)] == 0 and read[p] and not loads[p]
        ]
        if not free:
            self.forget_free()
            return
        blocks = data.draw(st.lists(st.sampled_from(sorted(free)), min_size=1, unique=True))
        taker = data.draw(st.sampled_from([r for r in MACHINE_REQ_IDS if r != owner]))
        plans = self.apply(BlocksAllocated(req_id=taker, block_ids=blocks))
        assert plans and isinstance(plans[-1], FencePlan), plans
        for block in blocks:
            self.write(block)
        self.forget_free()

    @rule(data=st.data())
    def release_some(self, data: st.DataObject) -> None:
        self.apply(draw_blocks_released(data.draw, self.model))
        self.forget_free()

    @rule(data=st.data(), preempt=st.booleans())
    def release(self, data: st.DataObject, preempt: bool) -> None:
        self.apply(draw_release(data.draw, self.model, preempt))
        self.forget_free()

    @rule(data=st.data())
    def end_step(self, data: st.DataObject) -> None:
        self.apply(draw_step(data.draw, self.model))

    @rule(data=st.data())
    def store(self, data: st.DataObject) -> None:
        busy = self.cpu_in_flight("store") | self.cpu_in_flight("load")
        pool = [c for c in range(self.model.config.num_cpu_blocks) if c not in busy]
        # not over blocks loads still write: what such a store delivers is left unchecked
        self.apply(draw_store(data.draw, self.model, cpu_pool=pool, over_loads=False))

    @rule(data=st.data())
    def load(self, data: st.DataObject) -> None:
        busy = self.cpu_in_flight("store")
        pool = [c for c in range(self.model.config.num_cpu_blocks) if c not in busy]
        event = draw_load(data.draw, self.model, cpu_pool=pool)
        if self.apply(event) is not None:
            assert event is not None
            for block in event.gpu_block_ids:
                self.expected[block] = None  # written when the load completes

    @rule(data=st.data())
    def submit(self, data: st.DataObject) -> None:
        self.apply(draw_submit(data.draw, self.model))

    @rule(data=st.data())
    def compute(self, data: st.DataObject) -> None:
        """The forward pass writes the KV that deferred, unsubmitted stores wait for: new
        bytes in blocks that only such stores read (and one live request holds)."""
        refs, loads = self.model.refs(), self.model.pins("load")
        submitted = self.model.pins("store") - Counter(
            b for j in self.model.unsubmitted() for b in self.model.jobs[j].gpu_blocks
        )
        waiting = {b for j in self.model.unsubmitted() for b in self.model.jobs[j].gpu_blocks}
        blocks = sorted(
            b
            for b in self.held()
            if (p := self.model.resolve(b)) in waiting
            and refs[p] == 1
            and not loads[p]
            and not submitted[p]
        )
        if blocks:
            for block in data.draw(st.lists(st.sampled_from(blocks), min_size=1, unique=True)):
                self.write(block)
            note_event("KV computed into a deferred store's blocks")

    @rule(wait=st.sampled_from([False, False, False, True]))
    def poll(self, wait: bool) -> None:
        results = self.engine.wait() if wait else self.engine.poll()
        for result in results:
            assert self.model.apply(TransferFinished(result.job_id, result.success)) == []
            record = self.jobs.pop(result.job_id)
            event = record.event
            note_event(f"{type(event).__name__} success={result.success}")
            subs = cpu_sub_blocks(event, self.model.config.block_size_factor)
            if isinstance(event, StoreRequested):
                assert record.captured is not None, f"store {event.job_id} ran unplanned"
                for sub, data in zip(subs, record.captured, strict=True):
                    self.cpu_expected[sub] = data if result.success else None
            else:
                for sub, block in zip(subs, event.gpu_block_ids, strict=True):
                    self.expected[block] = self.cpu_expected.get(sub) if result.success else None
        self.forget_free()

    # -- invariants ----------------------------------------------------------------------
    @invariant()
    def blocks_hold_their_bytes(self) -> None:
        if self.engine is None:
            return
        reducers.check_invariants(self.engine.state)
        keep = self.held() | self.store_read()
        checked = self.expected if self.swap_mode else {b: self.expected.get(b) for b in keep}
        for block, data in sorted(checked.items()):
            if data is not None:
                physical = self.engine.resolve(block)
                assert self.executor.read_gpu_block(physical) == data, (
                    f"logical block {block} (physical {physical}) lost its bytes"
                )

    @invariant()
    def finished_stores_hold_their_bytes(self) -> None:
        if self.engine is None:
            return
        f = self.model.config.block_size_factor
        busy = self.cpu_in_flight("store")
        for sub, data in sorted(self.cpu_expected.items()):
            if data is not None and sub // f not in busy:
                assert self.cpu_sub_block(sub) == data, f"CPU sub-block {sub} lost its bytes"

    def cpu_sub_block(self, sub: int) -> bytes:
        """The bytes of one CPU sub-block, gathered over the canonical tensors like a GPU page."""
        f = self.model.config.block_size_factor
        whole = self.executor.read_cpu_block(sub // f)
        out, start = [], 0
        for tensor in self.executor.layout.tensors:
            size = tensor.page_bytes * f
            row = whole[start : start + size]
            k = sub % f
            out.append(row[k * tensor.page_bytes : (k + 1) * tensor.page_bytes])
            start += size
        return b"".join(out)

    def teardown(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.executor.shutdown()


TestEngineOnTensors = EngineOnTensors.TestCase

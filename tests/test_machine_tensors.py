"""The Engine with a real executor on small tensors, as a state machine with canary bytes.

Every block gets fresh canary bytes when it is allocated (or the bytes a load brings); the
machine tracks what each LOGICAL block must hold, independently of the engine, and after
every rule reads each one through ``engine.resolve`` and ``executor.read_gpu_block``. Each
finished store must hold, in its CPU sub-blocks, the bytes its GPU blocks held at submit
time. The fake backend defers every copy until a late, seeded completion and reads the
source only then, so a missing pin (defrag moving a block a transfer has yet to read, or
moving something into a block a load has yet to write) shows up as wrong bytes.

What a block must hold: without prefix caching (``"move"`` swaps) only blocks of live
requests keep their bytes; with prefix caching (``"swap"``) every block does, free ones
included (they may be cached prefixes), which the machine checks too.
"""

from __future__ import annotations

import random
from typing import Any

import msgspec
import torch
from hypothesis import event as note_event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from model import PlainModel
from strategies import (
    draw_allocation,
    draw_load,
    draw_release,
    draw_step,
    draw_store,
    machine_configs,
)

from kvlog import Engine, reducers
from kvlog.events import (
    CacheConfigured,
    Event,
    LoadRequested,
    StoreRequested,
    TransferFinished,
)
from kvlog.executors import make_executor

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


class EngineOnTensors(RuleBasedStateMachine):
    """An Engine with a cpu or fake executor; the model generates and checks the events."""

    def __init__(self) -> None:
        super().__init__()
        self.model = PlainModel()
        self.engine: Any = None
        self.executor: Any = None
        self.expected: dict[int, bytes | None] = {}  # logical GPU block -> its bytes
        self.cpu_expected: dict[int, bytes | None] = {}  # CPU sub-block -> its bytes
        self.jobs: dict[int, tuple[Event, list[bytes | None]]] = {}
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

    def apply(self, event: Event | None) -> bool:
        if event is None:
            return False
        expected = self.model.apply(event)  # generated events are valid: the model agrees
        plans = self.engine.apply(event)
        assert plans == expected, f"{event!r}: engine planned {plans!r}, model {expected!r}"
        for plan in plans:
            note_event(f"plan {type(plan).__name__}")
        return True

    def canary(self) -> bytes:
        self.num_canaries += 1
        return random.Random(self.num_canaries).randbytes(self.page)

    def held(self) -> set[int]:
        return {b for table in self.model.tables.values() for b in table}

    def cpu_in_flight(self, kind: str) -> set[int]:
        return {
            c
            for event, _ in self.jobs.values()
            if (kind == "store") == isinstance(event, StoreRequested)
            for c in event.cpu_block_ids
        }

    def cpu_subs(self, event: StoreRequested | LoadRequested) -> list[int]:
        f = self.model.config.block_size_factor
        subs = [c * f + k for c in event.cpu_block_ids for k in range(f)]
        return (
            subs if isinstance(event, StoreRequested) else subs[(-len(event.gpu_block_ids)) % f :]
        )

    # -- rules ---------------------------------------------------------------------------
    @rule(data=st.data())
    def allocate(self, data: st.DataObject) -> None:
        held, pins = self.held(), self.model.pins()
        event = draw_allocation(data.draw, self.model)
        pinned = {b: pins[self.model.resolve(b)] > 0 for b in event.block_ids}
        load_pins = self.model.pins("load")
        self.apply(event)
        for block in event.block_ids:
            if block in held:
                continue  # a shared prefix block keeps its bytes
            if load_pins[self.model.resolve(block)] > 0:
                self.expected[block] = None  # a load in flight will fill it
            elif pinned[block] or (self.swap_mode and data.draw(st.booleans())):
                continue  # a prefix-cache hit: the block keeps its (cached) bytes
            else:
                self.expected[block] = self.canary()
                self.executor.write_gpu_block(self.engine.resolve(block), self.expected[block])

    @rule(data=st.data(), preempt=st.booleans())
    def release(self, data: st.DataObject, preempt: bool) -> None:
        self.apply(draw_release(data.draw, self.model, preempt))
        if not self.swap_mode:  # "move" swaps do not keep the bytes of free blocks
            held = self.held()
            for block in [b for b in self.expected if b not in held]:
                self.expected[block] = None

    @rule(data=st.data())
    def end_step(self, data: st.DataObject) -> None:
        self.apply(draw_step(data.draw, self.model))

    @rule(data=st.data())
    def store(self, data: st.DataObject) -> None:
        busy = self.cpu_in_flight("store") | self.cpu_in_flight("load")
        pool = [c for c in range(self.model.config.num_cpu_blocks) if c not in busy]
        event = draw_store(data.draw, self.model, cpu_pool=pool)
        if self.apply(event):
            assert event is not None
            self.jobs[event.job_id] = (event, [self.expected.get(b) for b in event.gpu_block_ids])

    @rule(data=st.data())
    def load(self, data: st.DataObject) -> None:
        busy = self.cpu_in_flight("store")
        pool = [c for c in range(self.model.config.num_cpu_blocks) if c not in busy]
        event = draw_load(data.draw, self.model, cpu_pool=pool)
        if self.apply(event):
            assert event is not None
            self.jobs[event.job_id] = (event, [])
            for block in event.gpu_block_ids:
                self.expected[block] = None  # written when the load completes

    @rule(wait=st.sampled_from([False, False, False, True]))
    def poll(self, wait: bool) -> None:
        results = self.engine.wait() if wait else self.engine.poll()
        for result in results:
            assert self.model.apply(TransferFinished(result.job_id, result.success)) == []
            event, captured = self.jobs.pop(result.job_id)
            note_event(f"{type(event).__name__} success={result.success}")
            subs = self.cpu_subs(event)  # type: ignore[arg-type]
            if isinstance(event, StoreRequested):
                for sub, data in zip(subs, captured, strict=True):
                    self.cpu_expected[sub] = data if result.success else None
            else:
                assert isinstance(event, LoadRequested)
                for sub, block in zip(subs, event.gpu_block_ids, strict=True):
                    self.expected[block] = self.cpu_expected.get(sub) if result.success else None

    # -- invariants ----------------------------------------------------------------------
    @invariant()
    def blocks_hold_their_bytes(self) -> None:
        if self.engine is None:
            return
        reducers.check_invariants(self.engine.state)
        checked = (
            self.expected if self.swap_mode else {b: self.expected.get(b) for b in self.held()}
        )
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

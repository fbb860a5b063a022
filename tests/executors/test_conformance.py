"""Conformance suite: every backend present (cpu and fake here, cuda on a GPU) runs it.

After random plans the bytes of every block are where a plain numpy model says; stores then
loads round-trip for every ``block_size_factor`` and skip; the pad block never corrupts a
block; aliased tensors move once; every layout moves the right slots; failures report
``success=False``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvlog.errors import ExecutorError
from kvlog.events import SwapPlan, TransferPlan
from kvlog.executors import Executor, FakeDevice, TransferCompletion, make_executor
from tests.support.executor_helpers import (
    BACKENDS,
    LAYOUT_KINDS,
    BlockModel,
    config_for,
    cpu_sub_blocks,
    load_plan,
    make_kv_caches,
    store_plan,
    tensor_device,
)
from tests.support.strategies import distinct_blocks, swap_plans

NUM_BLOCKS = 20
BLOCK_SIZE = 2
NUM_CPU_BLOCKS = 6


def build(backend: str, kind: str, factor: int = 1, **options: Any) -> Executor:
    kv_caches, layout = make_kv_caches(kind, NUM_BLOCKS, BLOCK_SIZE, tensor_device(backend))
    config = config_for(NUM_BLOCKS, BLOCK_SIZE, NUM_CPU_BLOCKS, factor)
    return make_executor(kv_caches, config, backend=backend, layout=layout, **options)


class _Jobs:
    """Pins of the jobs in flight (what the reducers guarantee) and their plans."""

    def __init__(self, page_size_bytes: int) -> None:
        self.page_size_bytes = page_size_bytes
        self.plans: dict[int, TransferPlan] = {}
        self.kind_of: dict[int, str] = {}
        self.next_id = 1
        self.reported: list[TransferCompletion] = []

    def submit(self, plan: TransferPlan) -> None:
        self.plans[plan.job_id] = plan
        self.kind_of[plan.job_id] = plan.kind

    def gpu_pinned(self) -> set[int]:
        return {
            p[0] if plan.kind == "store" else p[1]
            for plan in self.plans.values()
            for p in plan.pairs
        }

    def cpu_pinned(self, factor: int) -> set[int]:
        subs = {
            p[1] if plan.kind == "store" else p[0]
            for plan in self.plans.values()
            for p in plan.pairs
        }
        return {s // factor for s in subs}

    def after(self, kind: str) -> int:
        return max((j for j, plan in self.plans.items() if plan.kind == kind), default=-1)

    def finish(self, results: list[TransferCompletion]) -> None:
        for result in results:
            assert result.success, result.error
            plan = self.plans.pop(result.job_id)
            assert result.num_bytes == len(plan.pairs) * self.page_size_bytes
        self.reported.extend(results)

    def reported_ids(self, kind: str) -> list[int]:
        return [r.job_id for r in self.reported if self.kind_of[r.job_id] == kind]


def _transfer(data: st.DataObject, jobs: _Jobs, factor: int) -> TransferPlan | None:
    kind = data.draw(st.sampled_from(["store", "load"]))
    cpu_free = [c for c in range(NUM_CPU_BLOCKS) if c not in jobs.cpu_pinned(factor)]
    gpu_free = [b for b in range(NUM_BLOCKS) if b not in jobs.gpu_pinned()]
    cpu_ids = data.draw(distinct_blocks(cpu_free, 2))
    skip = data.draw(st.integers(0, factor - 1)) if kind == "load" else 0
    count = len(cpu_ids) * factor - skip
    if not cpu_ids or count < 1 or count > len(gpu_free):
        return None
    gpu_ids = data.draw(st.permutations(gpu_free))[:count]
    if data.draw(st.booleans()):
        gpu_ids = sorted(gpu_ids)  # runs of consecutive blocks, as vLLM allocates them
    job_id, jobs.next_id = jobs.next_id, jobs.next_id + 1
    after = jobs.after(kind)
    if kind == "store":
        return store_plan(job_id, gpu_ids, cpu_ids, factor, after)
    return load_plan(job_id, cpu_ids, gpu_ids, factor, after)


@pytest.mark.parametrize("kind", LAYOUT_KINDS)
@pytest.mark.parametrize("backend", BACKENDS)
@given(data=st.data())
def test_random_plans_match_the_block_model(backend: str, kind: str, data: st.DataObject) -> None:
    factor = data.draw(st.integers(1, 4), label="factor")
    executor = build(backend, kind, factor, seed=data.draw(st.integers(0, 2**16)))
    model = BlockModel(executor)
    jobs = _Jobs(executor.page_size_bytes)
    for step in range(data.draw(st.integers(1, 10))):
        action = data.draw(st.sampled_from(["swap", "transfer", "transfer", "poll"]))
        if action == "swap":
            plan = data.draw(
                swap_plans(NUM_BLOCKS, exclude=frozenset(jobs.gpu_pinned()), step=step)
            )
            model.apply_swap(plan)
            executor.execute(plan)
        elif action == "transfer" and (transfer := _transfer(data, jobs, factor)) is not None:
            model.apply_transfer(transfer)  # sources and destinations are pinned until done
            jobs.submit(transfer)
            executor.execute(transfer)
        else:
            jobs.finish(executor.poll())
    jobs.finish(executor.wait())
    assert not jobs.plans and executor.jobs_in_flight == []
    for direction in ("store", "load"):
        ids = jobs.reported_ids(direction)
        assert ids == sorted(ids), f"{direction} jobs reported out of submit order: {ids}"
    model.check(executor)
    executor.shutdown()


@pytest.mark.parametrize("factor", [1, 2, 3, 4])
@pytest.mark.parametrize("backend", BACKENDS)
def test_store_then_load_round_trips_every_factor_and_skip(backend: str, factor: int) -> None:
    executor = build(backend, "hpu_fp8_scales", factor)
    original = {b: executor.read_gpu_block(b) for b in range(NUM_BLOCKS)}
    # two CPU blocks: GPU blocks 3, 4, 5 (a run) then 9, 1, ... (scattered)
    gpu_ids = [3, 4, 5, 9, 1, 12, 13, 17][: 2 * factor]
    executor.execute(store_plan(1, gpu_ids, [4, 1], factor))
    assert all(r.success for r in executor.wait([1]))
    assert cpu_sub_blocks(executor, 4) == [original[b] for b in gpu_ids[:factor]]
    assert cpu_sub_blocks(executor, 1) == [original[b] for b in gpu_ids[factor:]]
    zeros = bytes(executor.page_size_bytes)
    for b in gpu_ids:
        executor.write_gpu_block(b, zeros)  # the GPU copies are gone: only the CPU has them
    for skip in range(factor):
        targets = [14, 15, 16, 18, 19, 0, 2, 6][: 2 * factor - skip]
        executor.execute(load_plan(10 + skip, [4, 1], targets, factor, after=-1))
        (result,) = executor.wait([10 + skip])
        assert result.success and result.job_id == 10 + skip
        assert result.num_bytes == len(targets) * executor.page_size_bytes
        for target, source in zip(targets, gpu_ids[skip:], strict=True):
            assert executor.read_gpu_block(target) == original[source], (factor, skip, target)


@pytest.mark.parametrize("mode", ["move", "swap"])
@pytest.mark.parametrize("kind", ["hpu_fp8_scales", "block_major"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_padding_never_corrupts_a_block(backend: str, kind: str, mode: str) -> None:
    executor = build(backend, kind)
    expected_pad = NUM_BLOCKS if kind == "hpu_fp8_scales" else 0
    assert executor.pad_block_id == expected_pad
    rows = executor.layout.num_block_rows
    before = [executor.read_gpu_block(b) for b in range(rows)]
    pairs = [(19, 1), (18, 2), (11, 3)]
    executor.execute(SwapPlan(step=7, pairs=pairs, padded_to=64, mode=mode))
    after = [executor.read_gpu_block(b) for b in range(rows)]
    assert (after[1], after[2], after[3]) == (before[19], before[18], before[11])
    moved = {1, 2, 3} | ({19, 18, 11} if mode == "swap" else set())
    if mode == "swap":
        assert (after[19], after[18], after[11]) == (before[1], before[2], before[3])
    for b in range(rows):
        if b not in moved:
            assert after[b] == before[b], f"block {b} changed (pad block {expected_pad})"


@pytest.mark.parametrize("backend", BACKENDS)
def test_aliased_tensors_move_once(backend: str) -> None:
    kv_caches, layout = make_kv_caches(
        "mla_aliased", NUM_BLOCKS, BLOCK_SIZE, tensor_device(backend)
    )
    latent, other = kv_caches[0][0], kv_caches[3][0]  # type: ignore[index]
    config = config_for(NUM_BLOCKS, BLOCK_SIZE, NUM_CPU_BLOCKS)
    executor = make_executor(kv_caches, config, backend=backend, layout=layout)
    assert len(executor.layout.tensors) == 2  # layers 0, 1 and 2 share latent's bytes
    assert executor.page_size_bytes == 2 * BLOCK_SIZE * 12 * 2
    old_latent, old_other = latent.clone(), other.clone()
    # a swap applied twice would undo itself: block 5 must hold block 9's slots now
    executor.execute(SwapPlan(step=1, pairs=[(9, 5)], padded_to=8, mode="swap"))
    slots = slice(5 * BLOCK_SIZE, 6 * BLOCK_SIZE), slice(9 * BLOCK_SIZE, 10 * BLOCK_SIZE)
    for new, old in ((latent, old_latent), (other, old_other)):
        assert torch.equal(new[slots[0]].view(torch.int16), old[slots[1]].view(torch.int16))
        assert torch.equal(new[slots[1]].view(torch.int16), old[slots[0]].view(torch.int16))
    view = kv_caches[2][0]  # type: ignore[index]
    assert torch.equal(view[5].view(torch.int16), old_latent[slots[1]].view(torch.int16))


def _block_slice(tensor: torch.Tensor, block_id: int) -> torch.Tensor:
    """The bytes of one block in a raw tensor, read the way its layout says."""
    raw = tensor.view(torch.int8)
    if raw.shape[0] == 2 and raw.ndim == 5:  # vLLM (2, num_blocks, ...)
        return raw[:, block_id]
    if raw.shape[0] in (NUM_BLOCKS, NUM_BLOCKS + 1):  # block-major, per-block state/scale
        return raw[block_id]
    return raw[block_id * BLOCK_SIZE : (block_id + 1) * BLOCK_SIZE]  # slot-major


@pytest.mark.parametrize("kind", LAYOUT_KINDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_layout_moves_the_right_slots(backend: str, kind: str) -> None:
    kv_caches, layout = make_kv_caches(kind, NUM_BLOCKS, BLOCK_SIZE, tensor_device(backend), 3)
    tensors = [t for layer in kv_caches for t in (layer if isinstance(layer, tuple) else (layer,))]
    tensors = [t for t in tensors if t is not None]
    executor = make_executor(
        kv_caches, config_for(NUM_BLOCKS, BLOCK_SIZE), backend=backend, layout=layout
    )
    old = [t.clone() for t in tensors]
    executor.execute(SwapPlan(step=1, pairs=[(17, 4), (16, 5), (8, 12)], padded_to=8, mode="move"))
    for new, before in zip(tensors, old, strict=True):
        for src, dst in ((17, 4), (16, 5), (8, 12)):
            assert torch.equal(_block_slice(new, dst), _block_slice(before, src)), (kind, dst)
        for b in (1, 2, 3, 6, 13, 19):
            assert torch.equal(_block_slice(new, b), _block_slice(before, b)), (kind, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_failed_copies_report_success_false_and_never_raise(backend: str) -> None:
    executor = build(backend, "block_major", 2, failure_rate=1.0, seed=5)
    executor.execute(store_plan(1, [1, 2], [0], 2))
    executor.execute(store_plan(2, [3, 4], [1], 2, after=1))
    executor.execute(load_plan(3, [2], [7], 2))
    results = executor.wait()
    assert [r.job_id for r in sorted(results, key=lambda r: r.job_id)] == [1, 2, 3]
    assert all(not r.success and "InjectedFailure" in r.error for r in results)
    assert executor.poll() == [] and executor.jobs_in_flight == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_seeded_failures_leave_successful_jobs_exact(backend: str) -> None:
    executor = build(backend, "vllm", 1, failure_rate=0.5, seed=11)
    original = [executor.read_gpu_block(b) for b in range(NUM_BLOCKS)]
    for job_id in range(NUM_CPU_BLOCKS):
        executor.execute(store_plan(job_id, [job_id + 2], [job_id], 1, after=job_id - 1))
    results = executor.wait()
    assert sorted(r.job_id for r in results) == list(range(NUM_CPU_BLOCKS))
    outcomes = {r.success for r in results}
    assert outcomes == {True, False}, "seed 11 at rate 0.5 should give both outcomes"
    for result in results:
        if result.success:
            assert executor.read_cpu_block(result.job_id) == original[result.job_id + 2]


@pytest.mark.parametrize("backend", BACKENDS)
def test_executor_refuses_misuse(backend: str) -> None:
    executor = build(backend, "block_major", 1)
    with pytest.raises(ExecutorError, match="outside"):
        executor.read_gpu_block(NUM_BLOCKS)  # block-major: no pad block
    with pytest.raises(ExecutorError, match="bytes"):
        executor.write_gpu_block(0, b"short")
    with pytest.raises(ExecutorError, match="outside"):
        executor.read_cpu_block(NUM_CPU_BLOCKS)
    with pytest.raises(ExecutorError, match="unknown plan"):
        executor.execute("not a plan")  # type: ignore[arg-type]
    executor.execute(store_plan(1, [3], [0], 1))
    executor.shutdown()
    assert [r.job_id for r in executor.poll()] == [1]  # shutdown finished it; kept for poll
    with pytest.raises(ExecutorError, match="after shutdown"):
        executor.execute(store_plan(2, [4], [1], 1))


def test_a_device_instance_is_accepted_as_backend() -> None:
    device = FakeDevice(seed=3, max_delay_polls=2)
    kv_caches, _ = make_kv_caches("block_major", NUM_BLOCKS, BLOCK_SIZE, torch.device("cpu"))
    config = config_for(NUM_BLOCKS, BLOCK_SIZE, NUM_CPU_BLOCKS)
    executor = make_executor(kv_caches, config, backend=device, layout="block_major")
    assert executor.device is device and executor.backend == "fake"


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_empty_job_and_an_empty_swap_are_no_ops(backend: str) -> None:
    executor = build(backend, "vllm", 2)
    before = [executor.read_gpu_block(b) for b in range(NUM_BLOCKS)]
    executor.execute(SwapPlan(step=1, pairs=[], padded_to=8, mode="swap"))
    executor.execute(TransferPlan(job_id=4, kind="store", pairs=[], num_bytes=0))
    (result,) = executor.wait([4])
    assert (result.job_id, result.success, result.num_bytes) == (4, True, 0)
    assert [executor.read_gpu_block(b) for b in range(NUM_BLOCKS)] == before


@pytest.mark.parametrize("mode", ["move", "swap"])
def test_a_host_swap_plan_moves_the_same_bytes_in_one_gather_or_in_chunks(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plan that fits one chunk is one gather and one scatter a tensor; a plan larger
    than the scratch bound goes a chunk of pairs at a time: the bytes end the same."""
    from kvlog.executors import swap

    pairs = [(19, 1), (18, 2), (11, 3), (7, 12), (9, 4)]
    ends = []
    for scratch in (swap.SCRATCH_BYTES, 1):  # 1 byte: one row a chunk
        monkeypatch.setattr(swap, "SCRATCH_BYTES", scratch)
        executor = build("cpu", "block_major")
        rows = executor.layout.num_block_rows
        before = [executor.read_gpu_block(b) for b in range(rows)]
        executor.execute(SwapPlan(step=1, pairs=pairs, padded_to=8, mode=mode))
        after = [executor.read_gpu_block(b) for b in range(rows)]
        for src, dst in pairs:
            assert after[dst] == before[src]
            assert mode == "move" or after[src] == before[dst]
        ends.append(after)
    assert ends[0] == ends[1]

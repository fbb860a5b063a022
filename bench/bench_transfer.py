"""CPU transfer executor bandwidth against a plain copy and against the seed's way.

    python bench/bench_transfer.py            # every case (about a minute or two)
    python bench/bench_transfer.py --quick    # three small cases (seconds)
    python bench/bench_transfer.py --backend cuda   # GPU caches, pinned CPU tier (needs CUDA)

For each case (page bytes per tensor, number of tensors, blocks per job, how the GPU
blocks are laid out) and each direction, three ways move the same bytes in the same run:

- ``plain``: one contiguous ``copy_`` per tensor of ``blocks * page`` bytes (the ceiling);
- ``seed``: the seed's ``dst.index_put_((dst_idx,), src.index_select(0, src_idx))`` per
  tensor, index tensors moved per layer (``kv_offload/worker/cpu_hpu.py``);
- ``kvlog``: ``Executor.execute(TransferPlan)`` then ``wait()`` on the chosen backend
  (``cpu`` by default; ``cuda`` puts the caches on the GPU and the CPU tier in pinned memory),
  program compile included.

``vllm`` jobs have GPU blocks in runs of 1..16 consecutive ids (as vLLM allocates them) and
consecutive CPU blocks; ``scattered`` jobs have every GPU block and CPU block at random.
``defrag`` rows time a swap plan (highest used into lowest free, ``"move"``) against the
seed's ``CacheSwapUtils`` (``index_select`` + ``index_copy_`` over slots). The best of
several interleaved repetitions (two for the slow seed way) is reported, as GB/s and as
ratios measured in this run. On ``cuda`` every way ends with ``torch.cuda.synchronize()``,
so each time is the bytes landed, not the copies queued.
Memory stays under about 2 GiB.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvlog.events import CacheConfigured, SwapPlan, TransferPlan
from kvlog.executors import Executor, make_executor

KIB = 1024
SEED_REPS = 2


@dataclass(frozen=True)
class Case:
    page_bytes: int
    num_tensors: int
    num_blocks: int
    pattern: str  # "vllm" or "scattered"


FULL = [
    Case(64 * KIB, 64, 16, "vllm"),
    Case(64 * KIB, 64, 64, "vllm"),
    Case(128 * KIB, 32, 128, "vllm"),
    Case(256 * KIB, 8, 256, "vllm"),
    Case(512 * KIB, 16, 32, "vllm"),
    Case(512 * KIB, 8, 64, "vllm"),
    Case(64 * KIB, 64, 64, "scattered"),
    Case(128 * KIB, 32, 128, "scattered"),
    Case(256 * KIB, 8, 256, "scattered"),
    Case(512 * KIB, 8, 64, "scattered"),
]
QUICK = [
    Case(64 * KIB, 16, 16, "vllm"),
    Case(256 * KIB, 8, 32, "vllm"),
    Case(128 * KIB, 8, 32, "scattered"),
]


def gpu_blocks(case: Case, num_gpu_blocks: int, rng: np.random.Generator) -> list[int]:
    """Block ids of one job: runs of 1..16 consecutive ids (vLLM) or fully scattered."""
    if case.pattern == "scattered":
        return rng.choice(np.arange(1, num_gpu_blocks), case.num_blocks, replace=False).tolist()
    runs: list[list[int]] = []
    next_id, left = 1, case.num_blocks
    while left:
        length = min(left, int(rng.integers(1, 17)))
        runs.append(list(range(next_id, next_id + length)))
        next_id += length + int(rng.integers(1, 3))  # a used block or two between runs
        left -= length
    assert next_id <= num_gpu_blocks, "pool too small for the runs"
    order = rng.permutation(len(runs))
    return [block for i in order.tolist() for block in runs[i]]


def cpu_blocks(case: Case, num_cpu_blocks: int, rng: np.random.Generator) -> list[int]:
    """CPU blocks of one job: consecutive (vLLM) or scattered."""
    if case.pattern == "scattered":
        return rng.choice(num_cpu_blocks, case.num_blocks, replace=False).tolist()
    first = int(rng.integers(0, num_cpu_blocks - case.num_blocks + 1))
    return list(range(first, first + case.num_blocks))


def synchronize() -> None:
    """Wait for queued device work (a no-op on CPU), so a timing covers the bytes landed."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def best_times(ways: dict[str, Callable[[], None]], reps: int) -> dict[str, float]:
    """Interleave the ways, ``reps`` times each after one warm-up; best times in seconds.

    The best of several runs is the least disturbed by other processes on a shared machine.
    """
    times: dict[str, list[float]] = {name: [] for name in ways}
    for run in ways.values():
        run()
    synchronize()
    for rep in range(reps):
        for name, run in ways.items():
            if name == "seed" and rep >= SEED_REPS:
                continue  # the slow way: fewer repetitions keep the run short
            start = time.perf_counter()
            run()
            synchronize()
            times[name].append(time.perf_counter() - start)
    return {name: min(values) for name, values in times.items()}


def bench_case(case: Case, reps: int, rng: np.random.Generator, backend: str) -> list[str]:
    """Store, load and defrag rows of one case; the tensors are freed afterwards."""
    num_gpu = 2 * case.num_blocks + 32
    num_cpu = case.num_blocks + 16
    device = torch.device("cuda" if backend == "cuda" else "cpu")
    caches = [
        torch.ones(num_gpu, case.page_bytes, dtype=torch.int8, device=device)
        for _ in range(case.num_tensors)
    ]
    config = CacheConfigured(num_gpu_blocks=num_gpu, block_size=16, num_cpu_blocks=num_cpu)
    executor = make_executor([(t,) for t in caches], config, backend=backend)
    for cpu_tensor in executor.cpu_tensors:
        cpu_tensor.fill_(2)  # touch every page before timing
    gpu = gpu_blocks(case, num_gpu, rng)
    cpu = cpu_blocks(case, num_cpu, rng)
    store = list(zip(gpu, cpu, strict=True))
    load = list(zip(cpu, gpu, strict=True))
    rows = [
        _transfer_row(case, executor, "store", store, caches, executor.cpu_tensors, reps),
        _transfer_row(case, executor, "load", load, executor.cpu_tensors, caches, reps),
        _defrag_row(case, caches, executor, reps),
    ]
    executor.shutdown()
    return rows


def _transfer_row(
    case: Case,
    executor: Executor,
    kind: Literal["store", "load"],
    pairs: list[tuple[int, int]],
    sources: list[torch.Tensor],
    destinations: list[torch.Tensor],
    reps: int,
) -> str:
    src_index = torch.tensor([s for s, _ in pairs])
    dst_index = torch.tensor([d for _, d in pairs])
    job_ids = itertools.count(len(executor.jobs_in_flight) + 1_000_000 * (kind == "load"))

    def plain() -> None:  # the same bytes, as one contiguous range per tensor
        for src, dst in zip(sources, destinations, strict=True):
            dst[: case.num_blocks].copy_(src[: case.num_blocks])

    def seed() -> None:  # index tensors moved per layer, gather then index_put_
        for src, dst in zip(sources, destinations, strict=True):
            rows = src.index_select(0, src_index.to(src.device))
            dst.index_put_((dst_index.to(dst.device),), rows.to(dst.device))

    def kvlog() -> None:
        job = TransferPlan(job_id=next(job_ids), kind=kind, pairs=pairs, num_bytes=0)
        executor.execute(job)
        (result,) = executor.wait([job.job_id])
        assert result.success, result.error

    return _row(case, kind, best_times({"plain": plain, "seed": seed, "kvlog": kvlog}, reps))


def _defrag_row(case: Case, caches: list[torch.Tensor], executor: Executor, reps: int) -> str:
    """Highest used into lowest free (reversed runs), against the seed's slot-indexed swap."""
    num_gpu = caches[0].shape[0]
    count = min(case.num_blocks, num_gpu // 2 - 1)
    pairs = [(num_gpu - 1 - i, 1 + i) for i in range(count)]
    plan = SwapPlan(step=0, pairs=pairs, padded_to=count, mode="move")
    block_size = 16
    slots = torch.arange(block_size)
    srcs = ((torch.tensor([s for s, _ in pairs]) * block_size).unsqueeze(-1) + slots).flatten()
    dsts = ((torch.tensor([d for _, d in pairs]) * block_size).unsqueeze(-1) + slots).flatten()
    srcs, dsts = srcs.to(caches[0].device), dsts.to(caches[0].device)
    slot_views = [t.view(num_gpu * block_size, -1) for t in caches]

    def seed() -> None:
        for cache in slot_views:
            cache.index_copy_(0, dsts, cache.index_select(0, srcs))

    def plain() -> None:
        for cache in caches:
            cache[1 : 1 + count].copy_(cache[num_gpu - count :])

    def kvlog() -> None:
        executor.execute(plan)

    defrag = Case(case.page_bytes, case.num_tensors, count, case.pattern)
    return _row(defrag, "defrag", best_times({"plain": plain, "seed": seed, "kvlog": kvlog}, reps))


def _row(case: Case, kind: str, seconds: dict[str, float]) -> str:
    num_bytes = case.page_bytes * case.num_tensors * case.num_blocks
    rate = {name: num_bytes / s / 1e9 for name, s in seconds.items()}
    pattern = case.pattern if kind != "defrag" else "reversed"
    size = f"{case.page_bytes // KIB:>5} KiB {case.num_tensors:>3} tensors"
    return (
        f"{size} {case.num_blocks:>4} blocks "
        f"{pattern:<9} {kind:<6} {num_bytes / 2**20:>7.1f} MiB | plain {rate['plain']:6.2f} "
        f"seed {rate['seed']:6.3f} kvlog {rate['kvlog']:6.2f} GB/s | kvlog/plain "
        f"{rate['kvlog'] / rate['plain']:5.2f}x  kvlog/seed {rate['kvlog'] / rate['seed']:6.1f}x"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="three small cases, few repetitions")
    parser.add_argument("--reps", type=int, default=0, help="repetitions per way (default 3/5)")
    parser.add_argument("--backend", choices=["cpu", "cuda"], default="cpu", help="executor")
    args = parser.parse_args(argv)
    cases = QUICK if args.quick else FULL
    reps = args.reps or (3 if args.quick else 5)
    where = torch.cuda.get_device_name() if args.backend == "cuda" else "CPU"
    print(
        f"torch {torch.__version__}, {args.backend} backend on {where}, "
        f"{torch.get_num_threads()} threads, {reps} repetitions"
    )
    rng = np.random.default_rng(0)
    for case in cases:
        for row in bench_case(case, reps, rng, args.backend):
            print(row, flush=True)


if __name__ == "__main__":
    main()

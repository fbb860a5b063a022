"""A transfer job's own cost in kvlog's offloading worker, against moving its bytes plainly.

    python bench/bench_jobs.py            # 3000 timed steps, best of 3 rounds
    python bench/bench_jobs.py --quick    # 600 timed steps, one round
    python bench/bench_jobs.py --jobs 4 --blocks 32   # jobs a step, GPU blocks a job

vLLM's connector worker, as ``KvlogOffloadingConnector`` drives kvlog's
``OffloadingWorker`` every step: the step's jobs declared and submitted in one
``batched()`` block (one ``TransferBatch``: the declarations kept, as
``bind_connector_metadata`` keeps them, and applied with the submissions, as
``start_load_kv`` applies them; ``declare`` times the keeping, ``submit`` the rest), their
completions collected by one ``get_finished`` (one more), with the log at the integration's
default (``background``) and the runner's ``update_state`` + ``defragment`` between steps
(untimed). Stores of ``--blocks`` GPU blocks from live requests' tables into fresh CPU
blocks (specs shaped as vLLM 0.33's: int32 block ids, one KV-cache group, ``Spec``), on
HPU-layout CPU tensors (2 layers, key and value, ``--page-bytes`` a block a tensor: small
by default, so that what is measured is the bookkeeping, not this machine's memory
bandwidth).

The baseline, in the same run on the same tensors: the same jobs' bytes moved with no books
(``plain``: one numpy gather/scatter a tensor a job, the copy any worker must make). Printed:
microseconds a job for each phase, kvlog's whole job, the plain copy, and kvlog's bookkeeping
(the whole job less the plain copy), with the ratio kvlog / plain.

A second baseline, same run: the design's floor (``floor_round``), the operations kvlog's
books need for the same jobs (ids checked, looked up, pinned, the job's digest term, the
two records encoded and checksummed, the plans' pairs, the unpins) written inline with no
layers. kvlog's bookkeeping over the floor is what its layers cost.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvlog.events import StoreRequested, TransferBatch, TransferFinished, TransferSubmitted
from kvlog.integrations import OffloadingWorker, OnlineDefragmenter
from kvlog.util.crc32c import crc32c

BLOCK_SIZE = 16
PHASES = ("declare", "submit", "get_finished")


@dataclass(frozen=True)
class Shape:
    num_gpu_blocks: int = 16384
    jobs: int = 2
    blocks: int = 16
    page_bytes: int = 256
    requests: int = 256

    @property
    def per_request(self) -> int:
        """Blocks in each live request's table (the tables fill half the pool)."""
        return self.num_gpu_blocks // (2 * self.requests)


def make_caches(shape: Shape) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """HPU layout: per layer ``(key, value)`` of ``((num_blocks + 1) * block_size, 1, d)``."""
    d = max(1, shape.page_bytes // (4 * BLOCK_SIZE))
    rows = (shape.num_gpu_blocks + 1) * BLOCK_SIZE

    def tensor() -> torch.Tensor:
        return torch.zeros((rows, 1, d), dtype=torch.float32)

    return [(tensor(), tensor()) for _ in range(2)]


def job_specs(shape: Shape, step: int) -> list[tuple[int, list[int], list[int]]]:
    """The step's jobs: ``(job_id, gpu ids, cpu ids)``, GPU ids from a live request's table."""
    per_request = shape.per_request
    out = []
    for k in range(shape.jobs):
        job_id = step * shape.jobs + k + 1
        first = 1 + (job_id * 7 % shape.requests) * per_request
        gpu = list(range(first, first + min(shape.blocks, per_request)))
        cpu_first = (job_id * shape.blocks) % (shape.num_gpu_blocks - shape.blocks)
        out.append((job_id, gpu, list(range(cpu_first, cpu_first + len(gpu)))))
    return out


class Spec:
    """vLLM 0.33's ``GPULoadStoreSpec`` / ``CPULoadStoreSpec`` as the connector hands them
    over: int32 block ids; a GPU spec's one KV-cache group starts at its request's first
    block (``block_indices``), a CPU spec has no groups."""

    def __init__(self, block_ids: list[int], gpu: bool) -> None:
        self.block_ids = np.array(block_ids, dtype=np.int32)
        self.group_sizes = (len(block_ids),) if gpu else None
        self.block_indices = (0,) if gpu else None


def specs_of(jobs: list[tuple[int, list[int], list[int]]]) -> list[tuple[int, Spec, Spec]]:
    """The jobs as the connector's ``(job_id, src_spec, dst_spec)`` of stores."""
    return [(job_id, Spec(gpu, True), Spec(cpu, False)) for job_id, gpu, cpu in jobs]


def kvlog_round(shape: Shape, steps: int, workdir: str) -> dict[str, float]:
    """Seconds per phase over ``steps`` steps of kvlog's worker."""
    environ = {
        "VLLM_DEFRAG_THRESHOLD": "32",
        "KVLOG_PATH": os.path.join(workdir, f"jobs-{time.monotonic_ns()}.kvlog"),
        "KVLOG_SYNC": "background",
    }
    defrag = OnlineDefragmenter(environ=environ, backend="cpu")
    defrag.initialize(make_caches(shape), BLOCK_SIZE)
    worker = OffloadingWorker(defrag, num_cpu_blocks=shape.num_gpu_blocks, quarantine=True)
    per_request = shape.per_request
    tables = {
        f"r{i}": list(range(1 + i * per_request, 1 + (i + 1) * per_request))
        for i in range(shape.requests)
    }
    defrag.update_state(tables, [])
    defrag.defragment()
    spent = dict.fromkeys(PHASES, 0.0)
    clock = time.perf_counter
    for step in range(steps):
        jobs = specs_of(job_specs(shape, step))
        t0 = clock()
        with worker.batched():  # bind_connector_metadata keeps, start_load_kv applies
            for job_id, src, dst in jobs:
                worker.declare("store", job_id, src, dst, req_id=f"r{job_id % 7}")
            t1 = clock()
            for job_id, src, dst in jobs:
                worker.submit_store(job_id, src, dst)
        t2 = clock()
        worker.get_finished()
        t3 = clock()
        spent["declare"] += t1 - t0
        spent["submit"] += t2 - t1
        spent["get_finished"] += t3 - t2
        defrag.update_state({}, [])
        defrag.defragment()
    worker.shutdown()
    defrag.close()
    return spent


def plain_round(shape: Shape, steps: int) -> float:
    """Seconds to move the same jobs' bytes with numpy alone (a gather/scatter a tensor)."""
    caches = make_caches(shape)
    gpu_rows = [t.view(shape.num_gpu_blocks + 1, -1).numpy() for layer in caches for t in layer]
    cpu_rows = [np.zeros_like(rows[:-1]) for rows in gpu_rows]
    spent = 0.0
    for step in range(steps):
        jobs = job_specs(shape, step)
        t0 = time.perf_counter()
        for _, gpu, cpu in jobs:
            src, dst = np.asarray(gpu, dtype=np.int64), np.asarray(cpu, dtype=np.int64)
            for g, c in zip(gpu_rows, cpu_rows, strict=True):
                c[dst] = g[src]
        spent += time.perf_counter() - t0
    return spent


def step_records(jobs: list[tuple[int, list[int], list[int]]]) -> list[TransferBatch]:
    """The two records kvlog's log holds for a step of ``jobs`` stored: the declarations
    with the submissions, and the finishes (each a ``TransferBatch``)."""
    return [
        TransferBatch(
            events=[
                *(
                    StoreRequested(j, gpu, cpu, (len(gpu),), (0,), deferred=True)
                    for j, gpu, cpu in jobs
                ),
                *(TransferSubmitted(j) for j, _, _ in jobs),
            ]
        ),
        TransferBatch(events=[TransferFinished(j, True) for j, _, _ in jobs]),
    ]


def floor_round(shape: Shape, steps: int) -> float:
    """Seconds for the same jobs' bookkeeping as the design's essential operations alone,
    written inline with no layers (no copy): the floor of kvlog's design in Python.

    Per step, kvlog's two records (``step_records``), each encoded and checksummed: the
    declarations with the submissions (each job's ids checked to be ints in the pool, its
    GPU ids looked up in the forward table, checked against the blocks loads write, pinned
    one by one, its job kept with its term hashed as the running digest hashes it; each
    job's ``(src, dst)`` pairs listed for its plan); the finishes (each job dropped, its blocks
    unpinned). Left out: the engine's lock and observers, the executor's streams and events,
    the session's routing, typed errors' context and the facade's spec handling, which
    kvlog's figure includes."""
    n = shape.num_gpu_blocks
    forward = np.arange(n, dtype=np.int64)
    load_pins = np.zeros(n, dtype=np.int32)
    pins, words = [0] * n, [0] * (n // 64 + 1)
    encoder = msgspec.msgpack.Encoder()
    kept: dict[int, tuple[np.ndarray, list[int], int]] = {}
    spent = 0.0
    for step in range(steps):
        specs = specs_of(job_specs(shape, step))
        t0 = time.perf_counter()
        jobs = [(j, src.block_ids.tolist(), dst.block_ids.tolist()) for j, src, dst in specs]
        requested, finished = step_records(jobs)
        for job_id, gpu, cpu in jobs:
            for i in gpu + cpu:
                if type(i) is not int or not 0 <= i < n:
                    raise ValueError(i)
            physical = forward[gpu]
            if load_pins[physical].any():
                raise ValueError(job_id)
            for p in physical.tolist():
                pins[p] += 1
                words[p >> 6] |= 1 << (p & 63)
            body = encoder.encode([job_id, "store", gpu, cpu, cpu])
            term = int.from_bytes(hashlib.blake2b(body, digest_size=8).digest(), "little")
            kept[job_id] = (physical, cpu, term)
        pairs = [list(zip(kept[j][0].tolist(), kept[j][1], strict=True)) for j, _, _ in jobs]
        crc32c(encoder.encode(requested))
        for job_id, _, _ in jobs:
            for p in kept.pop(job_id)[0].tolist():
                pins[p] -= 1
                if not pins[p]:
                    words[p >> 6] &= ~(1 << (p & 63))
        crc32c(encoder.encode(finished))
        spent += time.perf_counter() - t0
        assert len(pairs) == len(jobs)
    return spent


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="600 steps, one round")
    p.add_argument("--steps", type=int, default=3000, help="timed steps a round")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (best kept)")
    p.add_argument("--jobs", type=int, default=Shape.jobs, help="jobs a step")
    p.add_argument("--blocks", type=int, default=Shape.blocks, help="GPU blocks a job")
    p.add_argument(
        "--page-bytes", type=int, default=Shape.page_bytes, help="bytes a block a tensor"
    )
    p.add_argument("--dir", default=None, help="where the logs go (default: a temp dir)")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.rounds = 600, 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    shape = Shape(jobs=args.jobs, blocks=args.blocks, page_bytes=args.page_bytes)
    steps = args.steps
    print(
        f"bench_jobs: {shape.jobs} store jobs a step of {shape.blocks} blocks, "
        f"{shape.page_bytes} bytes a block a tensor (4 tensors), {steps} steps, "
        f"best of {args.rounds}; log background",
        flush=True,
    )
    best: dict[str, float] = {}
    best_plain = best_floor = float("inf")
    with tempfile.TemporaryDirectory(dir=args.dir) as workdir:
        for _ in range(args.rounds):
            spent = kvlog_round(shape, steps, workdir)
            if not best or sum(spent.values()) < sum(best.values()):
                best = spent
            best_plain = min(best_plain, plain_round(shape, steps))
            best_floor = min(best_floor, floor_round(shape, steps))
    per_job = 1e6 / (steps * shape.jobs)
    whole, plain = sum(best.values()) * per_job, best_plain * per_job
    print("  us a job")
    for phase in PHASES:
        print(f"    kvlog {phase:<22}{best[phase] * per_job:>8.1f}")
    print(f"  kvlog, the whole job            {whole:>8.1f}")
    print(f"  plain copy of its bytes         {plain:>8.1f}")
    print(f"  kvlog's bookkeeping (less copy) {whole - plain:>8.1f}")
    print(f"  kvlog / plain {whole / plain:.1f}x")
    floor = best_floor * per_job
    print(f"  the design's floor, inline      {floor:>8.1f}")
    print(f"  kvlog's bookkeeping / the floor {(whole - plain) / floor:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

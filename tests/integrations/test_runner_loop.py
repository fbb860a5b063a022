"""The facades driven exactly as the HPU model runner and vLLM's offloading connector do.

A small fake scheduler (vLLM's rules: finished requests' blocks are freed at once and may be
handed out in the same step; blocks whose store is in flight are freed only when it ends;
preemption frees everything) feeds the runner's per-step calls on tiny CPU tensors:

    defragmenter.update_state(new | cached, finished_req_ids, preempted_req_ids)
    defragmenter.defragment()
    block_tables = defragmenter.resolve_all(tables)
    ... forward: KV (canary tags) lands at the resolved physical blocks ...
    worker.get_finished(); worker.submit_store(...); worker.submit_load(...)

Every step every live block is checked against its canary, every finished store's CPU
block against the tags of the blocks it stored, and every finished load's GPU blocks against
the CPU block they came from. The fake backend defers copies (late, out of order), so a
missing pin or an unresolved id shows up as corrupt bytes. The recorded log replays to the
same digest at the end.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch

from kvlog.analysis.replay import replay
from kvlog.integrations import OffloadingHandlers, OffloadingWorker, OnlineDefragmenter
from tests.support.seed_reference import block_rows, cache_tensors, make_hpu_caches

NUM_BLOCKS = 40
BLOCK_SIZE = 4
NUM_CPU_BLOCKS = 12


class GPULoadStoreSpec:
    """The documented shape of vLLM's ``GPULoadStoreSpec`` (one KV cache group)."""

    def __init__(self, block_ids: list[int]) -> None:
        self.block_ids = np.array(block_ids, dtype=np.int64)
        self.group_sizes = (len(block_ids),)
        self.block_indices = (0,)

    @staticmethod
    def medium() -> str:
        return "GPU"


class CPULoadStoreSpec:
    """The documented shape of vLLM's ``CPULoadStoreSpec``."""

    def __init__(self, block_ids: list[int]) -> None:
        self.block_ids = np.array(block_ids, dtype=np.int64)

    @staticmethod
    def medium() -> str:
        return "CPU"


@dataclass
class Request:
    req_id: str
    blocks: list[int] = field(default_factory=list)  # logical ids
    tags: list[int] = field(default_factory=list)  # canary per block
    loading_job: int = -1


@dataclass
class Job:
    kind: str
    gpu_blocks: list[int]  # logical, as submitted
    cpu_blocks: list[int]
    tags: list[int]  # stores: the tags stored; loads: the tags loaded
    req_id: str = ""


class Offload:
    """The worker facade in one of its two shapes (new worker, or the older handler pair)."""

    def __init__(self, defrag: OnlineDefragmenter, factor: int, shape: str) -> None:
        self.shape = shape
        if shape == "worker":
            self.worker = OffloadingWorker(defrag, NUM_CPU_BLOCKS, factor)
        else:
            self.handlers = OffloadingHandlers(defrag, NUM_CPU_BLOCKS, factor)

    def store(self, job_id: int, gpu: list[int], cpu: list[int]) -> None:
        src, dst = GPULoadStoreSpec(gpu), CPULoadStoreSpec(cpu)
        if self.shape == "worker":
            assert self.worker.submit_store(job_id, src, dst)
        else:
            assert self.handlers.gpu_to_cpu_handler.transfer_async(job_id, (src, dst))

    def load(self, job_id: int, cpu: list[int], gpu: list[int]) -> None:
        src, dst = CPULoadStoreSpec(cpu), GPULoadStoreSpec(gpu)
        if self.shape == "worker":
            assert self.worker.submit_load(job_id, src, dst)
        else:
            assert self.handlers.cpu_to_gpu_handler.transfer_async(job_id, (src, dst))

    def finished(self) -> list[tuple[int, bool]]:
        if self.shape == "worker":
            results = self.worker.get_finished()
        else:
            results = self.handlers.gpu_to_cpu_handler.get_finished()
            results += self.handlers.cpu_to_gpu_handler.get_finished()
        return [(r.job_id, r.success) for r in results]

    def wait(self, job_ids: set[int]) -> None:
        if self.shape == "worker":
            self.worker.wait(job_ids)
        else:
            self.handlers.cpu_to_gpu_handler.wait(job_ids)


class Simulation:
    """A fake vLLM scheduler + HPU model runner + offloading connector around the facades."""

    def __init__(self, seed: int, prefix_caching: bool, factor: int, shape: str, log: Path) -> None:
        self.rng = random.Random(seed)
        self.factor = factor
        self.kv_caches = make_hpu_caches(NUM_BLOCKS, BLOCK_SIZE)
        self.defrag = OnlineDefragmenter(
            prefix_caching=prefix_caching,
            environ={"VLLM_DEFRAG_THRESHOLD": "4", "KVLOG_PATH": str(log), "KVLOG_SYNC": "none"},
            backend="fake",
            executor_options={"seed": seed},
        )
        self.defrag.initialize(self.kv_caches, BLOCK_SIZE)
        self.offload = Offload(self.defrag, factor, shape)
        self.defrag.warmup()
        self.gpu_rows = [_words(block_rows(t, BLOCK_SIZE)) for t in cache_tensors(self.kv_caches)]
        self.free: deque[int] = deque(range(1, NUM_BLOCKS))  # vLLM never hands out block 0
        self.running: dict[str, Request] = {}
        self.preempted: list[str] = []  # waiting to resume with a fresh table
        self.loading: dict[str, Request] = {}  # blocks allocated, load in flight or done
        self.ready: list[str] = []  # load done, not scheduled yet
        self.jobs: dict[int, Job] = {}
        self.cpu_tags: dict[int, list[int]] = {}  # CPU block -> the tags it holds
        self.delayed_free: dict[int, list[int]] = {}  # store job -> blocks freed at its end
        self.reported_finished: list[str] = []
        self.counts = {"stores": 0, "loads": 0, "swapped": 0, "preempted": 0, "claims": 0}
        self.next_job = self.next_req = 0
        self.next_tag = 1
        self.fresh: list[tuple[str, int]] = []  # (request, block index) the forward writes
        self.resumed: list[str] = []

    # -- the scheduler -------------------------------------------------------------------
    def tag(self) -> int:
        self.next_tag += 1
        return self.next_tag

    def take(self, n: int) -> list[int] | None:
        if len(self.free) < n:
            return None
        return [self.free.popleft() for _ in range(n)]

    def release(self, blocks: list[int]) -> None:
        """Free blocks; those an unfinished store reads stay allocated until it ends."""
        reading = {
            b: j for j, job in self.jobs.items() if job.kind == "store" for b in job.gpu_blocks
        }
        for b in reversed(blocks):
            if b in reading:
                self.delayed_free.setdefault(reading[b], []).append(b)
            else:
                self.free.append(b)

    def allocate(self, new_blocks: dict[str, list[int]], req: Request, n: int) -> bool:
        """Append ``n`` fresh blocks (new tags, written by the next forward) to ``req``."""
        got = self.take(n)
        if got is None:
            return False
        new_blocks[req.req_id] = new_blocks.get(req.req_id, []) + got
        self.fresh.extend((req.req_id, len(req.blocks) + i) for i in range(n))
        req.blocks.extend(got)
        req.tags.extend(self.tag() for _ in got)
        return True

    def schedule(self) -> tuple[dict[str, list[int]], list[str], list[str]]:
        """One scheduler step: (new | cached blocks, finished, preempted)."""
        finished, self.reported_finished = self.reported_finished, []
        preempted = [r for r in self.running if self.rng.random() < 0.01]
        for req_id in preempted:
            self.release(self.running.pop(req_id).blocks)
            self.preempted.append(req_id)
        self.counts["preempted"] += len(preempted)
        new_blocks: dict[str, list[int]] = {}
        self.fresh = []
        self.resumed = []
        for req in self.running.values():
            if self.rng.random() < 0.3:
                self.allocate(new_blocks, req, 1)
        if self.rng.random() < 0.5:
            self.next_req += 1
            req = Request(f"req-{self.next_req}")
            if self.allocate(new_blocks, req, self.rng.randint(1, 4)):
                self.running[req.req_id] = req
        if self.preempted and self.rng.random() < 0.3:
            req = Request(self.preempted[0])  # resumed: a fresh table, KV recomputed
            if self.allocate(new_blocks, req, 2):
                self.running[self.preempted.pop(0)] = req
                self.resumed.append(req.req_id)
        if self.ready and self.rng.random() < 0.5:
            req = self.loading[self.ready[0]]
            new_blocks[req.req_id] = list(req.blocks)  # the loaded blocks, first seen now
            if self.allocate(new_blocks, req, 1):
                self.running[req.req_id] = self.loading.pop(self.ready.pop(0))
                self.counts["claims"] += 1
            else:
                del new_blocks[req.req_id]
        return new_blocks, finished, preempted

    def finish_some(self) -> None:
        """Requests finish at the end of a step; the runner hears of it next step."""
        for req_id in [r for r in self.running if self.rng.random() < 0.08]:
            self.release(self.running.pop(req_id).blocks)
            self.reported_finished.append(req_id)

    # -- the runner ----------------------------------------------------------------------
    def step(self, report_preemptions: bool) -> None:
        new_blocks, finished, preempted = self.schedule()
        # vLLM's output names the requests preempted in this step and those resumed from a
        # preemption; a runner that passes only the resumed ones (or none) still works,
        # because the facade releases a silent preemptee when its blocks are handed out.
        told = preempted if report_preemptions else self.resumed
        self.defrag.update_state(new_blocks, finished, told)
        self.defrag.defragment()
        if self.defrag.last_swap is not None:
            self.counts["swapped"] += len(self.defrag.last_swap.pairs)
        reqs = list(self.running.values())
        tables = self.defrag.resolve_all([r.blocks for r in reqs])
        assert tables == [[self.defrag.resolve(b) for b in r.blocks] for r in reqs]
        self.forward(reqs, tables)
        self.check_live(reqs, tables)
        self.connector()
        self.collect(self.offload.finished())
        self.finish_some()

    def forward(self, reqs: list[Request], tables: list[list[int]]) -> None:
        """New blocks get their KV; each running request's last block gets a new token."""
        where = {r.req_id: t for r, t in zip(reqs, tables, strict=True)}
        writes = [(where[req_id][i], self.running[req_id], i) for req_id, i in self.fresh]
        for req, table in zip(reqs, tables, strict=True):
            if self.rng.random() < 0.5:
                req.tags[-1] = self.tag()
                writes.append((table[-1], req, len(req.blocks) - 1))
        if writes:
            physical = np.array([w[0] for w in writes])
            tags = np.array([w[1].tags[w[2]] for w in writes], dtype=np.uint64)
            for rows in self.gpu_rows:
                rows[physical] = tags[:, None]

    def check_live(self, reqs: list[Request], tables: list[list[int]]) -> None:
        expected = np.zeros(NUM_BLOCKS + 1, dtype=np.uint64)
        for req, table in zip(reqs, tables, strict=True):
            expected[table] = req.tags
        self.check_gpu(expected)

    def check_gpu(self, expected: np.ndarray) -> None:
        """Every physical block with an expected tag holds exactly that tag, in every tensor."""
        live = np.flatnonzero(expected)
        for rows in self.gpu_rows:
            bad = live[~(rows[live] == expected[live, None]).all(axis=1)]
            assert not bad.size, f"physical blocks {bad.tolist()} lost their KV"

    # -- the offloading connector --------------------------------------------------------
    def idle_cpu_blocks(self) -> list[int]:
        """CPU blocks that no unfinished job reads or writes (vLLM's manager ensures it)."""
        busy = {c for job in self.jobs.values() for c in job.cpu_blocks}
        return [c for c in range(NUM_CPU_BLOCKS) if c not in busy]

    def connector(self) -> None:
        loadable = [c for c in self.idle_cpu_blocks() if c in self.cpu_tags]
        if loadable and self.rng.random() < 0.15:
            self.submit_load(self.rng.sample(loadable, min(len(loadable), 2)))
        idle = self.idle_cpu_blocks()
        storable = [c for c in idle if c not in self.cpu_tags or self.rng.random() < 0.3]
        if storable and self.rng.random() < 0.4:
            self.submit_store(self.rng.choice(storable))

    def submit_load(self, cpu: list[int]) -> None:
        gpu = self.take(len(cpu) * self.factor)
        if gpu is None:
            return
        self.next_req += 1
        tags = [t for c in cpu for t in self.cpu_tags[c]]
        req = Request(f"req-{self.next_req}", blocks=gpu, tags=tags)
        self.next_job += 1
        self.loading[req.req_id] = req
        self.jobs[self.next_job] = Job("load", gpu, cpu, tags, req.req_id)
        self.offload.load(self.next_job, cpu, gpu)
        self.counts["loads"] += 1

    def submit_store(self, cpu_block: int) -> None:
        reading = {b for job in self.jobs.values() if job.kind == "store" for b in job.gpu_blocks}
        n = self.factor
        for req in self.rng.sample(list(self.running.values()), len(self.running)):
            starts = [
                i for i in range(len(req.blocks) - n) if not reading & set(req.blocks[i : i + n])
            ]
            if starts:
                i = self.rng.choice(starts)
                self.next_job += 1
                gpu, tags = req.blocks[i : i + n], req.tags[i : i + n]
                self.jobs[self.next_job] = Job("store", gpu, [cpu_block], tags)
                self.offload.store(self.next_job, gpu, [cpu_block])
                self.counts["stores"] += 1
                return

    def collect(self, finished: list[tuple[int, bool]]) -> None:
        """Check what each finished job moved; free what it held."""
        executor = self.defrag.engine.executor
        cpu_rows = [
            _words(t).reshape(NUM_CPU_BLOCKS, self.factor, -1) for t in executor.cpu_tensors
        ]
        for job_id, success in finished:
            job = self.jobs.pop(job_id)
            assert success, f"job {job_id} failed"
            if job.kind == "store":
                (c,) = job.cpu_blocks
                for rows in cpu_rows:
                    assert (rows[c] == np.array(job.tags, np.uint64)[:, None]).all(), (
                        f"store {job_id} wrote the wrong bytes into CPU block {c}"
                    )
                self.cpu_tags[c] = job.tags
                self.free.extend(self.delayed_free.pop(job_id, []))
            else:
                expected = np.zeros(NUM_BLOCKS + 1, dtype=np.uint64)
                expected[[self.defrag.resolve(b) for b in job.gpu_blocks]] = job.tags
                self.check_gpu(expected)
                self.ready.append(job.req_id)

    def drain(self) -> None:
        self.offload.wait(set(self.jobs))
        self.collect(self.offload.finished())
        assert not self.jobs


def _words(rows: torch.Tensor) -> np.ndarray:
    """A uint64 numpy view (shared memory) of int8 rows."""
    return rows.numpy().view(np.uint64)


@pytest.mark.parametrize(
    ("prefix_caching", "factor", "shape", "num_steps", "report_preemptions"),
    [
        (False, 1, "worker", 2000, True),
        (True, 1, "handlers", 800, True),
        (False, 2, "handlers", 800, False),
        (True, 2, "worker", 600, False),
    ],
    ids=["move-worker", "swap-handlers", "move-factor2-silent-preempt", "swap-factor2"],
)
def test_runner_loop_keeps_every_byte(
    tmp_path: Path,
    prefix_caching: bool,
    factor: int,
    shape: str,
    num_steps: int,
    report_preemptions: bool,
) -> None:
    log = tmp_path / "server.kvlog"
    sim = Simulation(7, prefix_caching, factor, shape, log)
    for _ in range(num_steps):
        sim.step(report_preemptions)
    sim.drain()
    digest = sim.defrag.engine.digest()
    sim.defrag.close()
    counts = sim.counts
    assert counts["swapped"] > 50 and counts["stores"] > 50 and counts["loads"] > 10, counts
    assert counts["claims"] > 5 and counts["preempted"] > 3, counts
    result = replay(log, verify=True)
    assert result.ok, result.divergence
    assert result.final_digest == digest

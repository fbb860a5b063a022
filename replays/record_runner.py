"""Record a golden log of the runner's path: vllm-gaudi's calls on the defragmenter facade
(one whole step a scheduler step) and vLLM's connector calls on the offloading worker (a
step's declarations, submissions and completions, each a ``TransferBatch``).

    python replays/record_runner.py OUT.kvlog       # record (never over an existing file)

A seeded, scripted serving loop on a 96-block pool of 4-token blocks, prefix caching off,
defrag threshold 2, a 48-block CPU tier, 300 steps (the facade's checkpoints: every 256 steps
and at close): requests arrive with 2
to 5 blocks, grow by a block every few steps and finish; one in three starts with a sync
load of its first blocks from the CPU tier, and a request's blocks are stored to the CPU tier
(declared in one step, submitted in the next) once they are full, so stores are in flight
when requests finish and defrag runs around pinned blocks. The log holds what the Engine of
the kvlog that records it writes for these calls; ``regenerate.py`` then records what it
replays to. See README.md for which log came from which kvlog.
"""

from __future__ import annotations

import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the repository root: tests.support helpers

from kvlog.integrations import OffloadingWorker, OnlineDefragmenter  # noqa: E402
from tests.support.seed_reference import make_hpu_caches  # noqa: E402

BLOCKS, BLOCK_SIZE, CPU_BLOCKS, STEPS = 96, 4, 48, 300


class Loop:
    """The scripted scheduler: which blocks each request holds, which CPU blocks are busy."""

    def __init__(self, path: str) -> None:
        env = {
            "VLLM_DEFRAG_THRESHOLD": "2",
            "KVLOG_PATH": path,
            "KVLOG_SYNC": "none",
        }
        self.defrag = OnlineDefragmenter(environ=env, backend="cpu")
        self.defrag.initialize(make_hpu_caches(BLOCKS, BLOCK_SIZE), BLOCK_SIZE)
        self.worker = OffloadingWorker(self.defrag, num_cpu_blocks=CPU_BLOCKS, quarantine=True)
        self.rng = random.Random(7)
        self.free = list(range(1, BLOCKS))
        self.live: dict[str, list[int]] = {}
        self.age: dict[str, int] = {}
        self.job_id = 0
        self.next_cpu = 0
        self.busy_cpu: dict[int, list[int]] = {}  # job -> its CPU blocks
        self.stored: set[str] = set()
        self.stores: list[tuple[int, list[int], list[int]]] = []  # declared, not submitted

    def cpu_blocks(self, n: int) -> list[int] | None:
        busy = {c for blocks in self.busy_cpu.values() for c in blocks}
        picked: list[int] = []
        for k in range(CPU_BLOCKS):
            c = (self.next_cpu + k) % CPU_BLOCKS
            if c not in busy:
                picked.append(c)
                if len(picked) == n:
                    self.next_cpu = (c + 1) % CPU_BLOCKS
                    return picked
        return None

    def step(self, step: int) -> None:
        rng, live = self.rng, self.live
        finished = [r for r in sorted(live) if self.age[r] > rng.randint(6, 14)]
        for r in finished:
            self.free += live.pop(r)
            del self.age[r]
        new: dict[str, list[int]] = {}
        loads: list[tuple[str, list[int]]] = []
        if len(self.free) > 12 and rng.random() < 0.6:
            r = f"req-{step}"
            blocks = [
                self.free.pop(rng.randrange(len(self.free))) for _ in range(rng.randint(2, 5))
            ]
            new[r] = blocks
            if rng.random() < 0.35:
                loads.append((r, blocks[:2]))
        for r in sorted(live):
            if self.free and rng.random() < 0.3:
                new[r] = [self.free.pop(0)]
        for r, blocks in new.items():
            live.setdefault(r, []).extend(blocks)
            self.age.setdefault(r, 0)
        for r in live:
            self.age[r] += 1
        self.defrag.update_state(new, finished)
        self.defrag.defragment()
        self.connector_step(loads)

    def connector_step(self, loads: list[tuple[str, list[int]]]) -> None:
        worker = self.worker
        declared: list[tuple[int, list[int], list[int]]] = []
        stores: list[tuple[int, list[int], list[int]]] = []
        with worker.batched():  # bind_connector_metadata: the step's declarations
            for r, gpu in loads:
                cpu = self.cpu_blocks(len(gpu))
                if cpu is not None:
                    self.job_id += 1
                    worker.declare("load", self.job_id, cpu, gpu, req_id=r, sync=True)
                    self.busy_cpu[self.job_id] = cpu
                    declared.append((self.job_id, cpu, gpu))
            for r in sorted(self.live):
                if r not in self.stored and self.age[r] == 3:
                    gpu, cpu = self.live[r][:3], self.cpu_blocks(min(3, len(self.live[r])))
                    if cpu is not None:
                        self.job_id += 1
                        worker.declare("store", self.job_id, gpu, cpu, req_id=r)
                        self.busy_cpu[self.job_id] = cpu
                        self.stored.add(r)
                        stores.append((self.job_id, gpu, cpu))
        with worker.batched():  # start_load_kv: last step's stores, this step's loads
            for job_id, gpu, cpu in self.stores:
                worker.submit_store(job_id, gpu, cpu)
            self.stores = stores
            for job_id, cpu, gpu in declared:
                worker.submit_load(job_id, cpu, gpu)
        for result in worker.get_finished():
            self.busy_cpu.pop(result.job_id, None)

    def close(self) -> None:
        self.worker.shutdown()
        for result in self.worker.get_finished():
            self.busy_cpu.pop(result.job_id, None)
        self.defrag.close()


def main(argv: list[str]) -> int:
    if len(argv) != 1 or os.path.exists(argv[0]):
        print(__doc__.splitlines()[2].strip(), file=sys.stderr)
        return 2
    loop = Loop(argv[0])
    for step in range(STEPS):
        loop.step(step)
    loop.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Per-step cost of the vLLM Gaudi facade, with and without its log, next to the seed.

    python bench/bench_facade.py            # 1000 timed steps per variant, best of 3 rounds
    python bench/bench_facade.py --quick    # 300 timed steps, one pass
    python bench/bench_facade.py --blocks 4096   # one pool size (default: 4096 and 32768)
    python bench/bench_facade.py --backend cuda  # the KV tensors on the GPU (needs CUDA)
    python bench/bench_facade.py --layers 80     # a large model's 160 KV tensors (default 2)
    python bench/bench_facade.py --prefix-caching   # defrag swaps blocks both ways

One pre-generated runner trace per pool size (untimed): 4096 or 32768 blocks on tiny
HPU-layout CPU tensors (``--layers``, 2 by default, a key and a value tensor each; block_size
16), ~80% full; every step 0-2 requests arrive (4-64 blocks), 8 live requests grow by one
block, random requests finish
while the pool is more than 80% used; block ids come from a FIFO free list like vLLM's. A
timed step is exactly what the HPU model runner does per step::

    update_state(new | cached, finished); defragment(); resolve_all(block tables)

on every variant, with the same KV tensors (swaps really run):

- ``seed``: the plain restatement of the seed ``OnlineDefragmenter`` + ``CacheSwapUtils``
  (``tests/support/seed_reference.py``): the baseline;
- ``kvlog, no log``: the facade's Engine with no log;
- ``kvlog, log sync=background``: the integration's default (``KVLOG_SYNC``): the serving
  thread hands each step to the OS, a flusher thread fdatasyncs with a bounded lag;
- ``kvlog, log sync=none``: the log written, fsync only at close;
- ``kvlog, log sync=step``: an fsync at every step, on the serving thread (group commit).

Printed: mean and p99 microseconds per step, the ratio to the seed and to the facade without
a log, and the log's bytes per step. The fsync figure depends on the disk under the temp dir.

With ``--backend cuda`` the KV tensors live on the GPU, the seed builds its swap indices there
(as the plugin does on the HPU) and kvlog's facade runs its CUDA executor. A step is then
timed until its swaps have landed (``torch.cuda.synchronize()`` inside the clock): the
forward that follows reads those blocks. The host's share alone (the clock stopped before
the synchronize) is printed beside it.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "support")
)

import torch
from seed_reference import SeedDefragmenter, make_hpu_caches

from kvlog.integrations import OnlineDefragmenter
from kvlog.log import SYNC_MODES

NUM_BLOCKS = 4096
BLOCK_SIZE = 16
THRESHOLD = 32


@dataclass
class Step:
    new_blocks: dict[str, list[int]]
    finished: list[str]
    tables: list[list[int]]


def runner_steps(
    num_blocks: int, seed: int = 0
) -> Iterator[tuple[dict[str, list[int]], list[str], dict[str, list[int]]]]:
    """The runner's trace, endless: ``(new_blocks, finished, live tables)`` per step (the
    live tables are the generator's own dict: copy what you keep). A FIFO free list like
    vLLM's; every step 8 live requests grow by one block and 0-2 requests arrive (4-8
    while the pool fills), random requests finish while it is more than 80% used."""
    rng = random.Random(seed)
    free: deque[int] = deque(range(1, num_blocks))
    live: dict[str, list[int]] = {}
    serial = 0
    fill = int(0.8 * num_blocks)
    while True:
        new: dict[str, list[int]] = {}
        finished = []
        while num_blocks - len(free) > fill and live:
            req_id = rng.choice(sorted(live))
            free.extend(live.pop(req_id))
            finished.append(req_id)
        for req_id in rng.sample(sorted(live), min(8, len(live))):
            if free:
                block = free.popleft()
                live[req_id].append(block)
                new[req_id] = [block]
        filling = num_blocks - len(free) < fill
        for _ in range(rng.randint(4, 8) if filling else rng.randint(0, 2)):
            n = rng.randint(4, 64)
            if len(free) > n:
                serial += 1
                req_id = f"req-{serial}"
                live[req_id] = [free.popleft() for _ in range(n)]
                new[req_id] = list(live[req_id])
        yield new, finished, live


def make_trace(
    num_steps: int, seed: int = 0, num_blocks: int = NUM_BLOCKS
) -> tuple[list[Step], list[Step]]:
    """(warm-up steps that fill the pool, timed steps), from :func:`runner_steps`."""
    fill = int(0.8 * num_blocks)
    steps: list[Step] = []
    num_warm = -1
    used = 1  # block 0 is never handed out
    for new, finished, live in runner_steps(num_blocks, seed):
        if num_warm < 0 and used >= fill:
            num_warm = len(steps)
        if num_warm >= 0 and len(steps) >= num_warm + num_steps:
            break
        steps.append(Step(new, finished, [list(t) for t in live.values()]))
        used = 1 + sum(map(len, live.values()))
    return steps[:num_warm], steps[num_warm:]


Runner = Callable[[Step], None]
Make = Callable[[], tuple[Runner, Callable[[], None]]]
"""Builds a variant's runner and the call that closes it."""


def seed_runner(
    threshold: int, num_blocks: int, backend: str = "cpu", layers: int = 2, pc: bool = False
) -> tuple[Runner, Callable[[], None]]:
    defrag = SeedDefragmenter(threshold=threshold, prefix_caching=pc)
    caches = make_hpu_caches(num_blocks, BLOCK_SIZE, num_layers=layers, device=backend)
    defrag.initialize(caches, BLOCK_SIZE)

    def step(s: Step) -> None:
        defrag.update_state(s.new_blocks, s.finished)
        defrag.defragment()
        defrag.resolve_all(s.tables)

    return step, lambda: None


def facade_runner(
    threshold: int,
    num_blocks: int,
    log_path: str | None,
    sync: str,
    backend: str = "cpu",
    layers: int = 2,
    pc: bool = False,
) -> tuple[Runner, Callable[[], None]]:
    env = {"VLLM_DEFRAG_THRESHOLD": str(threshold), "KVLOG_SYNC": sync}
    if log_path is not None:
        env["KVLOG_PATH"] = log_path
    defrag = OnlineDefragmenter(environ=env, backend=backend, prefix_caching=pc)  # type: ignore[arg-type]
    caches = make_hpu_caches(num_blocks, BLOCK_SIZE, num_layers=layers, device=backend)
    defrag.initialize(caches, BLOCK_SIZE)

    def step(s: Step) -> None:
        defrag.update_state(s.new_blocks, s.finished)
        defrag.defragment()
        defrag.resolve_all(s.tables)

    return step, defrag.close


def measure(
    make: Make,
    warm: list[Step],
    timed: list[Step],
    synchronize: Callable[[], None] | None = None,
) -> tuple[list[float], list[float]]:
    """Seconds per timed step: until its swaps landed (``synchronize`` inside the clock,
    where given), and the host's calls alone."""
    step, close = make()
    for s in warm:
        step(s)
    if synchronize is not None:
        synchronize()
    times, host = [], []
    gc.collect()
    for s in timed:
        start = time.perf_counter()
        step(s)
        called = time.perf_counter()
        if synchronize is not None:
            synchronize()
        times.append(time.perf_counter() - start)
        host.append(called - start)
    close()
    return times, host


def p99(values: list[float]) -> float:
    return sorted(values)[min(len(values) - 1, int(0.99 * len(values)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="300 steps, one pass")
    parser.add_argument(
        "--blocks", default="4096,32768", help="pool sizes, comma-separated (default 4096,32768)"
    )
    parser.add_argument(
        "--backend", choices=["cpu", "cuda"], default="cpu", help="where the KV tensors live"
    )
    parser.add_argument(
        "--layers", type=int, default=2, help="model layers, a key and a value tensor each"
    )
    parser.add_argument(
        "--prefix-caching",
        action="store_true",
        help="both sides as with prefix caching: defrag swaps blocks both ways (else moves)",
    )
    args = parser.parse_args()
    if args.backend == "cuda" and not torch.cuda.is_available():
        parser.error("--backend cuda needs a CUDA device")
    num_steps, repeats = (300, 1) if args.quick else (1000, 3)
    if args.backend == "cuda":
        print(
            f"KV tensors on {torch.cuda.get_device_name()}; a step is timed until its swaps landed"
        )
    for num_blocks in (int(n) for n in args.blocks.split(",")):
        warm, timed = make_trace(num_steps, num_blocks=num_blocks)
        gc.collect()
        gc.freeze()  # the pre-built trace is no garbage for either side to scan
        for threshold in (THRESHOLD, num_blocks):
            what = "defrag fires" if threshold == THRESHOLD else "defrag idle (never fires)"
            print(f"\n{num_blocks} blocks, threshold {threshold} ({what}):")
            run_variants(
                threshold, num_blocks, warm, timed, repeats, args.backend, args.layers,
                args.prefix_caching,
            )  # fmt: skip
        gc.unfreeze()


def variants_of(
    threshold: int, num_blocks: int, backend: str, layers: int = 2, pc: bool = False
) -> list[tuple[str, Make, str | None]]:
    """(name, how to build its runner, its log path) per variant, the seed first."""
    tmp = tempfile.mkdtemp(prefix="kvlog-bench-facade-")
    variants: list[tuple[str, Make, str | None]] = [
        ("seed (baseline)", lambda: seed_runner(threshold, num_blocks, backend, layers, pc), None),
        (
            "kvlog, no log",
            lambda: facade_runner(threshold, num_blocks, None, "none", backend, layers, pc),
            None,
        ),
    ]
    for sync in [m for m in ("background", "none", "step") if m in SYNC_MODES]:
        path = os.path.join(tmp, f"{sync}.kvlog")

        def make(path: str = path, sync: str = sync) -> tuple[Runner, Callable[[], None]]:
            return facade_runner(threshold, num_blocks, path, sync, backend, layers, pc)

        variants.append((f"kvlog, log sync={sync}", make, path))
    return variants


def run_variants(
    threshold: int,
    num_blocks: int,
    warm: list[Step],
    timed: list[Step],
    repeats: int,
    backend: str = "cpu",
    layers: int = 2,
    pc: bool = False,
) -> None:
    """Every variant once per round (rounds interleave them against machine noise)."""
    variants = variants_of(threshold, num_blocks, backend, layers, pc)
    synchronize = torch.cuda.synchronize if backend == "cuda" else None
    runs: dict[str, list[tuple[list[float], list[float]]]] = {name: [] for name, _, _ in variants}
    log_bytes: dict[str, int] = {}
    for _ in range(repeats):
        for name, make, path in variants:
            if path is not None and os.path.exists(path):
                os.remove(path)
            runs[name].append(measure(make, warm, timed, synchronize))
            if path is not None:
                log_bytes[name] = os.path.getsize(path)
    results = {name: min(r, key=lambda run: statistics.fmean(run[0])) for name, r in runs.items()}
    report(results, log_bytes, len(warm) + len(timed), len(timed), backend == "cuda")


def report(
    results: dict[str, tuple[list[float], list[float]]],
    log_bytes: dict[str, int],
    total_steps: int,
    num_steps: int,
    with_host: bool = False,
) -> None:
    seed = statistics.fmean(results["seed (baseline)"][0])
    bare = statistics.fmean(results["kvlog, no log"][0])
    warmup = total_steps - num_steps
    print(f"{num_steps} timed steps (after {warmup} warm-up steps)")
    host_head = f" {'host us':>9} {'host vs seed':>12}" if with_host else ""
    print(
        f"{'variant':26} {'mean us':>9} {'median':>9} {'p99 us':>9} {'vs seed':>8} "
        f"{'vs no log':>10} B/step{host_head}"
    )
    seed_host = statistics.fmean(results["seed (baseline)"][1])
    for name, (times, host) in results.items():
        mean = statistics.fmean(times)
        per_step = log_bytes.get(name, 0) / total_steps
        host_cells = ""
        if with_host:
            host_mean = statistics.fmean(host)
            host_cells = f" {host_mean * 1e6:9.1f} {host_mean / seed_host:12.2f}"
        print(
            f"{name:26} {mean * 1e6:9.1f} {statistics.median(times) * 1e6:9.1f} "
            f"{p99(times) * 1e6:9.1f} {mean / seed:8.2f} {mean / bare:10.2f} {per_step:6.0f}"
            f"{host_cells}"
        )


if __name__ == "__main__":
    main()

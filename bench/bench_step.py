"""Per-step cost of the whole Engine step with its log on, next to the seed, from 4k to 1M blocks.

    python bench/bench_step.py            # 4200 timed steps per size (a snapshot included)
    python bench/bench_step.py --quick    # 600 timed steps, 32k blocks and the 4k/1M pair only
    python bench/bench_step.py --trace heavy   # the heavy trace only (2000 steps, --quick 600)
    python bench/bench_step.py --split         # where the heavy 32k step's time goes

A step is what the scheduler hands kvlog per step on a FIFO-pool trace with defrag firing:
finishes while the pool is above 80% full, 0-2 arrivals of 4-64 blocks, 8 live requests
growing by one block, then ``StepEnded`` (defrag at the seed's default threshold, 32). Each
step goes through ``Engine.apply`` with a log (``sync="none"``; ``"step"``, one fsync per step,
is printed beside it), default checkpoint and snapshot cadence, so checkpoints and snapshots
are inside the figures.

The baseline, measured in the same run on the same steps, is the seed's bookkeeping and
``defragment()`` as the plugin ships it (``tests/support/seed_reference.py`` without KV tensors: its
``update_state`` per scheduler input, then a ``max()`` and two ``sorted()`` over every used
block each step, one for the used side and one inside its free-block generator; the tensor
swap is device work and left out, as kvlog's plans are not executed here). Beside it, the
cheaper restatement the differential tests use (``tests/support/seed_model.py``: one sort, a
membership test for the free side). Both sides' pairs are checked equal to kvlog's.

Every size and side runs once per round, rounds repeated (``--repeat``) and the best of each
kept, so that a slow spell of this shared machine hits every size and both sides alike.
Printed: kvlog's mean us per step and per event, the seed's, their ratio, and kvlog's
per-event cost at each size over the smallest size's.

The heavy trace (``HeavyTrace``, first unless ``--trace fifo``) is what a busy server
hands over: 400-512 running requests, 32 of them growing a block each step, arrivals
refilling them, random finishes: defrag fires on most steps. It is generated in an id space
of 4,096 and of 32,768 blocks and each is applied, as one ``StepScheduled`` a step, to a
pool of its own size and to a 1M pool (the same block ids, a larger pool); the seed as
shipped runs the same steps. Printed: the ratio to the seed at 32k and the 1M pool's cost
over the 4k pool's.

``--split`` times the heavy 32k trace's steps again (the seed as shipped beside them, same
run) with a clock around each of the pieces a step cannot do without in this design (``SPLIT``:
the check's and the commit's compiled kernels, the ids read in, the new requests' keys, the
``SwapPlan``'s pairs as the plan's public tuples, the step's log form and its append) and
prints each piece's share of the step, the rest (the Python between them: validation, the
reducers' dispatch and per-request rows, the Engine, its figures), and the ratio to the seed
that a step made of those pieces alone would reach: what no trim of the Python between
them can pass. The clocks add a Python call and two clock reads a piece a step (under a
microsecond each), some of it inside the pieces' figures.
"""

from __future__ import annotations

import argparse
import array
import collections
import contextlib
import gc
import importlib
import itertools
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))

from seed_model import SeedDefragmenter as SeedModel
from seed_reference import SeedDefragmenter as SeedShipped

from kvlog import Engine
from kvlog.events import (
    BlocksAllocated,
    CacheConfigured,
    Event,
    RequestFinished,
    StepEnded,
    StepScheduled,
    SwapPlan,
)

SIZES = (4096, 32768, 131072, 1 << 20)
SEED_SIZES = (4096, 32768, 131072)
ARRIVALS, GROWTHS, TARGET, THRESHOLD = (0, 0, 1, 1, 2), 8, 0.8, 32


class Run(NamedTuple):
    """One side's run: mean and median us per step, and the swap pairs of each step (as
    ``packed``: bytes, which the garbage collector does not track)."""

    mean_us: float
    median_us: float
    pairs: list[bytes]


HAND_OVER = True
"""Whether each step's events are handed over fresh, untimed, just before the step is
timed (``--prebuilt`` turns it off)."""


def handed_over(event: Event) -> Event:
    """``event`` as a runner hands it over: new containers built from the scheduler's
    ids just now (the ids and request names are the same objects, touched while copied),
    not ones built hundreds of steps earlier, whose memory a large pool's step has long
    evicted from the caches."""
    if type(event) is StepScheduled:
        return StepScheduled(
            step=event.step,
            allocated={req_id: list(ids) for req_id, ids in event.allocated.items()},
            finished=list(event.finished),
            preempted=list(event.preempted),
            resumed=list(event.resumed),
        )
    if type(event) is BlocksAllocated:
        return BlocksAllocated(req_id=event.req_id, block_ids=list(event.block_ids))
    return event


def packed(pairs: list[tuple[int, int]]) -> bytes:
    """A step's pairs as int64 bytes: kept for the comparison of the sides without
    keeping a tuple per pair alive, whose collection the next steps would be timed with."""
    return array.array("q", itertools.chain.from_iterable(pairs)).tobytes()


def timed(
    steps: list[list[Event]],
    apply: Callable[[Event], list[Any]],
    pairs_of: Callable[[list[Any]], list[tuple[int, int]]],
) -> Run:
    """Each step's events through ``apply``, each step timed alone (its events handed
    over just before, untimed: ``handed_over``)."""
    clock, times, pairs = time.perf_counter_ns, [], []
    for events in steps:
        if HAND_OVER:
            events = [handed_over(event) for event in events]
        t0 = clock()
        out = [item for event in events for item in apply(event)]
        times.append(clock() - t0)
        pairs.append(packed(pairs_of(out)))
    return Run(sum(times) / 1e3 / len(steps), statistics.median(times) / 1e3, pairs)


class Trace:
    """The simulated scheduler: a FIFO free list (like vLLM's), live tables, seeded."""

    def __init__(self, num_gpu_blocks: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.num_gpu_blocks = num_gpu_blocks
        self.free = collections.deque(range(1, num_gpu_blocks))
        self.tables: dict[str, list[int]] = {}
        self.live: list[str] = []
        self.next_req = 0
        self.used = 0

    def _take(self, req_id: str, k: int) -> BlocksAllocated:
        blocks = [self.free.popleft() for _ in range(k)]
        self.tables.setdefault(req_id, []).extend(blocks)
        self.used += k
        return BlocksAllocated(req_id=req_id, block_ids=blocks)

    def _arrive(self) -> BlocksAllocated:
        req_id = f"req-{self.next_req}"
        self.next_req += 1
        self.live.append(req_id)
        return self._take(req_id, self.rng.randint(4, 64))

    def _finish(self) -> RequestFinished:
        i = self.rng.randrange(len(self.live))
        self.live[i], self.live[-1] = self.live[-1], self.live[i]
        req_id = self.live.pop()
        blocks = self.tables.pop(req_id)
        self.free.extend(blocks)
        self.used -= len(blocks)
        return RequestFinished(req_id=req_id)

    def warm_up(self) -> list[Event]:
        events: list[Event] = []
        while self.used < TARGET * self.num_gpu_blocks:
            events.append(self._arrive())
        return events

    def step(self, step: int) -> list[Event]:
        events: list[Event] = []
        while self.used > TARGET * self.num_gpu_blocks - max(ARRIVALS) * 64:
            events.append(self._finish())
        events.extend(self._arrive() for _ in range(self.rng.choice(ARRIVALS)))
        for _ in range(GROWTHS):
            events.append(self._take(self.rng.choice(self.live), 1))
        events.append(StepEnded(step=step))
        return events


class HeavyTrace(Trace):
    """The heavy trace: hundreds of running requests (up to ``live``, 512 by default: about
    400 in 4,096 ids, 500 in 32,768) in a pool of ``num_ids`` block ids kept about 80% full,
    ``growths`` of them (32: a block every 16 decode steps of 512 requests) growing by one
    block a step, up to 16 arrivals a step of about ``0.8 * num_ids / live`` blocks (half
    to 1.5 times that) refilling ``live``, random requests finishing to make room: holes
    every step, so defrag fires on most steps. The ids stay below ``num_ids`` whatever pool
    the trace is applied to."""

    def __init__(self, num_ids: int, seed: int, live: int = 512, growths: int = 32) -> None:
        super().__init__(num_ids, seed)
        self.live_target, self.growths = live, growths
        self.mean_blocks = max(2, int(TARGET * num_ids / live))

    def _arrive(self) -> BlocksAllocated:
        req_id = f"req-{self.next_req}"
        self.next_req += 1
        self.live.append(req_id)
        k = self.rng.randint(max(1, self.mean_blocks // 2), self.mean_blocks * 3 // 2)
        return self._take(req_id, k)

    def step(self, step: int) -> list[Event]:
        events: list[Event] = []
        headroom = self.growths + 16 * (self.mean_blocks * 3 // 2)
        while self.used > TARGET * self.num_gpu_blocks - headroom:
            events.append(self._finish())
        if self.live and self.rng.random() < 0.5:  # a request ends on its own
            events.append(self._finish())
        arrivals = 0
        while len(self.live) < self.live_target and arrivals < 16:
            events.append(self._arrive())
            arrivals += 1
        for _ in range(self.growths):
            events.append(self._take(self.rng.choice(self.live), 1))
        events.append(StepEnded(step=step))
        return events


def model_apply(seed: SeedModel, event: Event) -> list[tuple[int, int]]:
    """One event on the restated seed; the pairs of its ``defragment()`` at ``StepEnded``."""
    if isinstance(event, BlocksAllocated):
        seed.allocate(event.req_id, event.block_ids)
    elif isinstance(event, RequestFinished):
        seed.release(event.req_id)
    elif isinstance(event, StepEnded):
        return seed.defragment()
    return []


def shipped_apply(seed: SeedShipped, event: Event) -> list[tuple[int, int]]:
    """One event on the seed as shipped: ``update_state`` per input, ``defragment()``."""
    if isinstance(event, BlocksAllocated):
        seed.update_state({event.req_id: event.block_ids}, ())
    elif isinstance(event, RequestFinished):
        seed.update_state({}, (event.req_id,))
    elif isinstance(event, StepEnded):
        return seed.defragment()
    return []


def seed_run(size: int, warm: list[Event], steps: list[list[Event]], shipped: bool = True) -> Run:
    """The seed's mean us per step and its pairs per step: as shipped, or the restatement."""
    seed: SeedShipped | SeedModel
    if shipped:
        seed, apply = SeedShipped(threshold=THRESHOLD), shipped_apply
    else:
        seed, apply = SeedModel(threshold=THRESHOLD), model_apply
    for event in warm:
        apply(seed, event)  # type: ignore[arg-type]
    return timed(steps, lambda event: apply(seed, event), list)  # type: ignore[arg-type]


def as_steps(steps: list[list[Event]]) -> list[list[Event]]:
    """Each step's events as the one ``StepScheduled`` the runner's path applies: its
    finishes, then every request's new blocks in order (a request growing twice in a step
    gets one list), ending the step."""
    out: list[list[Event]] = []
    for events in steps:
        allocated: dict[str, list[int]] = {}
        finished = []
        step = -1
        for event in events:
            if isinstance(event, RequestFinished):
                finished.append(event.req_id)
            elif isinstance(event, BlocksAllocated):
                allocated.setdefault(event.req_id, []).extend(event.block_ids)
            elif isinstance(event, StepEnded):
                step = event.step
        out.append([StepScheduled(step=step, allocated=allocated, finished=finished)])
    return out


def swap_pairs(plans: list[Any]) -> list[tuple[int, int]]:
    return [pair for plan in plans if type(plan) is SwapPlan for pair in plan.pairs]


def kvlog_run(
    size: int,
    warm: list[Event],
    steps: list[list[Event]],
    sync: str,
    directory: str,
    spent: collections.Counter[str] | None = None,
) -> Run:
    """kvlog's mean us per step (log on, default checkpoints), and its pairs per step.
    ``spent``: the ``SPLIT`` pieces' ns over the timed steps add to it (``clocked``)."""
    config = CacheConfigured(num_gpu_blocks=size, block_size=16, threshold=THRESHOLD)
    path = os.path.join(directory, f"{size}-{sync}-{len(steps)}.kvlog")
    pieces = contextlib.nullcontext() if spent is None else clocked(spent)
    with pieces:  # clocked before the Engine binds its log's append
        engine = Engine(config, log_path=path, sync=sync)  # type: ignore[arg-type]
        for event in warm:
            engine.apply(event)
        engine.checkpoint()  # untimed: the warm-up's own checkpoint (hashes what it built)
        if spent is not None:
            spent.clear()
        run = timed(steps, engine.apply, swap_pairs)
    engine.close()
    os.unlink(path)
    return run


def measure(
    sizes: tuple[int, ...], num_steps: int, repeat: int, directory: str
) -> tuple[dict[int, dict[str, Run]], dict[int, float]]:
    """Per size, the best run of each side (rounds of every size and side, repeated), and
    the mean events per step."""
    traces = {}
    for size in sizes:
        trace = Trace(size, seed=size)
        traces[size] = (trace.warm_up(), [trace.step(s) for s in range(num_steps)])
    whole = {size: as_steps(traces[size][1]) for size in sizes}
    gc.collect()
    gc.freeze()  # the pre-built traces are no garbage to scan, on either side
    best: dict[int, dict[str, Run]] = {size: {} for size in sizes}
    sides: list[tuple[str, Callable[[int, list[Event], list[list[Event]]], Run]]] = [
        ("kvlog", lambda n, w, s: kvlog_run(n, w, s, "none", directory)),
        ("whole", lambda n, w, s: kvlog_run(n, w, whole[n], "none", directory)),
        ("shipped", lambda n, w, s: seed_run(n, w, s, shipped=True)),
        ("model", lambda n, w, s: seed_run(n, w, s, shipped=False)),
    ]
    for _ in range(repeat):
        for size in sizes:
            warm, steps = traces[size]
            for name, run in sides:
                if name in ("shipped", "model") and size not in SEED_SIZES:
                    continue
                got = run(size, warm, steps)
                if name not in best[size] or got.mean_us < best[size][name].mean_us:
                    best[size][name] = got
    for size in sizes:
        warm, steps = traces[size]
        best[size]["step"] = kvlog_run(size, warm, steps, "step", directory)
        pairs = [run.pairs for run in best[size].values()]
        assert all(p == pairs[0] for p in pairs), f"kvlog and the seed disagree at {size}"
    gc.unfreeze()
    events = {size: sum(map(len, traces[size][1])) / num_steps for size in sizes}
    return best, events


def results_table(
    sizes: tuple[int, ...],
    best: dict[int, dict[str, Run]],
    events: dict[int, float],
    num_steps: int,
) -> Table:
    """One row per size: kvlog's mean and median step, per event, with fsync per step, and
    each seed side's mean step and its ratio to kvlog's mean."""
    table = Table(title="us per step (kvlog: Engine.apply, log on); seed/kvlog in the same run")
    for column in (
        "blocks", "events/step", "defrag%", "kvlog sync none mean", "median", "us/event",
        "kvlog sync step", "StepScheduled mean", "median", "seed as shipped", "shipped/kvlog",
        "shipped/StepScheduled", "seed restated", "restated/kvlog",
    ):  # fmt: skip
        table.add_column(column, justify="right")
    for size in sizes:
        runs = best[size]
        ours = runs["kvlog"]
        fired = 100 * sum(bool(p) for p in ours.pairs) / num_steps
        whole = runs["whole"]
        seeds = []
        for name in ("shipped", "model"):
            if name not in runs:
                seeds += ["-", "-"] + (["-"] if name == "shipped" else [])
                continue
            seed_us = runs[name].mean_us
            seeds += [f"{seed_us:.0f}", f"{seed_us / ours.mean_us:.1f}x"]
            if name == "shipped":
                seeds.append(f"{seed_us / whole.mean_us:.1f}x")
        table.add_row(
            str(size), f"{events[size]:.1f}", f"{fired:.1f}", f"{ours.mean_us:.1f}",
            f"{ours.median_us:.1f}", f"{ours.mean_us / events[size]:.2f}",
            f"{runs['step'].mean_us:.1f}", f"{whole.mean_us:.1f}", f"{whole.median_us:.1f}",
            *seeds,
        )  # fmt: skip
    return table


HEAVY_TRACES = (4096, 32768)
"""The heavy trace's id spaces: each is applied to a pool of its own size and to a 1M pool
(the same block ids, a larger pool)."""
BIG_POOL = 1 << 20


def measure_heavy(
    num_steps: int, repeat: int, directory: str, traces_of: tuple[int, ...] = HEAVY_TRACES
) -> dict[int, dict[str, Run]]:
    """Per heavy trace (by its id space): the best of ``repeat`` rounds of the runner's
    path (one ``StepScheduled`` a step, log on) in a pool of the trace's size (``own``) and
    in a 1M pool (``big``), and of the seed as shipped on the same steps."""
    traces = {}
    for ids in traces_of:
        trace = HeavyTrace(ids, seed=ids + 1)
        warm, steps = trace.warm_up(), [trace.step(s) for s in range(num_steps)]
        traces[ids] = (warm, steps, as_steps(steps))
    gc.collect()
    gc.freeze()
    best: dict[int, dict[str, Run]] = {ids: {} for ids in traces_of}
    for _ in range(repeat):
        for ids, (warm, steps, whole) in traces.items():
            for name in ("own", "big", "shipped"):
                if name == "shipped":
                    got = seed_run(ids, warm, steps, shipped=True)
                else:
                    pool = ids if name == "own" else BIG_POOL
                    got = kvlog_run(pool, warm, whole, "none", directory)
                if name not in best[ids] or got.mean_us < best[ids][name].mean_us:
                    best[ids][name] = got
    gc.unfreeze()
    for ids in traces_of:
        pairs = [run.pairs for run in best[ids].values()]
        assert all(p == pairs[0] for p in pairs), f"kvlog and the seed disagree ({ids} ids)"
    return best


def heavy_table(best: dict[int, dict[str, Run]], num_steps: int) -> Table:
    table = Table(
        title="heavy trace: us per step, StepScheduled (Engine.apply, log on) and the seed "
        "as shipped, same steps, same run"
    )
    for column in (
        "trace ids", "defrag%", "StepScheduled mean", "median", "seed as shipped mean",
        "median", "shipped/StepScheduled mean", "median", "1M pool mean", "median",
        "1M/own (mean)", "1M/own (median)",
    ):  # fmt: skip
        table.add_column(column, justify="right")
    for ids, runs in best.items():
        own, big, seed = runs["own"], runs["big"], runs["shipped"]
        fired = 100 * sum(bool(p) for p in own.pairs) / num_steps
        table.add_row(
            str(ids), f"{fired:.0f}", f"{own.mean_us:.1f}", f"{own.median_us:.1f}",
            f"{seed.mean_us:.0f}", f"{seed.median_us:.0f}", f"{seed.mean_us / own.mean_us:.1f}x",
            f"{seed.median_us / own.median_us:.1f}x", f"{big.mean_us:.1f}",
            f"{big.median_us:.1f}", f"{big.mean_us / own.mean_us:.2f}x",
            f"{big.median_us / own.median_us:.2f}x",
        )  # fmt: skip
    return table


def heavy_main(num_steps: int, repeat: int) -> int:
    print(
        f"heavy trace: {num_steps} steps per trace, best of {repeat} rounds, log on, "
        "default checkpoints, events handed over fresh per step"
    )
    with tempfile.TemporaryDirectory() as directory:
        best = measure_heavy(num_steps, repeat, directory)
    Console(width=180).print(heavy_table(best, num_steps))
    small, large = best[min(best)], best[max(best)]
    print(
        f"heavy, StepScheduled at {max(best)} ids: "
        f"{large['shipped'].mean_us / large['own'].mean_us:.1f}x the seed as shipped (mean), "
        f"{large['shipped'].median_us / large['own'].median_us:.1f}x (median) "
        f"(target >= 100x); 1M pool over a {min(best)} pool, same ids: "
        f"{small['big'].mean_us / small['own'].mean_us:.2f}x mean, "
        f"{small['big'].median_us / small['own'].median_us:.2f}x median (target <= 1.3x)"
    )
    return 0


SPLIT: tuple[tuple[str, str, str], ...] = (
    ("kvlog.reducers.kernels", "step_commit", "the commit's kernel (refs, tables, walk, move)"),
    ("kvlog.reducers.kernels", "step_allocation", "the check's kernel"),
    ("kvlog.events.validate", "int_lists", "the ids read in (msgspec encode, compiled read)"),
    ("kvlog.reducers.running", "keys_into", "the new requests' keys (blake2b, compiled)"),
    ("kvlog.reducers.defrag", "end_step_moved", "the SwapPlan (its pairs as tuples)"),
    ("kvlog.reducers.step", "packed_step", "the step's log form (StepPacked)"),
    ("kvlog.log.writer", "LogWriter.append", "the record's append (encode, CRC, buffer)"),
)  # fmt: skip
"""The pieces ``--split`` times: (module, attribute where the step's path looks it up,
label). None calls another of them."""


@contextlib.contextmanager
def clocked(spent: collections.Counter[str]) -> Iterator[None]:
    """Within the block, the time of every call of each ``SPLIT`` piece adds to
    ``spent[label]`` (ns); the originals are back on the way out."""
    saved: list[tuple[Any, str, Any]] = []
    clock = time.perf_counter_ns

    def timer(original: Callable[..., Any], label: str) -> Callable[..., Any]:
        def timed_call(*args: Any, **kwargs: Any) -> Any:
            t0 = clock()
            try:
                return original(*args, **kwargs)
            finally:
                spent[label] += clock() - t0

        return timed_call

    try:
        for module_name, name, label in SPLIT:
            owner: Any = importlib.import_module(module_name)
            if "." in name:
                class_name, name = name.split(".")
                owner = getattr(owner, class_name)
            original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
            saved.append((owner, name, original))
            setattr(owner, name, timer(original, label))
        yield
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)


def split_run(
    size: int, warm: list[Event], steps: list[list[Event]], directory: str
) -> tuple[Run, dict[str, float]]:
    """``kvlog_run`` (``sync="none"``) with the ``SPLIT`` pieces clocked over the timed
    steps: the run, and each piece's mean us a step."""
    spent: collections.Counter[str] = collections.Counter()
    run = kvlog_run(size, warm, steps, "none", directory, spent)
    return run, {label: spent[label] / 1e3 / len(steps) for _, _, label in SPLIT}


def split_main(num_steps: int, repeat: int) -> int:
    """The heavy 32k trace: each piece's share of kvlog's step (the best of ``repeat``
    rounds, by mean), and the seed as shipped on the same steps."""
    ids = max(HEAVY_TRACES)
    trace = HeavyTrace(ids, seed=ids + 1)
    warm, steps = trace.warm_up(), [trace.step(s) for s in range(num_steps)]
    whole = as_steps(steps)
    gc.collect()
    gc.freeze()
    seed = seed_run(ids, warm, steps, shipped=True)
    best: tuple[Run, dict[str, float]] | None = None
    with tempfile.TemporaryDirectory() as directory:
        for _ in range(repeat):
            got = split_run(ids, warm, whole, directory)
            if best is None or got[0].mean_us < best[0].mean_us:
                best = got
    gc.unfreeze()
    assert best is not None and best[0].pairs == seed.pairs, "kvlog and the seed disagree"
    run, pieces = best
    table = Table(title=f"heavy trace, {ids} ids: where kvlog's StepScheduled step goes (mean)")
    for column in ("piece", "us a step", "share"):
        table.add_column(column, justify="right" if column != "piece" else "left")
    for label, us in pieces.items():
        table.add_row(label, f"{us:.1f}", f"{100 * us / run.mean_us:.0f}%")
    floor = sum(pieces.values())
    rest = run.mean_us - floor
    table.add_row(
        "the rest: the Python between them", f"{rest:.1f}", f"{100 * rest / run.mean_us:.0f}%"
    )
    table.add_row("the step (Engine.apply)", f"{run.mean_us:.1f}", "100%")
    Console(width=120).print(table)
    print(
        f"heavy {ids}: the seed as shipped {seed.mean_us:.0f} us a step, kvlog "
        f"{run.mean_us:.1f} ({seed.mean_us / run.mean_us:.1f}x); its pieces alone "
        f"{floor:.1f} us: with nothing between them {seed.mean_us / floor:.1f}x the seed "
        "(target >= 100x)"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="600 steps; 4k, 32k and 1M")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per size")
    parser.add_argument("--repeat", type=int, default=3, help="rounds (best kept per side)")
    parser.add_argument(
        "--prebuilt",
        action="store_true",
        help="time the events as built before the run (cold in a large pool's caches), "
        "not handed over fresh per step",
    )
    parser.add_argument(
        "--trace",
        choices=("fifo", "heavy", "both"),
        default="both",
        help="the FIFO-pool trace (per pool size), the heavy trace (hundreds of running "
        "requests, defrag most steps), or both",
    )
    parser.add_argument(
        "--split",
        action="store_true",
        help="the heavy 32k trace only: each piece of kvlog's step timed (SPLIT), the rest, "
        "and the ratio to the seed its pieces alone would reach",
    )
    args = parser.parse_args(argv)
    global HAND_OVER
    HAND_OVER = not args.prebuilt
    num_steps = args.steps or (600 if args.quick else 4200)
    sizes = (4096, 32768, 1 << 20) if args.quick else SIZES
    if args.split:
        return split_main(args.steps or (600 if args.quick else 2000), args.repeat)
    handed = "prebuilt events" if args.prebuilt else "events handed over fresh per step"
    print(
        f"{num_steps} steps per size, best of {args.repeat} rounds, log on, default "
        f"checkpoints, {handed}"
    )
    if args.trace in ("heavy", "both"):
        heavy_main(args.steps or (600 if args.quick else 2000), args.repeat)
        if args.trace == "heavy":
            return 0
    with tempfile.TemporaryDirectory() as directory:
        best, events = measure(sizes, num_steps, args.repeat, directory)
    Console(width=180).print(results_table(sizes, best, events, num_steps))
    for label, field in (("mean", "mean_us"), ("median", "median_us")):
        per_event = {size: getattr(best[size]["kvlog"], field) / events[size] for size in sizes}
        small = min(per_event)
        ratios = ", ".join(
            f"{size}: {per_event[size] / per_event[small]:.2f}x" for size in sorted(per_event)
        )
        print(f"kvlog per-event cost ({label} step) over {small} blocks': {ratios}")
        per_step = {size: getattr(best[size]["whole"], field) for size in sizes}
        ratios = ", ".join(
            f"{size}: {per_step[size] / per_step[small]:.2f}x" for size in sorted(per_step)
        )
        print(f"StepScheduled per-step cost ({label}) over {small} blocks': {ratios}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

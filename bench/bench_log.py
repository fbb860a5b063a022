"""Benchmark the durable log: append and read throughput on a realistic record mix.

    python bench/bench_log.py            # 200k records, best of 3 (about a minute)
    python bench/bench_log.py --quick    # 20k records, one pass (seconds)

The mix is a serving loop's: steps of 8-20 records, mostly ``BlocksAllocated`` with 1-16
ids, then ``RequestFinished``, store/load requests with their ``TransferFinished``, rare
large allocations (a long prompt's prefill, 512-2048 ids), a ``Checkpoint`` every 256
records and a ``StepEnded`` per step. Each kvlog figure is printed with its ratio to a
baseline measured in the same run on the same records: a bare length-prefixed msgpack
file through Python's buffered I/O (no sequence numbers, no checksums, no recovery), with
the same fsync points. The fsync-bound modes (``sync="step"``, and ``"always"``: an fsync per
record, to show what group commit saves) run on the first records only; ``"background"``
writes once per step and leaves the fsyncs to its flusher thread (its baseline: a bare file
flushed at each step). MB/s counts the log file's bytes (framing included). Then the cost
on the serving thread: each append timed alone, step-ending appends (where the group is
written, and fsynced with ``step``) apart from the others, mean and percentiles in us.
"""

from __future__ import annotations

import argparse
import os
import random
import struct
import sys
import tempfile
import time
from collections.abc import Callable

from kvlog.events import (
    BlocksAllocated,
    CacheConfigured,
    Checkpoint,
    LoadRequested,
    Record,
    RequestFinished,
    RequestPreempted,
    StepEnded,
    StoreRequested,
    TransferFinished,
    decode,
    encode,
)
from kvlog.log import LogReader, LogWriter, read_log

_LENGTH = struct.Struct("<I")


def _one_step(rng: random.Random, step: int, next_job: list[int]) -> list[Record]:
    records: list[Record] = []
    for _ in range(rng.randint(8, 20) - 1):
        roll = rng.random()
        req_id = f"cmpl-{rng.randrange(1 << 32):08x}-0"
        if roll < 0.62:
            records.append(BlocksAllocated(req_id, rng.sample(range(8192), rng.randint(1, 16))))
        elif roll < 0.80:
            records.append(RequestFinished(req_id))
        elif roll < 0.81:
            records.append(RequestPreempted(req_id))
        elif roll < 0.905:
            job_id, ids = next_job[0], rng.sample(range(8192), rng.randint(1, 8))
            next_job[0] += 1
            kind = StoreRequested if rng.random() < 0.7 else LoadRequested
            records.append(kind(job_id, ids, ids))
        elif roll < 0.995:
            records.append(TransferFinished(max(0, next_job[0] - 1), rng.random() < 0.99))
        else:
            records.append(BlocksAllocated(req_id, rng.sample(range(8192), rng.randint(512, 2048))))
    records.append(StepEnded(step))
    return records


def make_records(count: int, seed: int = 0) -> list[Record]:
    """``count`` records of the serving mix (deterministic for a seed)."""
    rng = random.Random(seed)
    records: list[Record] = [CacheConfigured(num_gpu_blocks=8192, block_size=128)]
    step, next_job = 0, [0]
    while len(records) < count:
        for record in _one_step(rng, step, next_job):
            records.append(record)
            if len(records) % 256 == 0:
                records.append(Checkpoint(seq=len(records) - 1, digest="5e" * 32, step=step))
        step += 1
    return records[:count]


def _kvlog_append(path: str, records: list[Record], sync: str) -> Callable[[], None]:
    """Create the log (not timed: an atomic creation costs a few fsyncs once); return
    the timed part: every append, then close."""
    if os.path.exists(path):
        os.unlink(path)
    writer = LogWriter(path, sync)  # type: ignore[arg-type]

    def run() -> None:
        for record in records:
            writer.append(record)
        writer.close()

    return run


def _baseline_append(path: str, records: list[Record], sync: str) -> Callable[[], None]:
    file = open(path, "wb")  # noqa: SIM115 (closed by run)

    def run() -> None:
        for record in records:
            payload = encode(record)
            file.write(_LENGTH.pack(len(payload)))
            file.write(payload)
            if sync == "always" or (sync == "step" and type(record) is StepEnded):
                file.flush()
                os.fdatasync(file.fileno())
            elif sync == "background" and type(record) is StepEnded:
                file.flush()
        file.flush()
        os.fdatasync(file.fileno())
        file.close()

    return run


def _baseline_read(path: str) -> int:
    count = 0
    with open(path, "rb") as file:
        while header := file.read(4):
            (length,) = _LENGTH.unpack(header)
            decode(file.read(length))
            count += 1
    return count


def _best_pair_s(
    repeat: int,
    make_run: Callable[[], Callable[[], object]],
    make_baseline: Callable[[], Callable[[], object]],
) -> tuple[float, float]:
    """Best wall time of kvlog's and the baseline's timed parts, alternated so both see
    the same machine load. ``make_*`` prepare (untimed) and return what is timed."""
    best = [float("inf"), float("inf")]
    for _ in range(repeat):
        for index, make in enumerate((make_baseline, make_run)):
            function = make()
            start = time.perf_counter()
            function()
            best[index] = min(best[index], time.perf_counter() - start)
    return best[1], best[0]


def _row(name: str, count: int, num_bytes: int, seconds: float, base_s: float | None) -> str:
    ratio = f"{base_s / seconds:6.2f}x" if base_s else "      -"
    return (
        f"{name:<36} {count:>8} {count / seconds:>12,.0f} {num_bytes / seconds / 1e6:>8.1f}"
        f" {seconds * 1e3:>9.1f} {ratio}"
    )


def _bench_appends(directory: str, records: list[Record], repeat: int, quick: bool) -> list[str]:
    rows = []
    path, base_path = os.path.join(directory, "a.kvlog"), os.path.join(directory, "a.bin")
    fsynced = (2_000, 200) if quick else (10_000, 1_000)  # fsync-bound: fewer records
    for sync, subset in (
        ("none", records),
        ("background", records),
        ("step", records[: fsynced[0]]),
        ("always", records[: fsynced[1]]),
    ):
        seconds, base_s = _best_pair_s(
            repeat,
            lambda s=sync, r=subset: _kvlog_append(path, r, s),
            lambda s=sync, r=subset: _baseline_append(base_path, r, s),
        )
        size = os.path.getsize(path)
        rows.append(_row(f"append sync={sync}", len(subset), size, seconds, base_s))
        rows.append(_row("  baseline (bare file, same fsyncs)", len(subset), size, base_s, None))
    return rows


def _append_costs(path: str, records: list[Record], sync: str) -> tuple[list[float], list[float]]:
    """Each append's time alone (s): step-ending ones, then the others."""
    if os.path.exists(path):
        os.unlink(path)
    steps: list[float] = []
    others: list[float] = []
    clock = time.perf_counter
    with LogWriter(path, sync) as writer:  # type: ignore[arg-type]
        for record in records:
            start = clock()
            writer.append(record)
            took = clock() - start
            (steps if type(record) is StepEnded else others).append(took)
    return steps, others


def _cost_row(name: str, times: list[float]) -> str:
    ordered = sorted(times)

    def pct(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e6

    mean = sum(ordered) / len(ordered) * 1e6
    return (
        f"{name:<36} {len(ordered):>8} {mean:>9.2f} {pct(0.5):>9.2f} {pct(0.99):>9.2f}"
        f" {ordered[-1] * 1e6:>9.1f}"
    )


def _bench_costs(directory: str, records: list[Record], quick: bool) -> list[str]:
    """The serving thread's cost per append, by sync mode (one pass each)."""
    rows = [
        f"{'per append on the serving thread, us':<36} {'count':>8} {'mean':>9} "
        f"{'p50':>9} {'p99':>9} {'worst':>9}"
    ]
    fsynced = 2_000 if quick else 10_000
    path = os.path.join(directory, "c.kvlog")
    for sync, subset in (
        ("none", records),
        ("background", records),
        ("step", records[:fsynced]),
    ):
        steps, others = _append_costs(path, subset, sync)
        rows.append(_cost_row(f"sync={sync}: step-ending append", steps))
        rows.append(_cost_row(f"sync={sync}: other appends", others))
    return rows


def _bench_reads(directory: str, records: list[Record], repeat: int) -> list[str]:
    path, base_path = os.path.join(directory, "r.kvlog"), os.path.join(directory, "r.bin")
    _kvlog_append(path, records, "none")()
    _baseline_append(base_path, records, "none")()
    size, count = os.path.getsize(path), len(records)

    def timed(function: Callable[[], object]) -> Callable[[], Callable[[], object]]:
        return lambda: function

    def skip_all() -> int:
        return sum(1 for _ in LogReader(path).records(count))

    base = timed(lambda: _baseline_read(base_path))
    seconds, base_s = _best_pair_s(repeat, timed(lambda: sum(1 for _ in read_log(path))), base)
    skip_s, _ = _best_pair_s(repeat, timed(skip_all), timed(int))
    reopen_s, _ = _best_pair_s(repeat, timed(lambda: LogWriter(path, "none").close()), timed(int))
    return [
        _row("read all (verify + decode)", count, size, seconds, base_s),
        _row("  baseline (bare file, decode)", count, size, base_s, None),
        _row("read past the end (verify only)", count, size, skip_s, base_s),
        _row("reopen for append (recovery scan)", count, size, reopen_s, base_s),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="20k records, one pass")
    parser.add_argument("--records", type=int, default=None, help="number of records")
    parser.add_argument("--repeat", type=int, default=None, help="best of this many passes")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args(argv)
    count = args.records or (20_000 if args.quick else 200_000)
    repeat = args.repeat or (1 if args.quick else 3)
    records = make_records(count)
    payload_bytes = sum(len(encode(record)) for record in records)
    print(
        f"{count} records, {payload_bytes / count:.1f} payload bytes on average, best of {repeat}"
    )
    print(f"{'':<36} {'records':>8} {'records/s':>12} {'MB/s':>8} {'ms':>9} vs base")
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        for line in _bench_appends(directory, records, repeat, args.quick):
            print(line, flush=True)
        for line in _bench_reads(directory, records, repeat):
            print(line, flush=True)
        for line in _bench_costs(directory, records, args.quick):
            print(line, flush=True)
    print("ratio = baseline time / kvlog time (above 1: kvlog is faster)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Fault campaigns against the log, the engine and large pools (issue 11), as a script.

    python fuzz/campaign.py all              every campaign at full size (about 20 minutes
                                             on 2 cores), figures on stdout, JSON with --json
    python fuzz/campaign.py flips|truncate|zeros|kill|writers|crash|pools [--quick]

- ``flips``: a single-bit flip and a byte overwrite at every byte of a log of >= 400
  records (checkpoints with snapshots, a final checkpoint), once closed cleanly and once
  abandoned as a crash leaves it. Every damaged copy is read back (``LogReader``) and, on
  every ``--writer-every``-th byte, reopened by a ``LogWriter``. A closed log must refuse
  every damage (``CorruptLogError`` naming the damaged frame), a crashed one every damage
  but in its last record (a torn tail). Never accepted silently, never misread.
- ``truncate``: a cut at every byte offset of both logs: recovered (a prefix of the records,
  the tail reported; a writer cuts it) or refused (closed log, header); never misread.
- ``zeros``: zeroed ranges of 1 to 4096 bytes across both logs, judged like flips.
- ``kill``: writers SIGKILLed mid-append (``sync`` "step" and "always", snapshots split into
  parts): every record reported durable survives, the rest is a prefix.
- ``writers``: two processes open one log at once (a ``touch``-ed empty file, and an absent
  one): exactly one wins, and the log holds exactly its records.
- ``crash``: ``KeyboardInterrupt``, ``MemoryError`` and ``RuntimeError`` raised (``sys.settrace``)
  at every line event location of the Engine, the Machine and the reducers that a small
  serving run on the canary executor reaches (its first, last and a random occurrence),
  and at every line of ``Engine.resume``: the engine afterwards holds exactly the logged
  state or refuses every call with ``EngineBroken``, and every log replays, verifies and
  resumes (issue 20).
- ``pools``: 1M, 10M and the bound (2**25) GPU blocks: constructor, checkpoint with snapshot,
  close, resume, replay; time and peak memory (each size in its own process).

``tests/faults/test_campaigns.py`` runs every campaign at a small size in CI. A failing
check raises ``AssertionError`` naming the case; the exit status is then 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import os
import random
import resource
import signal
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kvlog import Engine, replay
from kvlog.analysis.canary import make_canary_executor
from kvlog.errors import CorruptLogError, EngineBroken, KvlogError, LogLocked, LogPoisoned
from kvlog.events import (
    BlocksAllocated,
    CacheConfigured,
    Checkpoint,
    Record,
    RequestFinished,
    StepEnded,
    StoreRequested,
    TransferFinished,
)
from kvlog.log import LogReader, LogWriter
from kvlog.reducers import checkpoint
from kvlog.runtime.fold import state_at_end
from kvlog.synth import SynthConfig, SynthRun

__all__ = [
    "DamageOutcome",
    "WrittenLog",
    "build_log",
    "crash_campaign",
    "crash_trial",
    "flip_campaign",
    "kill_campaign",
    "pool_campaign",
    "truncate_campaign",
    "writers_campaign",
    "zero_campaign",
]

HEADER_BODY_LEN_AT = 12
logging.getLogger("kvlog.log").setLevel(logging.ERROR)  # thousands of torn-tail warnings


@dataclasses.dataclass
class WrittenLog:
    """A log file's bytes, records and frame boundaries."""

    data: bytes
    records: list[tuple[int, Record]]  # what a reader yields
    starts: list[int]  # start offset of every frame, then the end of the last one
    closed: bool

    def frame_of(self, position: int) -> int:
        """Index of the frame holding byte ``position`` (-1: the header)."""
        if position < self.starts[0]:
            return -1
        lo, hi = 0, len(self.starts) - 1
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.starts[mid] <= position else (lo, mid)
        return lo


def _frame_starts(data: bytes) -> list[int]:
    (body_len,) = struct.unpack_from("<I", data, HEADER_BODY_LEN_AT)
    starts = [20 + body_len]
    while starts[-1] < len(data):
        (length,) = struct.unpack_from("<I", data, starts[-1] + 4)
        starts.append(starts[-1] + 16 + length)
    assert starts[-1] == len(data), "frames do not end at the end of the file"
    return starts


def build_log(path: Path, *, steps: int = 120, seed: int = 0, closed: bool = True) -> WrittenLog:
    """An engine-driven log: allocations, finishes, stores and their completions, a
    checkpoint every 8 steps (a snapshot every other one), and the final checkpoint of
    ``close()``; ``closed=False`` abandons the log as a crash after that checkpoint would."""
    rng = random.Random(seed)
    config = CacheConfigured(num_gpu_blocks=256, block_size=16, num_cpu_blocks=64)
    engine = Engine(config, path, sync="none", checkpoint_every=8, snapshot_every=2)
    live: dict[str, list[int]] = {}
    free = list(range(1, 256))
    job = 0
    for step in range(steps):
        for _ in range(rng.randint(1, 3)):
            if free and rng.random() < 0.6:
                req = f"req-{step}-{rng.randrange(10**6)}"
                blocks = [free.pop(rng.randrange(len(free))) for _ in range(min(4, len(free)))]
                engine.apply(BlocksAllocated(req, blocks))
                live[req] = blocks
            elif live:
                req = rng.choice(sorted(live))
                engine.apply(RequestFinished(req))
                free += live.pop(req)
        if live and rng.random() < 0.3:
            blocks = live[rng.choice(sorted(live))][:1]
            engine.apply(StoreRequested(job, blocks, [job % 64]))
            engine.apply(TransferFinished(job, True))
            job += 1
        engine.apply(StepEnded(step))
    if closed:
        engine.close()
    else:
        engine.checkpoint(snapshot=True)
        assert engine._log is not None
        engine._log.abandon()
    data = path.read_bytes()
    return WrittenLog(data, list(LogReader(path).records()), _frame_starts(data), closed)


# -- judging one damaged file ------------------------------------------------------------
@dataclasses.dataclass
class DamageOutcome:
    """Counts of how damaged copies were read."""

    counts: Counter[str] = dataclasses.field(default_factory=Counter)
    failures: list[str] = dataclasses.field(default_factory=list)

    def add(self, kind: str, failure: str = "") -> None:
        self.counts[kind] += 1
        if failure and len(self.failures) < 20:
            self.failures.append(failure)

    def check(self) -> None:
        assert not self.failures, "\n".join(self.failures)


def _read(path: Path) -> tuple[str, list[tuple[int, Record]], Any]:
    """("refused", [], error) | ("torn", records, tail) | ("whole", records, None)."""
    try:
        reader = LogReader(path)
        got = list(reader.records())
    except CorruptLogError as exc:
        return "refused", [], exc
    if reader.tail is not None:
        return "torn", got, reader.tail
    return "whole", got, None


def judge(
    path: Path, log: WrittenLog, what: str, allowed_torn_from: int, frames: tuple[int, int]
) -> tuple[str, str]:
    """Read a damaged copy; ``(outcome, failure)``. ``frames``: the first and last frame
    the damage touches (-1: the header). A torn tail is allowed only when the damage
    reaches frame ``allowed_torn_from`` (a crash may garble everything unsynced after some
    point); a refusal must name the first damaged frame or an earlier one."""
    first, last = frames
    try:
        kind, got, info = _read(path)
    except KvlogError as exc:  # a typed refusal other than CorruptLogError
        return "refused-other", f"{what}: {exc!r}"
    except Exception as exc:
        return "untyped", f"{what}: untyped {exc!r}"
    if kind == "refused":
        if first < 0:
            return "refused-header", ""
        if info.offset > log.starts[first]:
            return kind, f"{what}: refused at {info.offset}, after the damaged frame"
        exact = (info.offset, info.seq) == (log.starts[first], first)
        return "refused-at-frame" if exact else "refused-before-frame", ""
    if got != log.records[: len(got)]:
        return "misread", f"{what}: misread records"
    if kind == "whole":
        return "accepted", f"{what}: accepted silently ({len(got)} records)"
    if last < allowed_torn_from:
        return "torn", f"{what}: damage read as a torn tail at {info.offset}"
    return kind, ""


def _writer_check(path: Path, kind: str, what: str) -> str:
    """A writer refuses what a reader refused (file unchanged) and cuts what it called torn."""
    before = path.read_bytes()
    try:
        LogWriter(path, sync="none").close()
    except CorruptLogError:
        if path.read_bytes() != before:
            return f"{what}: a refusing writer changed the file"
        return "" if kind.startswith("refused") else f"{what}: the writer refused, the reader not"
    return "" if not kind.startswith("refused") else f"{what}: the writer accepted it"


# -- flips, overwrites, truncation, zeros --------------------------------------------------
def _damage_loop(
    tmp: Path,
    log: WrittenLog,
    trials: Iterator[tuple[str, int, bytes]],
    writer_every: int,
) -> DamageOutcome:
    """Each trial puts ``bytes`` at an offset (a variant of the log), judges it, restores."""
    path = tmp / "damaged.kvlog"
    path.write_bytes(log.data)
    outcome = DamageOutcome()
    last_frame = len(log.starts) - 2
    allowed = 10**9 if log.closed else last_frame
    fd = os.open(path, os.O_RDWR)
    try:
        for index, (what, position, patch) in enumerate(trials):
            os.pwrite(fd, patch, position)
            original = log.data[position : position + len(patch)]
            changed = [i for i, (a, b) in enumerate(zip(original, patch, strict=True)) if a != b]
            first, last = position + changed[0], position + changed[-1]
            frames = (log.frame_of(first), log.frame_of(last))
            kind, failure = judge(path, log, what, allowed, frames)
            if not failure and writer_every and index % writer_every == 0:
                failure = _writer_check(path, kind, what)
            outcome.add(kind, failure)
            os.pwrite(fd, original, position)
            if os.fstat(fd).st_size != len(log.data):  # a writer cut or closed it
                path.write_bytes(log.data)
    finally:
        os.close(fd)
    return outcome


def flip_campaign(
    tmp: Path, log: WrittenLog, *, stride: int = 1, writer_every: int = 50
) -> dict[str, Any]:
    """A single-bit flip and a byte overwrite at every ``stride``-th byte."""
    rng = random.Random(7)

    def trials() -> Iterator[tuple[str, int, bytes]]:
        for position in range(0, len(log.data), stride):
            byte = log.data[position]
            yield (
                f"flip bit {position % 8} at {position}",
                position,
                bytes([byte ^ (1 << (position % 8))]),
            )
            other = rng.choice([b for b in range(256) if b != byte])
            yield f"overwrite {other:#04x} at {position}", position, bytes([other])

    outcome = _damage_loop(tmp, log, trials(), writer_every)
    outcome.check()
    return dict(outcome.counts)


def zero_campaign(
    tmp: Path,
    log: WrittenLog,
    *,
    lengths: tuple[int, ...] = (1, 8, 16, 100, 4096),
    min_step: int = 1,
    writer_every: int = 50,
) -> dict[str, Any]:
    """Zeroed ranges of each length, at offsets every half length (at least ``min_step``)."""

    def trials() -> Iterator[tuple[str, int, bytes]]:
        for length in lengths:
            for position in range(0, len(log.data) - 1, max(min_step, length // 2)):
                size = min(length, len(log.data) - position)
                if log.data[position : position + size] != bytes(size):
                    yield f"zero {size} bytes at {position}", position, bytes(size)

    outcome = _damage_loop(tmp, log, trials(), writer_every)
    outcome.check()
    return dict(outcome.counts)


def truncate_campaign(
    tmp: Path, log: WrittenLog, *, stride: int = 1, writer_every: int = 25
) -> dict[str, Any]:
    """A cut at every ``stride``-th offset: recovered (a prefix) or refused, never misread;
    a closed log refuses every cut but none at all."""
    path = tmp / "cut.kvlog"
    outcome = DamageOutcome()
    for index, cut in enumerate(range(0, len(log.data), stride)):
        with open(path, "wb") as file:
            file.write(log.data[:cut])
        what = f"cut at {cut}"
        kind, failure = _judge_cut(path, log, cut, what)
        if not failure and writer_every and index % writer_every == 0 and cut > 0:
            failure = _writer_check(path, kind, what)
        outcome.add(kind, failure)
    outcome.check()
    return dict(outcome.counts)


def _judge_cut(path: Path, log: WrittenLog, cut: int, what: str) -> tuple[str, str]:
    try:
        kind, got, _ = _read(path)
    except KvlogError as exc:
        return "refused-other", f"{what}: {exc!r}"
    except Exception as exc:
        return "untyped", f"{what}: untyped {exc!r}"
    if kind == "refused":
        if not log.closed and cut >= log.starts[0]:
            return kind, f"{what}: a crashed log cut after its header was refused"
        return kind, ""
    if got != log.records[: len(got)]:
        return "misread", f"{what}: misread records"
    if log.closed:
        return kind, f"{what}: a cut of a closed log was read as {kind}"
    return "recovered", ""


# -- SIGKILL -----------------------------------------------------------------------------
def _child_writer(path: str, sync: str, seed: int, part_bytes: int, out: int) -> None:
    """Append a deterministic stream; write each durable sequence number to ``out``."""
    import kvlog.log.writer as writer_module

    if part_bytes:
        writer_module.SNAPSHOT_PART_BYTES = part_bytes  # snapshots split into parts
    writer = LogWriter(path, sync)  # type: ignore[arg-type]
    for record in _record_stream(seed):
        seq = writer.append(record)
        if sync == "always" or isinstance(record, StepEnded):
            os.write(out, f"{seq}\n".encode())
    writer.close()


def _record_stream(seed: int) -> Iterator[Record]:
    rng = random.Random(seed)
    yield CacheConfigured(num_gpu_blocks=4096, block_size=16, num_cpu_blocks=1024)
    for step in range(100_000):
        for _ in range(rng.randint(3, 12)):
            ids = rng.sample(range(4096), rng.randint(1, 16 if rng.random() < 0.99 else 1200))
            yield BlocksAllocated(f"req-{rng.randrange(1000)}", ids)
        if step % 20 == 19:
            yield Checkpoint(step, "ab" * 32, step, rng.randbytes(rng.choice([64, 5000])))
        yield StepEnded(step)


def kill_one(tmp: Path, sync: str, seed: int, part_bytes: int) -> tuple[int, bool]:
    """Fork a writer, SIGKILL it after a random number of durable appends plus a random
    delay, check the log; returns (durable records reported, torn tail left)."""
    rng = random.Random(seed)
    path = tmp / f"killed-{sync}-{seed}.kvlog"
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(read_end)
        code = 0
        try:
            _child_writer(str(path), sync, seed, part_bytes, write_end)
        except BaseException:
            code = 1
        os._exit(code)
    os.close(write_end)
    synced = _read_until_killed(read_end, pid, rng)
    reader = LogReader(path)
    got = list(reader.records())
    expected = list(_take(_record_stream(seed), len(got)))
    assert [r for _, r in got] == expected, f"{path}: not a prefix of what was appended"
    assert not synced or synced[-1] <= reader.last_seq, (
        f"{path}: durable record {synced[-1]} lost (the log ends at {reader.last_seq})"
    )
    with LogWriter(path, sync="none") as writer:
        assert writer.recovery == reader.tail and writer.next_seq == reader.last_seq + 1
    path.unlink()
    return len(synced), reader.tail is not None


def _read_until_killed(fd: int, pid: int, rng: random.Random) -> list[int]:
    wanted, buffer, synced = rng.randint(1, 16), b"", []
    with os.fdopen(fd, "rb", buffering=0) as pipe:
        while len(synced) < wanted:
            chunk = pipe.read(4096)
            if not chunk:
                break
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            synced += [int(line) for line in lines]
        time.sleep(rng.uniform(0.0, 0.004))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        buffer += pipe.read()
    return synced + [int(line) for line in buffer.split(b"\n") if line]


def _take(records: Iterator[Record], count: int) -> Iterator[Record]:
    for _, record in zip(range(count), records, strict=False):
        yield record


def kill_campaign(tmp: Path, *, kills: int = 300) -> dict[str, Any]:
    """``kills`` SIGKILLs, a third each with sync "step", "always" and "always" with
    snapshots split into 1 KiB parts."""
    out: dict[str, Any] = {}
    variants = (("step", 0), ("always", 0), ("always", 1024))
    for index, (sync, part_bytes) in enumerate(variants):
        count = kills // 3 + (index < kills % 3)
        durable = torn = 0
        for run in range(count):
            num, was_torn = kill_one(tmp, sync, run * 3 + index, part_bytes)
            durable += num
            torn += was_torn
        name = f"{sync}{'+parts' if part_bytes else ''}"
        out[name] = {"kills": count, "durable_reported": durable, "torn_tails": torn, "lost": 0}
    return out


# -- two writers ---------------------------------------------------------------------------
def _racer(path: str, go: int, report: int, finish: int, num_records: int) -> None:
    """Wait for ``go``, open the log, report "won" or "locked"; a winner waits for
    ``finish``, appends its records (each synced) and closes."""
    os.read(go, 1)
    try:
        writer = LogWriter(path, sync="always")
    except LogLocked:
        os.write(report, b"locked\n")
        return
    os.write(report, f"won {os.getpid()}\n".encode())
    os.read(finish, 1)
    for index in range(num_records):
        writer.append(RequestFinished(f"{os.getpid()}-{index}"))
    writer.close()


def race_once(tmp: Path, trial: int, touched: bool, num_records: int = 5) -> None:
    """Two forked writers open one log at once; exactly one wins and its records are
    exactly the log's."""
    path = tmp / f"race-{trial}.kvlog"
    if touched:
        path.touch()
    go_r, go_w = os.pipe()
    rep_r, rep_w = os.pipe()
    fin_r, fin_w = os.pipe()
    pids = []
    for _ in range(2):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 0
            try:
                _racer(str(path), go_r, rep_w, fin_r, num_records)
            except BaseException:
                code = 1
            os._exit(code)
        pids.append(pid)
    os.write(go_w, b"gg")
    answers = _read_lines(rep_r, 2)
    os.write(fin_w, b"ff")
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        assert status == 0, f"trial {trial}: a racer failed (status {status})"
    for fd in (go_r, go_w, rep_r, rep_w, fin_r, fin_w):
        os.close(fd)
    winners = [a for a in answers if a.startswith("won")]
    assert len(winners) == 1 and "locked" in answers, f"trial {trial}: {answers}"
    winner = winners[0].split()[1]
    got = [r for _, r in LogReader(path).records()]
    assert got == [RequestFinished(f"{winner}-{i}") for i in range(num_records)], (
        f"trial {trial}: the log does not hold exactly the winner's records: {got}"
    )
    leftovers = [p for p in tmp.iterdir() if p.name.startswith(f".race-{trial}.")]
    assert not leftovers, f"trial {trial}: temporary files left: {leftovers}"
    path.unlink()


def _read_lines(fd: int, count: int) -> list[str]:
    data = b""
    while data.count(b"\n") < count:
        chunk = os.read(fd, 4096)
        assert chunk, "racers went away"
        data += chunk
    return [line for line in data.decode().splitlines() if line]


def writers_campaign(tmp: Path, *, trials: int = 100) -> dict[str, Any]:
    """``trials`` races on a touched empty file and ``trials`` on an absent one."""
    for trial in range(trials):
        race_once(tmp, trial, touched=True)
    for trial in range(trials):
        race_once(tmp, trials + trial, touched=False)
    return {
        "touched_empty": {"trials": trials, "one_winner": trials},
        "absent": {"trials": trials, "one_winner": trials},
    }


# -- large pools ---------------------------------------------------------------------------
def _peak_mib() -> float:
    """Peak RSS since the last ``_reset_peak`` (VmHWM; ru_maxrss where that is missing)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _reset_peak() -> None:
    """Start a new peak at the current RSS (Linux: ``5`` into clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as clear:
            clear.write("5")
    except OSError:
        pass


def _allocations(num_gpu_blocks: int, dense: bool) -> list[BlocksAllocated]:
    """High blocks for defrag to move: 50,000 spread ones, or 80% of the pool (dense)."""
    top = num_gpu_blocks - 1
    if not dense:
        count = min(50_000, num_gpu_blocks // 8)
        return [BlocksAllocated("big", list(range(top, top - count * 7, -7)))]
    used = range(num_gpu_blocks - int(num_gpu_blocks * 0.8), num_gpu_blocks)
    chunk = 100_000
    return [
        BlocksAllocated(f"req-{i}", list(used[i : i + chunk])) for i in range(0, len(used), chunk)
    ]


def _apply_all(engine: Engine, events: list[BlocksAllocated]) -> None:
    for event in events:
        engine.apply(event)


def pool_one(num_gpu_blocks: int, tmp: Path, dense: bool = False) -> dict[str, Any]:
    """Constructor, allocation and a defrag step with a checkpoint and snapshot, close,
    resume, replay (full and from the snapshot) on one pool; per stage seconds and peak RSS
    (MiB, the stage's own peak where the OS lets us reset it)."""
    figures: dict[str, Any] = {"num_gpu_blocks": num_gpu_blocks, "dense": dense}
    path = tmp / f"pool-{num_gpu_blocks}.kvlog"

    def stage(name: str, action: Callable[[], Any]) -> Any:
        _reset_peak()
        started = time.perf_counter()
        result = action()
        figures[name] = {
            "s": round(time.perf_counter() - started, 3),
            "peak_mib": round(_peak_mib()),
        }
        return result

    figures["rss_start_mib"] = round(_peak_mib())
    config = CacheConfigured(num_gpu_blocks=num_gpu_blocks, block_size=16, num_cpu_blocks=1024)
    engine = stage(
        "constructor", lambda: Engine(config, path, checkpoint_every=1, snapshot_every=1)
    )
    events = _allocations(num_gpu_blocks, dense)
    stage("allocate", functools.partial(_apply_all, engine, events))
    del events
    plans = stage(
        "step_with_checkpoint_and_snapshot", functools.partial(engine.apply, StepEnded(0))
    )
    assert plans and len(plans[0].pairs) == 512, plans[:1]
    digest = engine.digest()
    figures["snapshot_bytes"] = len(engine.snapshot())
    stage("close", engine.close)
    del engine
    figures["log_bytes"] = path.stat().st_size
    resumed = stage("resume", lambda: Engine.resume(path, sync="none"))
    assert resumed.digest() == digest
    stage("close_resumed", resumed.close)
    del resumed
    result = stage("replay", lambda: replay(path, series=False))
    assert result.ok and result.final_digest == digest, result.divergence
    del result
    result = stage("replay_from_snapshot", lambda: replay(path, from_snapshot=True, series=False))
    assert result.ok and result.final_digest == digest, result.divergence
    figures["peak_mib"] = max(v["peak_mib"] for v in figures.values() if isinstance(v, dict))
    return figures


POOLS = ((1_000_000, False), (1_000_000, True), (10_000_000, False), (10_000_000, True))
POOLS += ((1 << 25, False),)


def pool_campaign(sizes: tuple[tuple[int, bool], ...] = POOLS) -> list[dict[str, Any]]:
    """``pool_one`` for each (size, dense), each in a fresh process."""
    out = []
    for size, dense in sizes:
        command = [sys.executable, __file__, "pool-one", str(size)] + (["--dense"] if dense else [])
        proc = subprocess.run(command, capture_output=True, text=True, check=False)
        assert proc.returncode == 0, f"pool {size}: {proc.stderr[-3000:]}"
        out.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return out


# -- the command line ----------------------------------------------------------------------
def _damage_campaigns(tmp: Path, name: str, quick: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for closed in (True, False):
        log = build_log(tmp / f"base-{closed}.kvlog", steps=40 if quick else 120, closed=closed)
        label = "closed" if closed else "crashed"
        sizes = {"records": len(log.records), "frames": len(log.starts) - 1, "bytes": len(log.data)}
        stride = 37 if quick else 1
        if name == "flips":
            counts = flip_campaign(tmp, log, stride=stride)
        elif name == "truncate":
            counts = truncate_campaign(tmp, log, stride=stride)
        else:
            counts = zero_campaign(
                tmp,
                log,
                lengths=(1, 16, 4096) if quick else (1, 8, 16, 100, 4096),
                min_step=13 if quick else 1,
            )
        out[label] = {**sizes, **counts}
    return out


# -- crash points (issue 20) -----------------------------------------------------------
CRASH_SYNTH = SynthConfig(
    seed=3,
    steps=40,
    num_gpu_blocks=96,
    block_size=16,
    num_cpu_blocks=64,
    prefix_caching=True,
    arrival_rate=0.5,
    prompt_len_mean=100.0,
    output_len_mean=12.0,
    max_num_seqs=8,
    num_prefixes=3,
    prefix_len_max_blocks=4,
    transfer_failure_rate=0.2,
    threshold=1,
)
"""The crash-point program: a small serving run with prefix hits, preemption, defrag,
stores and loads (some failing) on the canary CPU executor, so ``poll``, ``wait`` and
``Machine.commit``'s executor call all run; a checkpoint every 4 steps, a snapshot every
other one."""
CRASH_EXCEPTIONS: dict[str, type[BaseException]] = {
    "KeyboardInterrupt": KeyboardInterrupt,
    "MemoryError": MemoryError,
    "RuntimeError": RuntimeError,  # an executor's or an observer's error
}
Location = tuple[str, int]


def crash_files(writer: bool = False) -> frozenset[str]:
    """The source files whose every line event is a crash point: the Engine (with its
    record checks and block tables), the Machine, the reducers (check and commit) and, with
    ``writer``, the log writer."""
    import kvlog

    root = Path(kvlog.__file__).resolve().parent
    runtime = [root / "runtime" / f for f in ("engine.py", "machine.py", "records.py", "tables.py")]
    files = [*runtime, *sorted((root / "reducers").glob("*.py"))]
    if writer:
        files.append(root / "log" / "writer.py")
    return frozenset(str(f) for f in files)


class LineInjector:
    """A ``sys.settrace`` tracer over ``files``: counts every line event by location or, with
    a ``target``, raises ``exc`` at that location's ``occurrence``-th line event (once)."""

    def __init__(
        self,
        files: frozenset[str],
        target: Location | None = None,
        occurrence: int = 1,
        exc: type[BaseException] = KeyboardInterrupt,
    ) -> None:
        self.files, self.target, self.occurrence, self.exc = files, target, occurrence, exc
        self.counts: Counter[Location] = Counter()
        self.fired = False

    def __call__(self, frame: Any, event: str, arg: Any) -> Any:
        return self._line if frame.f_code.co_filename in self.files else None

    def _line(self, frame: Any, event: str, arg: Any) -> Any:
        if event != "line" or self.fired:
            return self._line
        key = (frame.f_code.co_filename, frame.f_lineno)
        self.counts[key] += 1
        if key == self.target and self.counts[key] == self.occurrence:
            self.fired = True
            raise self.exc(f"injected at {Path(key[0]).name}:{key[1]} #{self.occurrence}")
        return self._line


def _run_program(path: Path, injector: LineInjector, config: SynthConfig) -> Engine | None:
    """Build an engine on ``path``, serve ``config`` through it and close it, traced by
    ``injector``; the engine (None when its constructor was cut short). The injected
    exception propagates, as a Ctrl-C would, after tracing stops."""
    executor, tracker = make_canary_executor(config.cache_config(), "cpu")
    holder: list[Engine] = []
    try:
        sys.settrace(injector)
        try:
            holder.append(Engine(config.cache_config(), path, executor, "step", 4, 2))
            SynthRun(config, holder[0], tracker).run()
            holder[0].close()
        finally:
            sys.settrace(None)
    except BaseException as exc:
        if not injector.fired or not _caused_by(exc, injector.exc):
            raise
        _judge_engine(holder[0] if holder else None, path)
    finally:
        executor.shutdown()
    return holder[0] if holder else None


def _caused_by(exc: BaseException | None, injected: type[BaseException]) -> bool:
    """``exc`` is the injected exception, or a typed error raised from it (a
    ``MemoryError`` in the constructor is ``StateTooLarge``)."""
    while exc is not None:
        if type(exc) is injected and str(exc).startswith("injected at "):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _judge_engine(engine: Engine | None, path: Path) -> str:
    """After an injected exception: the engine holds exactly the logged state, or refuses
    every call with ``EngineBroken`` (or, where the interrupt landed in the log writer
    outside an engine call, with the poisoned log's ``LogPoisoned``); then it closes.
    The outcome's name."""
    if engine is None:
        outcome = "constructor"
    elif engine.closed:
        outcome = "closed"
    elif engine.broken or (engine._log is not None and engine._log.poisoned):
        for call in (
            lambda: engine.apply(StepEnded(1 << 30)),
            engine.poll,
            engine.wait,
            engine.checkpoint,
            engine.digest,
            engine.running_digest,
            lambda: engine.resolve_all([[0]]),
        ):
            try:
                call()
            except (EngineBroken, LogPoisoned):  # or the poisoned log's refusal
                continue
            raise AssertionError(f"{path}: a broken engine answered {call}")
        outcome = "broken" if engine.broken else "poisoned"
    else:
        live = engine.running_digest()
        assert engine._log is not None
        engine._log.flush()
        state, _ = state_at_end(path)
        assert checkpoint.checkpoint_digest(state) == live, f"{path}: live state is not the log's"
        outcome = "consistent"
    if engine is not None:
        engine.close()
        engine.close()  # idempotent, and finishes a close that was cut short
    _JUDGED[outcome] += 1
    return outcome


_JUDGED: Counter[str] = Counter()


def verify_crashed_log(path: Path) -> bool:
    """The log left by a crash point replays and verifies (``replay(verify=True)``), and
    ``Engine.resume`` continues it at the replayed state; False when no log holds events
    (a constructor cut short before ``CacheConfigured`` was written)."""
    if not path.exists() or not any(True for _ in LogReader(path).records()):
        with LogWriter(path):  # no lock left behind
            pass
        return False
    result = replay(path, verify=True)
    assert result.ok, f"{path}: {result.divergence}"
    state, _ = state_at_end(path)
    with Engine.resume(path, sync="none") as resumed:
        assert resumed.running_digest() == checkpoint.checkpoint_digest(state), path
    assert replay(path, verify=True).ok, f"{path}: after resume"
    return True


def crash_locations(
    tmp: Path, writer: bool = False, config: SynthConfig = CRASH_SYNTH
) -> Counter[Location]:
    """Every line location of the crash files that the program reaches, with its count
    (the second of two runs: the first may compile or cache what later runs skip)."""
    for run in range(2):
        injector = LineInjector(crash_files(writer))
        path = tmp / f"dry{run}.kvlog"
        path.unlink(missing_ok=True)
        _run_program(path, injector, config)
    return injector.counts


def crash_trial(
    tmp: Path,
    location: Location,
    occurrence: int,
    exc: type[BaseException],
    writer: bool = False,
    config: SynthConfig = CRASH_SYNTH,
) -> bool:
    """One crash point: the program with ``exc`` raised at that line event; then the
    engine and the log are judged (see ``_judge_engine``, ``verify_crashed_log``). Whether
    a log was verified."""
    path = tmp / "crash.kvlog"
    path.unlink(missing_ok=True)
    injector = LineInjector(crash_files(writer), location, occurrence, exc)
    _run_program(path, injector, config)
    assert injector.fired, f"{location} #{occurrence} not reached"
    return verify_crashed_log(path)


def resume_trial(tmp: Path, source: Path, location: Location, exc: type[BaseException]) -> None:
    """``Engine.resume`` of a finished log, and its ``close()``, cut short at
    ``location``: the resumed engine (if any) closes on a second ``close()``, nothing is
    left locked, and the log still replays, verifies and resumes."""
    path = tmp / f"resume-{Path(location[0]).stem}-{location[1]}.kvlog"
    path.write_bytes(source.read_bytes())
    injector = LineInjector(crash_files(), location, 1, exc)
    engines: list[Engine] = []
    sys.settrace(injector)
    try:
        engines.append(Engine.resume(path, sync="step"))
        engines[0].close()
    except BaseException as caught:
        if not injector.fired or not _caused_by(caught, exc):
            raise
    finally:
        sys.settrace(None)
    if engines:
        engines[0].close()  # finishes a close that was cut short
    verify_crashed_log(path)
    path.unlink()


def crash_campaign(
    tmp: Path,
    *,
    occurrences: int = 3,
    exceptions: tuple[str, ...] = tuple(CRASH_EXCEPTIONS),
    writer: bool = False,
    sample: int = 0,
    seed: int = 0,
    every_exception: bool = True,
) -> dict[str, Any]:
    """Every reached line location (or ``sample`` of them) x its first, last and random
    occurrences (up to ``occurrences``) x each exception (or one in turn); then the resume
    path's locations. Figures: points tried, logs verified, engine outcomes."""
    rng = random.Random(seed)
    _JUDGED.clear()
    counts = crash_locations(tmp, writer)
    locations = sorted(counts)
    if sample:
        locations = rng.sample(locations, min(sample, len(locations)))
    tried = verified = 0
    for index, location in enumerate(locations):
        total = counts[location]
        picks = sorted({1, total, *(rng.randint(1, total) for _ in range(occurrences))})
        for occurrence in picks[:occurrences]:
            rotated = [exceptions[(index + occurrence) % len(exceptions)]]
            for name in exceptions if every_exception else rotated:
                tried += 1
                exc = CRASH_EXCEPTIONS[name]
                verified += crash_trial(tmp, location, occurrence, exc, writer)
    resumed = _resume_points(tmp, rng, sample)
    return {
        "locations": len(counts),
        "points_tried": tried,
        "logs_verified": verified,
        "engine_outcomes": dict(_JUDGED),
        "resume_points": resumed,
    }


def _resume_points(tmp: Path, rng: random.Random, sample: int) -> int:
    """Cut ``Engine.resume`` short at each of its line locations (or ``sample``)."""
    source = tmp / "whole.kvlog"
    source.unlink(missing_ok=True)
    _run_program(source, LineInjector(frozenset()), CRASH_SYNTH)
    injector = LineInjector(crash_files())
    sys.settrace(injector)
    try:
        Engine.resume(tmp / "whole.kvlog", sync="step").close()
    finally:
        sys.settrace(None)
    locations = sorted(injector.counts)
    if sample:
        locations = rng.sample(locations, min(sample, len(locations)))
    for location in locations:
        resume_trial(tmp, source, location, KeyboardInterrupt)
    return len(locations)


def run(name: str, quick: bool) -> dict[str, Any]:
    """One campaign by name; its figures."""
    with tempfile.TemporaryDirectory(prefix="kvlog-campaign-") as tmp_name:
        tmp = Path(tmp_name)
        started = time.perf_counter()
        if name in ("flips", "truncate", "zeros"):
            figures: Any = _damage_campaigns(tmp, name, quick)
        elif name == "kill":
            figures = kill_campaign(tmp, kills=30 if quick else 300)
        elif name == "writers":
            figures = writers_campaign(tmp, trials=10 if quick else 100)
        elif name == "crash":
            figures = crash_campaign(
                tmp,
                occurrences=1 if quick else 3,
                sample=60 if quick else 0,
                every_exception=not quick,
            )
        else:
            figures = pool_campaign(((100_000, False), (100_000, True)) if quick else POOLS)
        return {
            "campaign": name,
            "seconds": round(time.perf_counter() - started, 1),
            "figures": figures,
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "campaign",
        choices=(
            "all",
            "flips",
            "truncate",
            "zeros",
            "kill",
            "writers",
            "crash",
            "pools",
            "pool-one",
        ),
    )
    parser.add_argument("size", nargs="?", type=int, default=0, help="pool-one: num_gpu_blocks")
    parser.add_argument("--quick", action="store_true", help="a small size (as in CI)")
    parser.add_argument("--dense", action="store_true", help="pool-one: 80%% of the pool used")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    if args.campaign == "pool-one":
        with tempfile.TemporaryDirectory(prefix="kvlog-pool-") as tmp:
            print(json.dumps(pool_one(args.size, Path(tmp), args.dense)))
        return 0
    names = (
        ["flips", "truncate", "zeros", "kill", "writers", "crash", "pools"]
        if args.campaign == "all"
        else [args.campaign]
    )
    results = []
    for name in names:
        result = run(name, args.quick)
        print(json.dumps(result, indent=2), flush=True)
        results.append(result)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

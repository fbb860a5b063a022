"""A flight recorder a server can run for months: segments, retention, resume, --parallel, a
full disk. Each part prints its figures with the baseline measured in the same run.

    python bench/bench_log_lifecycle.py rotate   [--steps 200000] [--segment-mib 1] [--retain-mib 8]
        the Gaudi facade (update_state, defragment, resolve_all every 64 steps) recording a
        log directory: segments sealed and removed, bytes per step and per event, then
        ``kvlog replay DIR`` and ``--parallel`` verify every remaining segment
    python bench/bench_log_lifecycle.py resume   [--mib 220] [--segment-mib 8]
        one runner trace into a single file and a directory (no retention) of --mib MiB each;
        Engine.resume and replay --from-snapshot of each: the file (baseline) against the
        directory, with the directory's time split into finding, loading and replaying past
        its latest snapshot
    python bench/bench_log_lifecycle.py parallel [--log DIR]
        replay of a segmented log: sequential (baseline) against --parallel on Ray with 1 and
        2 CPUs (one task per segment)
    python bench/bench_log_lifecycle.py disk-full [--steps 20000] [--fs-kib 512]
        the facade and its offloading worker on a tiny tmpfs (root: mount -t tmpfs), else with
        ENOSPC injected into the writer: the serving loop runs to the end with the plans and
        tables of a run without a log, the status reports the detach, the log replays to the gap
    python bench/bench_log_lifecycle.py vllm-disk [--config pc-bpc2-async]   (the vLLM venv)
        tests/vllm_harness.py (vLLM's scheduler, KvlogOffloadingConnector, the defragmenter,
        canaries) with the log's disk failing: ENOSPC after 192 KiB, then EIO on the 51st
        fdatasync; the harness's checks (bytes, tables, tokens, completions) must all pass
    python bench/bench_log_lifecycle.py traces
        bytes per step and per event of the public traces (kvlog synth --trace) into a directory
    python bench/bench_log_lifecycle.py ranks LOG0 LOG1
        kvlog ranks on two ranks' logs (e.g. two PYTHONHASHSEED=0 runs of one vllm_harness.py
        config), then on LOG0 against a copy of LOG1 fed one different event (a request
        finished in the middle of the run reported preempted instead)
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # python -m or from elsewhere

from bench_facade import runner_steps  # the runner's trace, one definition
from seed_reference import make_hpu_caches

from kvlog import Engine, replay
from kvlog.events import CacheConfigured, StepScheduled
from kvlog.integrations import OffloadingWorker, OnlineDefragmenter
from kvlog.log import LogReader, latest_snapshot, list_segments
from kvlog.log.manifest import log_num_bytes
from kvlog.runtime.fold import state_at_end

BLOCK_SIZE = 16
MIB = 1 << 20


def facade(env: dict[str, str], num_blocks: int) -> OnlineDefragmenter:
    defrag = OnlineDefragmenter(environ={"VLLM_DEFRAG_THRESHOLD": "32", **env}, backend="cpu")
    defrag.initialize(make_hpu_caches(num_blocks, BLOCK_SIZE), BLOCK_SIZE)
    return defrag


# -- rotate --------------------------------------------------------------------------------
def cmd_rotate(args: argparse.Namespace) -> None:
    tmp = tempfile.mkdtemp(prefix="kvlog-rotate-")
    log = os.path.join(tmp, "log") + "/"
    env = {
        "KVLOG_PATH": log,
        "KVLOG_SEGMENT_BYTES": str(args.segment_mib * MIB),
        "KVLOG_RETAIN_BYTES": str(args.retain_mib * MIB),
    }
    defrag = facade(env, args.blocks)
    started = time.perf_counter()
    engine = defrag.engine
    for step, (new, finished, live) in enumerate(runner_steps(args.blocks)):
        if step == args.steps:
            break
        defrag.update_state(new, finished)
        defrag.defragment()
        if step % 64 == 0:
            defrag.resolve_all(list(live.values()))
    writer = engine._log
    sealed, removed = writer.num_sealed, writer.num_removed  # type: ignore[union-attr]
    num_records = writer.next_seq  # type: ignore[union-attr]  # every record appended
    defrag.close()
    wall = time.perf_counter() - started
    infos = list_segments(log)
    kept = log_num_bytes(log)
    print(f"{args.steps:,} facade steps in {wall:.1f} s ({wall / args.steps * 1e6:.0f} us/step)")
    print(f"segments: {sealed} sealed, {removed} removed by retention, {len(infos)} left, "
          f"{kept / MIB:.1f} MiB left (retain {args.retain_mib} MiB)")  # fmt: skip
    first = infos[0].first_seq
    result = replay(log)
    print(f"kvlog replay DIR: ok={result.ok}, started at seq {result.start_seq} (the first "
          f"snapshot left: seq {first}), {result.num_events:,} events, "
          f"{result.num_verified}/{result.num_checkpoints} checkpoints verified, "
          f"{result.elapsed_s:.1f} s")  # fmt: skip
    bytes_per_record = kept / max(1, result.num_records)
    steps_left = result.counts.get("StepScheduled", 0) + result.counts.get("StepEnded", 0)
    print(f"bytes per step {kept / max(1, steps_left):.0f}, per record "
          f"{bytes_per_record:.0f} ({result.num_records:,} records in the segments left; "
          f"{num_records:,} appended in all)")  # fmt: skip
    from kvlog.analysis.parallel import replay_segments

    par = replay_segments(log, use_ray=False)
    print(f"--parallel (in process): ok={par.ok}, {len(par.segments)} segments, "
          f"final digest equal: {par.final_digest == result.recorded.final_digest}")  # type: ignore[union-attr]  # fmt: skip
    shutil.rmtree(tmp)


# -- resume --------------------------------------------------------------------------------
def record_both(file: str, directory: str, mib: int, segment_mib: int, blocks: int) -> int:
    """The runner trace as one StepScheduled a step into a file and a directory, until the
    file holds ``mib`` MiB; the number of steps."""
    config = CacheConfigured(num_gpu_blocks=blocks, block_size=BLOCK_SIZE, threshold=32)
    one = Engine(config, file, sync="none")
    many = Engine(config, directory, sync="none", segment_bytes=segment_mib * MIB)
    step = 0
    for step, (new, finished, _) in enumerate(runner_steps(blocks)):
        event = StepScheduled(step=step, allocated=new, finished=finished)
        one.apply(event)
        many.apply(event)
        if step % 4096 == 0 and os.path.getsize(file) >= mib * MIB:
            break
    for engine, path in ((one, file), (many, directory)):  # a crash image: no close
        engine._log.flush()  # type: ignore[union-attr]
        copy = shutil.copytree if os.path.isdir(path) else shutil.copyfile
        copy(path, path.rstrip("/") + "-crash")
        engine.close()
    return step + 1


def timed(fn: object) -> float:
    started = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - started


def cmd_resume(args: argparse.Namespace) -> None:
    tmp = Path(args.dir or tempfile.mkdtemp(prefix="kvlog-resume-"))
    file, directory = str(tmp / "one.kvlog"), str(tmp / "dir")
    if not os.path.exists(file):
        started = time.perf_counter()
        steps = record_both(file, directory, args.mib, args.segment_mib, args.blocks)
        print(f"recorded {steps:,} steps twice in {time.perf_counter() - started:.0f} s")
    num_segments = len(list_segments(directory))
    print(f"file {os.path.getsize(file) / MIB:.0f} MiB; directory "
          f"{log_num_bytes(directory) / MIB:.0f} MiB in {num_segments} segments")  # fmt: skip
    variants = [("file (baseline)", file), ("directory", directory)]
    variants += [("crashed file", file + "-crash"), ("crashed dir", directory + "-crash")]
    for label, path in variants:
        if not os.path.exists(path):
            continue
        snapshot_s = timed(lambda p=path: replay(p, from_snapshot=True))
        split = split_resume(path) if "dir" in label else None  # before resume appends
        resume_s = timed(lambda p=path: Engine.resume(p).close())
        print(f"{label:16} Engine.resume {resume_s:6.2f} s   "
              f"replay --from-snapshot {snapshot_s:6.2f} s")  # fmt: skip
        if split is not None:
            text, load_s, state_s = split
            print(f"{text}; the rest of resume (open, lock, scan the open segment, checkpoint, "
                  f"close) {resume_s - state_s:.2f} s; resume minus loading the snapshot "
                  f"{resume_s - load_s:.3f} s")  # fmt: skip


def split_resume(path: str) -> tuple[str, float, float]:
    """Where a directory's resume goes: finding, loading and replaying past its latest
    snapshot (the text, the load time, the verified replay's time)."""
    from kvlog import reducers

    find_s = timed(lambda: latest_snapshot(path))
    seq, checkpoint = latest_snapshot(path)
    assert checkpoint is not None
    load_s = timed(lambda: reducers.restore(checkpoint.snapshot))
    state_s = timed(lambda: state_at_end(path))
    records_after = sum(1 for _ in LogReader(path).records(seq + 1))
    text = (
        f"  latest snapshot found in {find_s * 1e3:.1f} ms (seq {seq}), loaded in "
        f"{load_s * 1e3:.1f} ms ({len(checkpoint.snapshot):,} bytes); the verified replay "
        f"from it ({records_after} records after it) {state_s:.2f} s"
    )
    return text, load_s, state_s


# -- parallel ------------------------------------------------------------------------------
def cmd_parallel(args: argparse.Namespace) -> None:
    from kvlog.analysis.parallel import replay_segments

    log = args.log
    if log is None:
        log = tempfile.mkdtemp(prefix="kvlog-parallel-") + "/dir"
        record_both(log + ".kvlog", log, args.mib, args.segment_mib, args.blocks)
    print(f"{log}: {log_num_bytes(log) / MIB:.0f} MiB, {len(list_segments(log))} segments")
    base = timed(lambda: replay(log, series=False))
    print(f"sequential replay (baseline): {base:.1f} s")
    for cpus in (1, 2):
        t = timed(lambda c=cpus: replay_segments(log, num_cpus=c))
        print(f"--parallel --num-cpus {cpus}: {t:.1f} s ({base / t:.2f}x the sequential)")


# -- disk full -----------------------------------------------------------------------------
@contextlib.contextmanager
def tiny_filesystem(kib: int) -> Iterator[str | None]:
    """A ``kib`` KiB tmpfs (None when this process may not mount one)."""
    where = tempfile.mkdtemp(prefix="kvlog-tinyfs-")
    mounted = (
        os.geteuid() == 0
        and subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", where], check=False
        ).returncode
        == 0
    )
    try:
        yield where if mounted else None
    finally:
        if mounted:
            subprocess.run(["umount", where], check=False)
        os.rmdir(where)


def serve(log: str | None, steps: int, blocks: int) -> tuple[object, list[object]]:
    env = {"KVLOG_SYNC": "background"} | ({"KVLOG_PATH": log} if log else {})
    defrag = facade(env, blocks)
    worker = OffloadingWorker(defrag, num_cpu_blocks=64)
    seen: list[object] = []
    for step, (new, finished, live) in enumerate(runner_steps(blocks, seed=1)):
        if step == steps:
            break
        defrag.update_state(new, finished)
        defrag.defragment()
        swap = defrag.last_swap
        seen.append(None if swap is None else swap.pairs)
        if step % 16 == 0:
            seen.append(defrag.resolve_all(list(live.values())))
            block = next(iter(live.values()))[0]
            worker.submit_store(step + 1, [block], [step % 64])
            worker.wait(None)
            seen.append([r.job_id for r in worker.get_finished()])
    return defrag, seen


def cmd_disk_full(args: argparse.Namespace) -> None:
    started = time.perf_counter()
    _, expected = serve(None, args.steps, args.blocks)
    print(f"without a log: {args.steps:,} steps in {time.perf_counter() - started:.1f} s")
    for name in ("facade.kvlog", "dir/"):  # a fresh filesystem each
        with tiny_filesystem(args.fs_kib) as where:
            if where is None:
                print("cannot mount a tmpfs here: ENOSPC injected into the writer instead")
                disk_full_injected(args, expected)
                return
            log = os.path.join(where, name)
            started = time.perf_counter()
            defrag, seen = serve(log, args.steps, args.blocks)
            status = defrag.log_status()  # type: ignore[attr-defined]
            defrag.close()  # type: ignore[attr-defined]
            report(f"{args.fs_kib} KiB tmpfs, {name}", seen == expected, status, log, started)


def disk_full_injected(args: argparse.Namespace, expected: list[object]) -> None:
    from kvlog.log import writer

    real = writer._write_all
    budget = [args.fs_kib * 1024]

    def write_all(fd: int, data: bytes | bytearray) -> None:
        if len(data) > budget[0]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        budget[0] -= len(data)
        real(fd, data)

    writer._write_all = write_all  # type: ignore[assignment]
    tmp = tempfile.mkdtemp(prefix="kvlog-full-")
    log = os.path.join(tmp, "facade.kvlog")
    started = time.perf_counter()
    defrag, seen = serve(log, args.steps, args.blocks)
    status = defrag.log_status()  # type: ignore[attr-defined]
    defrag.close()  # type: ignore[attr-defined]
    writer._write_all = real  # type: ignore[assignment]
    report("ENOSPC injected", seen == expected, status, log, started)


def report(label: str, same: bool, status: object, log: str, started: float) -> None:
    wall = time.perf_counter() - started
    result = replay(log)
    print(f"{label}: ran to the end in {wall:.1f} s; plans, tables and transfers as without a "
          f"log: {same}\n  status: {status}\n  replay of what the disk holds: ok={result.ok}, "
          f"{result.num_events:,} events, {result.num_verified} checkpoints verified, "
          f"gaps: {result.gaps}")  # fmt: skip


# -- the real vLLM harness on a failing disk -------------------------------------------------
def cmd_vllm_disk(args: argparse.Namespace) -> None:
    import vllm_harness as harness

    from kvlog.log import writer

    real_write, real_sync = writer._write_all, writer._datasync
    budget, syncs = [192 << 10], [0]

    def write_all(fd: int, data: bytes | bytearray) -> None:
        if len(data) > budget[0]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        budget[0] -= len(data)
        real_write(fd, data)

    def datasync(fd: int) -> None:
        syncs[0] += 1
        if syncs[0] > 50:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real_sync(fd)

    for name, patch in (("ENOSPC", ("_write_all", write_all)), ("EIO", ("_datasync", datasync))):
        setattr(writer, *patch)
        with tempfile.TemporaryDirectory(prefix="kvlog-vllm-disk-") as tmp:
            run = harness.Run(harness.CONFIGS[args.config], tmp)
            res = run.execute()
            status = run.connector.log_status()  # the connector's own view
        writer._write_all, writer._datasync = real_write, real_sync  # type: ignore[assignment]
        print(f"connector.log_status(): {status}")
        replayed = all(d.startswith("divergence None") for d in res.details.get("replay", []))
        print(f"{name} {args.config}: {res.steps} steps, {res.finished}/{res.requests} requests "
              f"finished, {res.stores_done}/{res.stores} stores, {res.loads_done} loads, "
              f"{res.swaps} swaps; wrong bytes {res.wrong}, table mismatches "
              f"{res.table_mismatches}, token mismatches {res.token_mismatches}, harness "
              f"errors {res.harness_errors}, errors {res.errors}; the stopped log replays "
              f"with no divergence: {replayed}")  # fmt: skip


# -- traces --------------------------------------------------------------------------------
def cmd_traces(args: argparse.Namespace) -> None:
    traces = Path(args.traces)
    tmp = tempfile.mkdtemp(prefix="kvlog-traces-")
    for trace in sorted(traces.glob("*.*")):
        if trace.suffix not in (".csv", ".jsonl"):
            continue
        out = os.path.join(tmp, trace.stem) + "/"
        command = [sys.executable, "-m", "kvlog", "synth", "--trace", str(trace)]
        command += ["--requests", str(args.requests), "--out", out]
        subprocess.run(command, check=True, capture_output=True)
        result = replay(out, series=False)
        steps = result.counts.get("StepScheduled", 0) + result.counts.get("StepEnded", 0)
        size = log_num_bytes(out)
        print(f"{trace.name}: {args.requests} requests, {steps:,} steps, {result.num_events:,} "
              f"events, {size / 1024:.0f} KiB: {size / steps:.0f} bytes per step, "
              f"{size / result.num_events:.0f} per event")  # fmt: skip
    shutil.rmtree(tmp)


# -- ranks ---------------------------------------------------------------------------------
def cmd_ranks(args: argparse.Namespace) -> None:
    from kvlog.analysis.ranks import compare_ranks
    from kvlog.events import Checkpoint, RequestFinished, RequestPreempted

    started = time.perf_counter()
    result = compare_ranks([args.logs[0], args.logs[1]])
    wall = time.perf_counter() - started
    print(f"kvlog ranks: ok={result.ok}, {result.num_events:,} events, {result.num_steps:,} "
          f"steps, normalized {result.normalized} ({wall:.1f} s)")  # fmt: skip
    events = [r for _, r in LogReader(args.logs[1]).records() if not isinstance(r, Checkpoint)]
    index = next(
        i for i, e in enumerate(events) if type(e) is RequestFinished and i > len(events) // 2
    )
    finished = events[index]
    assert type(finished) is RequestFinished
    events[index] = RequestPreempted(req_id=finished.req_id)
    fed = tempfile.mkdtemp(prefix="kvlog-ranks-") + "/rank1-fed.kvlog"
    config = events[0]
    assert type(config) is CacheConfigured
    with Engine(config, fed) as engine:
        for event in events[1:]:
            engine.apply(event)
    step = sum(type(e).__name__ in ("StepEnded", "StepScheduled") for e in events[:index])
    print(f"rank 1 fed RequestPreempted({finished.req_id!r}) instead of its RequestFinished, "
          f"event {index} (step {step}):")  # fmt: skip
    print(f"kvlog ranks: {compare_ranks([args.logs[0], fed]).difference}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="part", required=True)
    p = sub.add_parser("rotate")
    p.add_argument("--steps", type=int, default=200_000)
    p.add_argument("--blocks", type=int, default=4096)
    p.add_argument("--segment-mib", type=int, default=1)
    p.add_argument("--retain-mib", type=int, default=8)
    for name, mib in (("resume", 220), ("parallel", 64)):
        p = sub.add_parser(name)
        p.add_argument("--mib", type=int, default=mib)
        p.add_argument("--segment-mib", type=int, default=8)
        p.add_argument("--blocks", type=int, default=4096)
        p.add_argument("--dir" if name == "resume" else "--log")
    p = sub.add_parser("disk-full")
    p.add_argument("--steps", type=int, default=20_000)
    p.add_argument("--blocks", type=int, default=4096)
    p.add_argument("--fs-kib", type=int, default=512)
    p = sub.add_parser("vllm-disk")
    p.add_argument("--config", default="pc-bpc2-async")
    p = sub.add_parser("ranks")
    p.add_argument("logs", nargs=2)
    p = sub.add_parser("traces")
    p.add_argument("--traces", default="/work/shared/traces")
    p.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args()
    commands = {"rotate": cmd_rotate, "resume": cmd_resume, "parallel": cmd_parallel}
    commands |= {"disk-full": cmd_disk_full, "traces": cmd_traces, "ranks": cmd_ranks}
    commands["vllm-disk"] = cmd_vllm_disk
    commands[args.part](args)


if __name__ == "__main__":
    main()

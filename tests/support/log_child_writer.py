"""Child writers for the SIGKILL tests (tests/faults/test_sigkill_writer.py), started by a
fork server.

``python tests/support/log_child_writer.py serve`` imports kvlog once, then reads commands on
stdin, one per line, and answers on stdout:

    run PATH SYNC SEED   fork a child that appends ``record_stream(SEED)`` to the log at
                         PATH with ``sync=SYNC`` and writes ``synced SEQ`` to stdout each
                         time an append returned with record SEQ durable (with
                         ``background``: handed to the OS, which a SIGKILL cannot take
                         back); answer ``pid PID``
    reap PID             wait for that child to end; answer ``reaped PID STATUS``

Forking from one warm process keeps each killed writer cheap (no interpreter start, no
imports), which lets the test kill many writers in a second or two.
"""

from __future__ import annotations

import os
import random
import sys
import traceback
from collections.abc import Iterator

from kvlog.events import (
    BlocksAllocated,
    CacheConfigured,
    Checkpoint,
    LoadRequested,
    Record,
    RequestFinished,
    StepEnded,
    StoreRequested,
    TransferFinished,
)
from kvlog.log import LogWriter, SyncMode

__all__ = ["record_stream", "serve"]

MAX_RECORDS = 200_000


def _step_records(rng: random.Random, step: int, job_id: int) -> list[Record]:
    """One scheduler step's worth of a plausible serving mix (not state-valid)."""
    out: list[Record] = []
    for _ in range(rng.randint(7, 19)):
        roll = rng.random()
        req_id = f"req-{rng.randrange(1000)}"
        if roll < 0.6:
            out.append(BlocksAllocated(req_id, rng.sample(range(4096), rng.randint(1, 16))))
        elif roll < 0.8:
            out.append(RequestFinished(req_id))
        elif roll < 0.99:
            ids = rng.sample(range(4096), rng.randint(1, 8))
            out.append(StoreRequested(job_id + len(out), ids, ids))
            out.append(TransferFinished(job_id + len(out) - 1, rng.random() < 0.95))
        else:  # rare large allocation: a frame over several pages
            out.append(BlocksAllocated(req_id, rng.sample(range(1 << 20), 1200)))
    if step % 50 == 49:
        out.append(Checkpoint(seq=step, digest="ab" * 32, step=step, snapshot=rng.randbytes(64)))
    out.append(StepEnded(step))
    return out


def record_stream(seed: int) -> Iterator[Record]:
    """The deterministic record sequence of child ``seed``; the test regenerates it."""
    rng = random.Random(seed)
    yield CacheConfigured(num_gpu_blocks=4096, block_size=16, num_cpu_blocks=1024)
    step = 0
    job_id = 0
    while True:
        records = _step_records(rng, step, job_id)
        job_id += len(records)
        yield from records
        if rng.random() < 0.05:
            yield LoadRequested(job_id, [1, 2], [3, 4])
            job_id += 1
        step += 1


def _run_writer(path: str, sync: SyncMode, seed: int) -> None:
    writer = LogWriter(path, sync)
    for count, record in enumerate(record_stream(seed)):
        seq = writer.append(record)
        if sync == "always" or isinstance(record, StepEnded):
            os.write(1, f"synced {seq}\n".encode())
        if count >= MAX_RECORDS:
            break
    writer.close()


def serve() -> None:
    """Answer ``run`` and ``reap`` commands until stdin closes."""
    for line in sys.stdin:
        command, *args = line.split()
        if command == "run":
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                code = 0
                try:
                    _run_writer(args[0], args[1], int(args[2]))  # type: ignore[arg-type]
                except BaseException:
                    traceback.print_exc()
                    code = 1
                finally:
                    os._exit(code)
            os.write(1, f"pid {pid}\n".encode())  # one write: a child's lines never split it
        elif command == "reap":
            _, status = os.waitpid(int(args[0]), 0)
            os.write(1, f"reaped {args[0]} {status}\n".encode())


if __name__ == "__main__":
    serve()

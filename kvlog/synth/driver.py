"""The synthetic serving loop: a vLLM-like scheduler that drives an Engine step by step.

Per step, in the DESIGN order:

1. transfers due this step finish (``TransferFinished``: simulated latencies, or the
   executor's result for exactly those jobs, so the log does not depend on timing);
2. requests that finished in the previous step are reported (``RequestFinished``); with
   offload, a finished request's full blocks are stored first (``StoreRequested``) and the
   request is reported finished only when its store is done (vLLM's offloading connector
   delays freeing the same way);
3. running requests get the blocks their next token needs (``BlocksAllocated``), preempting
   the newest running request when the pool is empty (``RequestPreempted``; it comes back
   later with a fresh table and recomputes);
4. waiting requests are admitted first come first served: prefix-cache hits are shared,
   CPU prefix hits are loaded (``LoadRequested``; the request waits for the load);
5. ``StepEnded``: the engine takes its defrag decision.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvlog.analysis.canary import CanaryReport, CanaryTracker
from kvlog.analysis.tally import RunResult, RunTally
from kvlog.events import (
    BlocksAllocated,
    Event,
    LoadRequested,
    RequestFinished,
    RequestPreempted,
    StepEnded,
    StoreRequested,
    TransferFinished,
)
from kvlog.reducers.transfers import expand_sub_blocks
from kvlog.runtime.engine import Engine
from kvlog.synth.pool import BlockPool, CpuCache
from kvlog.synth.workload import Request, SynthConfig, Workload

__all__ = [
    "PROGRESS_EVERY",
    "SimulatedJob",
    "SynthResult",
    "SynthRun",
    "defer_sigint",
    "step_boundaries",
]

_MAX_WAITING = 1024
PROGRESS_EVERY = 64
"""Steps between two progress reports of a synth loop."""


class _Deferral:
    """A SIGINT deferred to the next step boundary of a running synth loop."""

    active = 0  # synth loops running (nested: a loop inside a loop's run)
    pending = False  # a SIGINT came while one ran


_SIGINT = _Deferral()


def defer_sigint() -> bool:
    """For a SIGINT handler (``kvlog.cli.entry``): while a synth loop runs, note the interrupt
    and return True; the loop raises ``KeyboardInterrupt`` at the end of its current step,
    between two ``Engine.apply`` calls, so the log's last step is whole and ``close()``
    checkpoints a state that holds every logged event. False (raise now) otherwise."""
    if _SIGINT.active:
        _SIGINT.pending = True
        return True
    return False


def _boundary() -> None:
    if _SIGINT.pending:
        _SIGINT.pending = False
        raise KeyboardInterrupt


@contextlib.contextmanager
def step_boundaries() -> Iterator[Callable[[], None]]:
    """The region of a synth loop: yields the call that raises a deferred SIGINT (made at
    the end of every step); one deferred while finishing is raised on the way out."""
    _SIGINT.active += 1
    try:
        yield _boundary
    except BaseException:
        _SIGINT.active -= 1
        _SIGINT.pending = _SIGINT.pending and _SIGINT.active > 0
        raise
    _SIGINT.active -= 1
    _boundary()


@dataclass
class SynthResult(RunResult):
    """Counters of one synthetic run (what the Engine's machine did: ``RunResult``)."""

    config: SynthConfig
    log_path: str | None = None
    tally: RunTally = field(default_factory=RunTally)
    """What the Engine's machine did: an observer of it (``watch``)."""
    num_requests: int = 0
    num_finished: int = 0
    num_preemptions: int = 0
    num_prefix_hit_blocks: int = 0
    num_prefix_query_blocks: int = 0  # full prompt blocks looked up in the prefix cache
    num_loaded_blocks: int = 0
    num_failed_transfers: int = 0
    final_digest: str = ""
    canary_checks: list[CanaryReport] = field(default_factory=list)
    elapsed_s: float = 0.0
    num_clipped: int = 0  # trace requests cut to the longest request the pool takes
    simulated_s: float = 0.0  # trace runs: the serving time the steps stand for

    def watch(self, engine: Engine) -> None:
        """Sum up what ``engine``'s machine does from now on (and the ``CacheConfigured``
        it applied when it was built, before anything watched it)."""
        self.tally = RunTally(engine.config)
        self.tally.num_events = 1
        engine.machine.observers.append(self.tally)

    @property
    def canary_ok(self) -> bool:
        return all(report.ok for report in self.canary_checks)

    @property
    def prefix_hit_rate(self) -> float:
        """Share of the looked-up prompt blocks found in the GPU prefix cache."""
        if not self.num_prefix_query_blocks:
            return 0.0
        return self.num_prefix_hit_blocks / self.num_prefix_query_blocks

    def describe(self) -> str:
        """One line: the log, steps, requests, the digest (``kvlog synth`` prints more)."""
        canary = ""
        if self.canary_checks:
            canary = f", canary {'ok' if self.canary_ok else 'FAILED'}"
        return (
            f"{self.log_path or '(no log)'}: {self.num_steps:,} steps, {self.num_events:,} "
            f"events, {self.num_requests:,} requests ({self.num_finished:,} finished), digest "
            f"{self.final_digest[:16]}...{canary}"
        )

    def __repr__(self) -> str:
        """Short: the figures, not the config, summary and canary reports whole."""
        return (
            f"SynthResult(log_path={self.log_path!r}, num_steps={self.num_steps}, "
            f"num_events={self.num_events}, num_requests={self.num_requests}, "
            f"final_digest={self.final_digest[:16]!r}..., canary_ok={self.canary_ok})"
        )


@dataclass
class SimulatedJob:
    """A transfer the synthetic loop has submitted: it finishes at ``due_step`` with
    ``success`` (the simulated device's outcome, drawn when it was submitted)."""

    kind: str
    req: Request
    due_step: int
    success: bool
    cpu_blocks: list[int]
    gpu_blocks: list[int]


class SynthRun:
    """One synthetic run on one engine (the engine's executor, if any, moves real bytes)."""

    def __init__(
        self,
        config: SynthConfig,
        engine: Engine,
        tracker: CanaryTracker | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        self.config = config
        self.progress = progress
        """Called as ``progress(done, total)`` now and then (steps; a trace: requests)."""
        self.engine = engine
        self.tracker = tracker
        self.workload = Workload(config)
        self.rng = np.random.default_rng([config.seed, 1])
        self.pool = BlockPool(config.num_gpu_blocks, config.prefix_caching)
        self.cpu = CpuCache(config.num_cpu_blocks) if config.num_cpu_blocks else None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.just_finished: list[Request] = []  # finished decoding in the previous step
        self.stored: list[Request] = []  # their store finished this step
        self.jobs: dict[int, SimulatedJob] = {}
        self.next_job_id = 0
        self.last_due = {"store": -1, "load": -1}
        self.result = SynthResult(config, engine.log_path)
        cap = (config.num_gpu_blocks - 1 - config.watermark_blocks) * config.block_size // 2
        self.max_tokens = max(cap, config.block_size)
        self.result.watch(engine)
        if tracker is not None:  # sees every event, the polled TransferFinished too
            engine.machine.observers.append(tracker)

    # -- emitting ------------------------------------------------------------------------
    def emit(self, event: Event) -> None:
        """One scheduler input to the engine (the observers count it and track canaries)."""
        self.engine.apply(event)

    # -- the loop ------------------------------------------------------------------------
    def run(self) -> SynthResult:
        started = time.perf_counter()
        with step_boundaries() as boundary:
            for step in range(self.config.steps):
                self.step(step)
                every = self.config.check_every
                if self.tracker is not None and every and (step + 1) % every == 0:
                    self.result.canary_checks.append(self.tracker.check(self.engine.state))
                if self.progress is not None and step % PROGRESS_EVERY == 0:
                    self.progress(step + 1, self.config.steps)
                boundary()
            if self.progress is not None:
                self.progress(self.config.steps, self.config.steps)
            self.finish()
        self.result.elapsed_s = time.perf_counter() - started
        return self.result

    def step(self, step: int) -> None:
        for req in self.workload.arrivals(step):
            if len(self.waiting) >= _MAX_WAITING:
                continue  # the queue is full: the request is turned away
            self._clip(req)
            self.waiting.append(req)
            self.result.num_requests += 1
        self._complete_transfers(step)
        self._report_finished(step)
        self._schedule_running()
        self._admit(step)
        self._advance()
        self.emit(StepEnded(step=step))

    def _clip(self, req: Request) -> None:
        """Keep every request small enough to fit the pool alone (else it could never run)."""
        if req.prompt_len + req.output_len > self.max_tokens:
            req.prompt_len = max(1, min(req.prompt_len, self.max_tokens // 2))
            req.output_len = max(1, self.max_tokens - req.prompt_len)
            if req.prefix_blocks * self.config.block_size >= req.prompt_len:
                req.prefix_id, req.prefix_blocks = -1, 0

    def finish(self) -> None:
        """Let every transfer finish, check canaries, record the digest."""
        if self.jobs:
            self._complete_transfers(self.config.steps, everything=True)
        if self.tracker is not None:
            self.result.canary_checks.append(self.tracker.check(self.engine.state))
        self.result.final_digest = self.engine.digest()

    # -- transfers -----------------------------------------------------------------------
    def _submit(
        self, kind: str, req: Request, step: int, cpu_blocks: list[int], gpu_blocks: list[int]
    ) -> int:
        c = self.config
        job_id = self.next_job_id
        self.next_job_id += 1
        mean = c.store_latency_steps if kind == "store" else c.load_latency_steps
        due = max(step + 1 + int(self.rng.poisson(mean)), self.last_due[kind])
        self.last_due[kind] = due
        success = bool(self.rng.random() >= c.transfer_failure_rate)
        self.jobs[job_id] = SimulatedJob(kind, req, due, success, cpu_blocks, gpu_blocks)
        if kind == "store":
            self.emit(
                StoreRequested(job_id=job_id, gpu_block_ids=gpu_blocks, cpu_block_ids=cpu_blocks)
            )
        else:
            self.emit(
                LoadRequested(job_id=job_id, cpu_block_ids=cpu_blocks, gpu_block_ids=gpu_blocks)
            )
            self.result.num_loaded_blocks += len(gpu_blocks)
        return job_id

    def _complete_transfers(self, step: int, everything: bool = False) -> None:
        """Finish transfers: what the executor reports (polled each step), or, without one,
        the jobs whose simulated latency is over."""
        if self.engine.executor is not None:
            results = self.engine.wait() if everything else self.engine.poll()
            for result in results:
                self._transfer_done(self.jobs.pop(result.job_id), result.success)
            return
        for job_id in [j for j, job in self.jobs.items() if everything or job.due_step <= step]:
            job = self.jobs.pop(job_id)
            self.emit(TransferFinished(job_id=job_id, success=job.success))
            self._transfer_done(job, job.success)

    def _transfer_done(self, job: SimulatedJob, success: bool) -> None:
        if not success:
            self.result.num_failed_transfers += 1
        self._cpu_done(job, success)
        if job.kind == "store":
            self.stored.append(job.req)  # reported finished in this step
            return
        req = job.req
        req.status = "running"
        if not success and self.tracker is not None:
            self.tracker.write(self.engine.state, job.gpu_blocks)  # recomputed instead
        req.load_blocks = []
        self._register(req)

    def _cpu_done(self, job: SimulatedJob, success: bool) -> None:
        """The CPU cache learns that a transfer finished (a store's blocks are readable or
        dropped; a load's are unpinned)."""
        assert self.cpu is not None, "a transfer without a CPU cache"
        if job.kind == "store":
            self.cpu.stored(job.cpu_blocks, success)
        else:
            self.cpu.unpin(job.cpu_blocks)

    def _pin_for_load(self, req: Request, hits: list[Any]) -> list[int]:
        """Pin the CPU hits ``_cpu_hits`` found for a load; the CPU blocks it reads."""
        assert self.cpu is not None, "CPU hits without a CPU cache"
        self.cpu.pin(hits)
        return hits

    # -- finishing -----------------------------------------------------------------------
    def _report_finished(self, step: int) -> None:
        """RequestFinished for last step's finished requests, stores first where offloading."""
        done, self.stored = self.stored, []
        to_store: list[tuple[Request, list[int], list[int]]] = []
        for req in self.just_finished:
            gpu, cpu = self._store_plan(req)
            if gpu:
                to_store.append((req, gpu, cpu))
            else:
                done.append(req)
        self.just_finished = []
        for req in done:
            self._release(req, RequestFinished(req_id=req.req_id))
            req.status = "done"
            self.result.num_finished += 1
        for req, gpu, cpu in to_store:
            req.status = "storing"
            self._submit("store", req, step, cpu, gpu)

    def _store_plan(self, req: Request) -> tuple[list[int], list[int]]:
        """GPU blocks of the request's full block groups not yet on CPU, and their CPU blocks."""
        if self.cpu is None:
            return [], []
        factor = self.config.block_size_factor
        num_full = min(req.num_tokens // self.config.block_size, len(req.blocks))
        keys, groups = [], []
        for g in range(num_full // factor):
            key = req.group_key(g, factor)
            if not self.cpu.contains(key):
                keys.append(key)
                groups.append(g)
        cpu_blocks = self.cpu.reserve(keys)
        gpu = [req.blocks[g * factor + k] for g in groups[: len(cpu_blocks)] for k in range(factor)]
        return gpu, cpu_blocks

    def _release(self, req: Request, event: RequestFinished | RequestPreempted) -> None:
        self.emit(event)
        self.pool.free(req.blocks)
        req.blocks = []
        req.num_cached = 0

    # -- running requests ----------------------------------------------------------------
    def _blocks_needed(self, req: Request) -> int:
        bs = self.config.block_size
        return -(-req.num_tokens // bs) - len(req.blocks)

    def _schedule_running(self) -> None:
        """Blocks for each running request's next token, preempting the newest when short."""
        i = 0
        while i < len(self.running):
            req = self.running[i]
            if req.status != "running":
                i += 1
                continue
            need = self._blocks_needed(req)
            while need > self.pool.num_free:
                victim = self._victim()
                if victim is None:
                    break
                self._preempt(victim)
                if victim is req:
                    break
            if req.status == "running" and 0 < need <= self.pool.num_free:
                new = self.pool.allocate(need)
                req.blocks.extend(new)
                self.emit(BlocksAllocated(req_id=req.req_id, block_ids=new))
            if req in self.running:
                i += 1

    def _victim(self) -> Request | None:
        """The newest running request that is not waiting for a load."""
        for req in reversed(self.running):
            if req.status == "running":
                return req
        return None

    def _preempt(self, req: Request) -> None:
        self._release(req, RequestPreempted(req_id=req.req_id))
        self.running.remove(req)
        req.status = "waiting"
        req.num_preemptions += 1
        self.result.num_preemptions += 1
        self.waiting.appendleft(req)

    def _advance(self) -> None:
        """Every running request computes one token; finished ones leave the batch."""
        still = []
        for req in self.running:
            if req.status != "running":
                still.append(req)
                continue
            req.generated += 1
            self._register(req)
            if req.generated >= req.output_len:
                req.status = "finished"
                self.just_finished.append(req)
            else:
                still.append(req)
        self.running = still

    def _register(self, req: Request) -> None:
        """Put the request's computed full prefix blocks into the prefix cache."""
        if not self.config.prefix_caching:
            return
        limit = min(req.prefix_blocks, len(req.blocks))
        for i in range(req.num_cached, limit):
            self.pool.cache(req.blocks[i], req.prefix_hash(i))
        req.num_cached = max(req.num_cached, limit)

    # -- admission -----------------------------------------------------------------------
    def _admit(self, step: int) -> None:
        """Admit waiting requests in order while the batch and the pool have room."""
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if not self._try_admit(req, step):
                break
            self.waiting.popleft()
            self.running.append(req)

    def _try_admit(self, req: Request, step: int) -> bool:
        bs = self.config.block_size
        total = -(-req.num_tokens // bs)
        num_prefix = min(req.prefix_blocks, total - 1)
        hits = self.pool.lookup([req.prefix_hash(i) for i in range(num_prefix)])
        new = total - len(hits)
        if (
            self.pool.num_free - self.pool.num_reclaimed_by(hits)
            < new + self.config.watermark_blocks
        ):
            return False
        cpu_hits, num_load = self._cpu_hits(req, len(hits), num_prefix)
        self.pool.touch(hits)
        fresh = self.pool.allocate(new)
        req.blocks = hits + fresh
        req.num_cached = len(hits)
        self.result.num_prefix_hit_blocks += len(hits)
        self.result.num_prefix_query_blocks += num_prefix if self.config.prefix_caching else 0
        self.emit(BlocksAllocated(req_id=req.req_id, block_ids=list(req.blocks)))
        if num_load:
            cpu_blocks = self._pin_for_load(req, cpu_hits)
            req.load_blocks = fresh[:num_load]
            req.status = "loading"
            req.load_job = self._submit("load", req, step, cpu_blocks, req.load_blocks)
        else:
            req.status = "running"
        return True

    def _cpu_hits(self, req: Request, start: int, num_prefix: int) -> tuple[list[Any], int]:
        """CPU blocks holding the prefix from GPU block ``start`` on, and the GPU blocks to load.

        A group only partly covered by GPU hits is loaded without its first sub-blocks
        (the skip rule of ``block_size_factor``).
        """
        if self.cpu is None:
            return [], 0
        factor = self.config.block_size_factor
        first = start // factor
        keys = []
        for g in range(first, num_prefix // factor):
            keys.append(req.group_key(g, factor))
        hits = self.cpu.lookup(keys)
        # the sub-blocks of the hits but the first group's ones the GPU hits already hold
        num_load = expand_sub_blocks(np.asarray(hits, np.int64), factor, start % factor).size
        if num_load <= 0:
            return [], 0
        return hits, num_load

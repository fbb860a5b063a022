"""A public request trace through a vLLM-like scheduler and block pool, recorded as a log.

The trace gives each request's arrival time, input and output lengths and (Mooncake) the
hashes of its 512-token prompt blocks. Time is cut into scheduler steps of ``step_ms``
simulated milliseconds; ``time_scale`` stretches (> 1) or compresses (< 1) the trace's
clock. Per step, in the DESIGN order:

1. requests that arrived by now join the waiting queue; transfers due now finish;
2. requests that finished in the previous step are reported (``RequestFinished``); with
   offload their full block groups are stored first and they are reported when the store
   is done (as ``kvlog synth`` does);
3. the running requests are scheduled first come first served under a token budget
   (``max_num_batched_tokens``; a prompt is prefilled in chunks, a decode takes one token),
   each getting the blocks its tokens need (``BlocksAllocated``); when the pool is short the
   newest running request is preempted (``RequestPreempted``) and recomputes later;
4. unless someone was preempted in this step, waiting requests are admitted in order while
   the budget and ``max_num_seqs`` allow: prefix-cache hits are shared, CPU hits loaded;
5. the scheduled tokens are computed, full blocks enter the prefix cache, a request whose
   known tokens are all computed samples one more; ``StepEnded``.

The GPU pool follows vLLM's ``BlockPool`` (see ``shared/traces/README.md``): allocation pops
the head of the free queue; a request's blocks are freed in reverse order, those without a
hash to the head of the queue, hashed (cached) ones to the tail; block 0 is the null block;
a prefix hit walks the block hashes from block 0 and stops at the first miss, and a hit
block with ref count 0 leaves the free queue. Only full blocks are hashed: Mooncake prompt
blocks by their ``hash_ids`` (shared across requests), every other full block by a key of
its own request (so a preempted request finds its own blocks again, as in vLLM).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from kvlog.analysis.canary import CanaryTracker
from kvlog.errors import ConfigError, TraceError
from kvlog.events import BlocksAllocated, StepEnded
from kvlog.runtime.engine import Engine
from kvlog.synth.driver import SimulatedJob, SynthResult, SynthRun, step_boundaries
from kvlog.synth.pool import BlockPool
from kvlog.synth.traces import HASH_BLOCK_TOKENS, TraceRequest, block_keys
from kvlog.synth.workload import Request, SynthConfig

__all__ = [
    "STALL_STEPS",
    "TRACE_DEFAULTS",
    "TraceConfig",
    "TraceLive",
    "TraceRun",
    "VllmBlockPool",
    "bytes_per_token",
    "trace_geometry",
]

STALL_STEPS = 10_000
"""Steps in a row without a computed token or a transfer after which a trace run is refused."""


def bytes_per_token(
    num_layers: int = 32, num_kv_heads: int = 8, head_size: int = 128, dtype_bytes: int = 2
) -> int:
    """KV bytes of one token over all layers (defaults: Llama-3.1-8B in bf16, 128 KiB)."""
    return 2 * num_layers * num_kv_heads * head_size * dtype_bytes


TRACE_DEFAULTS = {"num_gpu_blocks": 4096, "block_size": 128}
"""Geometry of trace runs when not given (real prompts are long: 128-token blocks); the
page is :func:`bytes_per_token` times the block size."""


def trace_geometry(
    num_gpu_blocks: int | None = None,
    block_size: int | None = None,
    page_size_bytes: int | None = None,
) -> dict[str, int]:
    """``num_gpu_blocks``, ``block_size`` and ``page_size_bytes`` of a trace run, each
    :data:`TRACE_DEFAULTS`'s where not given (``None``; 0 is a value, refused later), for
    ``SynthConfig(**trace_geometry(...))`` or ``config.replace(...)``."""
    blocks = TRACE_DEFAULTS["num_gpu_blocks"] if num_gpu_blocks is None else num_gpu_blocks
    size = TRACE_DEFAULTS["block_size"] if block_size is None else block_size
    page = bytes_per_token() * size if page_size_bytes is None else page_size_bytes
    return {"num_gpu_blocks": blocks, "block_size": size, "page_size_bytes": page}


@dataclass(frozen=True)
class TraceConfig:
    """A trace run: the pool, policy and offload of ``synth`` plus the scheduler's limits."""

    synth: SynthConfig
    trace_format: str = "mooncake"
    time_scale: float = 1.0
    step_ms: float = 50.0
    max_num_batched_tokens: int = 8192
    max_model_len: int = 0  # 0: half the pool's tokens
    max_steps: int = 1_000_000

    def model_len(self) -> int:
        """Longest request (prompt and output) in tokens; longer ones are clipped."""
        c = self.synth
        return self.max_model_len or max((c.num_gpu_blocks - 1) * c.block_size // 2, 2)

    def arrival_step(self, arrival_s: float) -> int:
        return int(arrival_s * self.time_scale * 1000.0 / self.step_ms)

    def check(self, requests: Sequence[TraceRequest]) -> None:
        """Refuse (:class:`~kvlog.errors.ConfigError`, naming the flag) a run that cannot
        progress or cannot end within ``max_steps``, before anything is logged: a clock that
        is not a finite positive number, no token budget, a model length no request fits in
        or whose blocks the pool cannot hold, a trace whose last arrival is past the limit,
        ``hash_ids`` with a block size that does not divide their 512 tokens, a trace of
        no requests (a log of no traffic records nothing: ``TraceError``)."""
        if not requests:
            raise TraceError("the trace holds no requests")
        self.synth.check()
        c = self.synth
        if requests[0].hash_ids and HASH_BLOCK_TOKENS % c.block_size:
            raise TraceError(
                f"--block-size {c.block_size} must divide {HASH_BLOCK_TOKENS} for hash_ids"
            )
        for flag, value in (("--time-scale", self.time_scale), ("--step-ms", self.step_ms)):
            if not isinstance(value, int | float) or not (math.isfinite(value) and value > 0):
                raise ConfigError(flag, value, "a finite number > 0")
        if type(self.max_num_batched_tokens) is not int or self.max_num_batched_tokens < 1:
            raise ConfigError(
                "--max-num-batched-tokens", self.max_num_batched_tokens, "an int >= 1"
            )
        usable = (c.num_gpu_blocks - 1) * c.block_size  # block 0 is the null block
        if (
            type(self.max_model_len) is not int
            or self.max_model_len not in range(0, usable + 1)
            or self.max_model_len == 1
        ):
            raise ConfigError(
                "--max-model-len",
                self.max_model_len,
                f"0 (half the pool) or 2 .. {usable}: a prompt and an output token, at most "
                f"the {c.num_gpu_blocks - 1} usable blocks of {c.block_size} tokens, or no "
                "request ever runs",
            )
        if any(a.arrival_s > b.arrival_s for a, b in itertools.pairwise(requests)):
            raise TraceError("trace requests must come in arrival order (read_trace sorts them)")
        if requests:
            last = self.arrival_step(requests[-1].arrival_s)
            if last >= self.max_steps:
                raise ConfigError(
                    "--time-scale/--step-ms",
                    (self.time_scale, self.step_ms),
                    f"a clock that brings the last arrival ({requests[-1].arrival_s:,.1f} s) "
                    f"before step {self.max_steps:,}; it comes at step {last:,}",
                )


class VllmBlockPool(BlockPool):
    """GPU blocks as vLLM's ``BlockPool`` keeps them (see the module docstring); the same
    interface as the synthetic workload's :class:`BlockPool`."""

    def __init__(self, num_gpu_blocks: int, prefix_caching: bool) -> None:
        super().__init__(num_gpu_blocks, prefix_caching)
        self._blocks_of_key: dict[Hashable, dict[int, None]] = {}

    def free_queue(self) -> list[int]:
        """The free queue from its head (allocated next) to its tail."""
        return list(self._free)

    def lookup(self, hashes: Sequence[Hashable]) -> list[int]:
        """Cached blocks of the longest prefix of ``hashes`` (a key's first block)."""
        hits: list[int] = []
        if not self.prefix_caching:
            return hits
        for key in hashes:
            blocks = self._blocks_of_key.get(key)
            if not blocks:
                break
            hits.append(next(iter(blocks)))
        return hits

    def allocate(self, num_blocks: int) -> list[int]:
        """``num_blocks`` from the head of the free queue, their cached hashes evicted."""
        if num_blocks > len(self._free):
            raise ValueError(f"allocate({num_blocks}) with {len(self._free)} blocks free")
        out = []
        for _ in range(num_blocks):
            b, _ = self._free.popitem(last=False)
            key = self._hash_of.pop(b, None)
            if key is not None:
                same = self._blocks_of_key[key]
                del same[b]
                if not same:
                    del self._blocks_of_key[key]
                self.num_evictions += 1
            self.refs[b] = 1
            out.append(b)
        return out

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference per block, the table in reverse: blocks reaching 0 without a
        hash go to the head of the free queue (keeping that order), hashed ones to the tail."""
        head: list[int] = []
        for b in reversed(blocks):
            if self.refs[b] <= 0:
                raise ValueError(f"block {b} freed more often than allocated")
            self.refs[b] -= 1
            if self.refs[b] == 0:
                if b in self._hash_of:
                    self._free[b] = None
                else:
                    head.append(b)
        for b in reversed(head):
            self._free[b] = None
            self._free.move_to_end(b, last=False)

    def cache(self, block_id: int, block_hash: Hashable) -> None:
        """Hash a computed full block; vLLM keeps duplicates of a key (a hit takes the first)."""
        if not self.prefix_caching or block_id in self._hash_of:
            return
        self._hash_of[block_id] = block_hash
        self._blocks_of_key.setdefault(block_hash, {})[block_id] = None


@dataclass(eq=False)
class TraceLive(Request):
    """A trace request inside the scheduler; ``prompt_len`` / ``output_len`` are the trace's
    lengths (clipped to the model length), ``prefix_id`` is unused (-1)."""

    trace: TraceRequest = field(default_factory=lambda: TraceRequest(0.0, 1, 1))
    block_size: int = 16
    computed: int = 0  # tokens whose KV is computed
    scheduled: int = 0  # tokens computed in this step
    load_target: int = 0  # ``computed`` once the load in flight lands
    _keys: list[Hashable] = field(default_factory=list)  # block keys known so far

    def keys(self, num_tokens: int) -> list[Hashable]:
        """Content keys of the full blocks of the first ``num_tokens`` tokens."""
        return self._known(num_tokens // self.block_size)[: num_tokens // self.block_size]

    def group_key(self, group: int, factor: int) -> tuple[Hashable, ...]:  # type: ignore[override]
        """CPU cache key of GPU blocks ``group*factor .. group*factor+factor-1``."""
        end = (group + 1) * factor
        return tuple(self._known(end)[group * factor : end])

    def _known(self, num_blocks: int) -> list[Hashable]:
        """The key list, grown to at least ``num_blocks`` keys (keys never change)."""
        if len(self._keys) < num_blocks:
            num_tokens = max(num_blocks, 2 * len(self._keys)) * self.block_size
            self._keys = block_keys(self.trace, self.serial, self.block_size, num_tokens)
        return self._keys


class TraceRun(SynthRun):
    """The serving loop of the module docstring over one engine (transfers, finishing and
    preemption bookkeeping as in :class:`SynthRun`)."""

    def __init__(
        self,
        config: TraceConfig,
        requests: Sequence[TraceRequest],
        engine: Engine,
        tracker: CanaryTracker | None = None,
    ) -> None:
        super().__init__(config.synth, engine, tracker)
        self.trace_config = config
        self.pool = VllmBlockPool(config.synth.num_gpu_blocks, config.synth.prefix_caching)
        self.pending: deque[TraceRequest] = deque(requests)
        self.num_trace_requests = len(requests)
        self._computed_this_step = False
        self._stalled = 0

    # -- the loop ------------------------------------------------------------------------
    def run(self) -> SynthResult:
        started = time.perf_counter()
        with step_boundaries() as boundary:
            step = self._serve(boundary)
            self.result.simulated_s = step * self.trace_config.step_ms / 1000.0
            self.finish()
        self.result.elapsed_s = time.perf_counter() - started
        return self.result

    def _serve(self, boundary: Callable[[], None]) -> int:
        """Steps until every request finished; returns the step after the last one."""
        step, every = 0, self.config.check_every
        limit = self.trace_config.max_steps
        while self.pending or self._busy():
            if not self._busy():
                step = max(step, self.trace_config.arrival_step(self.pending[0].arrival_s))
            if step >= limit:
                raise TraceError(
                    f"the trace did not finish within {limit:,} steps of "
                    f"{self.trace_config.step_ms} ms: not served (raise --step-ms or lower "
                    "--time-scale)"
                )
            self.step(step)
            self._check_progress(step)
            if self.tracker is not None and every and self.result.num_steps % every == 0:
                self.result.canary_checks.append(self.tracker.check(self.engine.state))
            step += 1
            boundary()
        return step

    def _busy(self) -> bool:
        return bool(self.waiting or self.running or self.jobs or self.just_finished or self.stored)

    def _check_progress(self, step: int) -> None:
        """Refuse a run that stalls: ``STALL_STEPS`` steps in a row that computed no token
        while no transfer was in flight cannot end (the requests never fit)."""
        if self._computed_this_step or self.jobs or not self._busy():
            self._stalled = 0
            return
        self._stalled += 1
        if self._stalled >= STALL_STEPS:
            waiting = self.waiting[0] if self.waiting else None
            what = f"request {waiting.req_id} ({waiting.num_tokens} tokens)" if waiting else "it"
            raise TraceError(
                f"no progress for {STALL_STEPS:,} steps up to step {step:,}: {what} never fits "
                f"the pool of {self.config.num_gpu_blocks} blocks under --max-num-seqs "
                f"{self.config.max_num_seqs} and --max-num-batched-tokens "
                f"{self.trace_config.max_num_batched_tokens}"
            )

    def step(self, step: int) -> None:
        self._arrive(step)
        self._complete_transfers(step)
        self._report_finished(step)
        budget, preempted = self._schedule_budget(self.trace_config.max_num_batched_tokens)
        if not preempted:
            self._admit_traced(step, budget)
        self._advance()
        self.emit(StepEnded(step=step))

    def _arrive(self, step: int) -> None:
        """Trace requests that arrived by ``step`` join the waiting queue."""
        while self.pending and self.trace_config.arrival_step(self.pending[0].arrival_s) <= step:
            self.waiting.append(self._live(self.pending.popleft()))
            self.result.num_requests += 1

    def _live(self, trace: TraceRequest) -> TraceLive:
        serial = self.result.num_requests
        prompt, output = trace.input_len, trace.output_len
        longest = self.trace_config.model_len()
        if prompt + output > longest:
            self.result.num_clipped += 1
            output = min(output, max(1, longest // 4))
            prompt = longest - output
        bs = self.config.block_size
        trace = dataclasses.replace(trace, input_len=prompt)  # clipped: the rest is generated
        return TraceLive(f"req-{serial}", serial, prompt, output, -1, 0, trace=trace, block_size=bs)

    # -- running requests ----------------------------------------------------------------
    def _schedule_budget(self, budget: int) -> tuple[int, bool]:
        """Tokens and blocks for the running requests in order; the newest running request
        is preempted while the pool is short. Returns the budget left and whether anyone
        was preempted."""
        preempted, i = False, 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.status != "running" or not isinstance(req, TraceLive):
                i += 1
                continue
            new = min(req.num_tokens - req.computed, budget)
            need = self._blocks_for(req, req.computed + new)
            while need > self.pool.num_free:
                victim = self._victim()
                if victim is None:
                    break
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if req.status != "running":
                continue  # it preempted itself and left the list
            if need > self.pool.num_free:
                i += 1
                continue
            self._grow(req, need)
            req.scheduled, budget, i = new, budget - new, i + 1
        return budget, preempted

    def _blocks_for(self, req: Request, num_tokens: int) -> int:
        return -(-num_tokens // self.config.block_size) - len(req.blocks)

    def _grow(self, req: Request, need: int) -> None:
        if need > 0:
            new = self.pool.allocate(need)
            req.blocks.extend(new)
            self.emit(BlocksAllocated(req_id=req.req_id, block_ids=new))

    def _preempt(self, req: Request) -> None:
        super()._preempt(req)
        if isinstance(req, TraceLive):
            req.computed = req.scheduled = 0

    def _advance(self) -> None:
        """Scheduled tokens are computed; full blocks are cached; a request with all its
        tokens computed samples one more; finished requests leave the batch."""
        still: list[Request] = []
        self._computed_this_step = False
        for req in self.running:
            if not isinstance(req, TraceLive) or req.status != "running" or not req.scheduled:
                still.append(req)
                continue
            self._computed_this_step = True
            req.computed += req.scheduled
            req.scheduled = 0
            self._register(req)
            if req.computed >= req.num_tokens:
                req.generated += 1
                if req.generated >= req.output_len:
                    req.status = "finished"
                    self.just_finished.append(req)
                    continue
            still.append(req)
        self.running = still

    def _register(self, req: Request) -> None:
        """Hash the request's computed full blocks into the prefix cache."""
        if not self.config.prefix_caching or not isinstance(req, TraceLive):
            return
        num_full = min(req.computed // self.config.block_size, len(req.blocks))
        if num_full <= req.num_cached:
            return
        keys = req.keys(num_full * self.config.block_size)
        for i in range(req.num_cached, num_full):
            self.pool.cache(req.blocks[i], keys[i])
        req.num_cached = num_full

    # -- admission -----------------------------------------------------------------------
    def _admit_traced(self, step: int, budget: int) -> None:
        """Admit waiting requests in order while the budget, the batch and the pool allow."""
        while self.waiting and len(self.running) < self.config.max_num_seqs and budget > 0:
            req = self.waiting[0]
            if not isinstance(req, TraceLive) or not self._try_admit_traced(req, step, budget):
                break
            self.waiting.popleft()
            self.running.append(req)
            budget -= req.scheduled

    def _try_admit_traced(self, req: TraceLive, step: int, budget: int) -> bool:
        bs = self.config.block_size
        num_query = (req.num_tokens - 1) // bs  # vLLM always computes the last token
        keys = req.keys(num_query * bs) if self.config.prefix_caching else []
        hits = self.pool.lookup(keys)
        cpu_hits, num_load = self._cpu_hits(req, len(hits), num_query)
        loaded = len(hits) + num_load
        new = 0 if num_load else min(req.num_tokens - len(hits) * bs, budget)
        need = max(loaded, -(-(len(hits) * bs + new) // bs)) - len(hits)
        if self.pool.num_free - self.pool.num_reclaimed_by(hits) < need:
            return False
        self.pool.touch(hits)
        fresh = self.pool.allocate(need)
        req.blocks, req.num_cached = hits + fresh, len(hits)
        req.computed, req.scheduled = len(hits) * bs, new
        self.result.num_prefix_hit_blocks += len(hits)
        self.result.num_prefix_query_blocks += len(keys)
        self.emit(BlocksAllocated(req_id=req.req_id, block_ids=list(req.blocks)))
        if num_load:
            assert self.cpu is not None, "CPU hits without a CPU cache"
            self.cpu.pin(cpu_hits)
            req.load_blocks, req.load_target = fresh[:num_load], loaded * bs
            req.status = "loading"
            req.load_job = self._submit("load", req, step, cpu_hits, req.load_blocks)
        else:
            req.status = "running"
        return True

    def _transfer_done(self, job: SimulatedJob, success: bool) -> None:
        if job.kind == "load" and success and isinstance(job.req, TraceLive):
            job.req.computed = job.req.load_target
        super()._transfer_done(job, success)

"""``kvlog synth --trace ... --scheduler vllm``: a trace through vLLM's own v1 scheduler.

Where vLLM (0.33) is installed, its ``Scheduler`` (KVCacheManager, BlockPool, chunked
prefill, preemption, prefix caching) runs on CPU with no model, the way vLLM's own tests
build it; a stub runner samples one token for every request whose prompt is done. Each
step becomes kvlog events the way the Gaudi runner reports them: the requests vLLM reports
finished (``RequestFinished``) and preempted (``RequestPreempted``), then the blocks of new
requests, of requests resumed after preemption (a fresh table) and the blocks running
requests gained (``BlocksAllocated``), then ``StepEnded``. Prompt tokens come from the
trace: a Mooncake ``hash_ids`` entry stands for 512 tokens derived from the id alone, so
equal ids give equal tokens and vLLM's own block hashes find the prefix hits; Azure prompts
are unique per request. No offload here (vLLM's connector needs a worker; see
``tests/vllm_harness.py`` for that flow). vLLM is not a dependency: without it,
``MissingExtra`` says so.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from kvlog.errors import MissingExtra
from kvlog.events import (
    BlocksAllocated,
    RequestFinished,
    RequestPreempted,
    StepEnded,
)
from kvlog.runtime.engine import Engine
from kvlog.synth.driver import SynthResult
from kvlog.synth.serving import TraceConfig
from kvlog.synth.traces import HASH_BLOCK_TOKENS, TraceRequest
from kvlog.synth.vllm_stubs import VOCAB, build_scheduler, make_request
from kvlog.util import vllm_compat
from kvlog.util.splitmix import splitmix64

__all__ = ["VllmTraceRun", "prompt_tokens", "trace_scheduler"]


def prompt_tokens(request: TraceRequest, serial: int, length: int) -> list[int]:
    """``length`` prompt token ids: from the ``hash_ids`` (equal ids, equal tokens), else
    unique to ``serial``."""
    if request.hash_ids:
        out: list[int] = []
        for h in request.hash_ids:
            out.extend(splitmix64((h << 10) | t) % VOCAB for t in range(HASH_BLOCK_TOKENS))
            if len(out) >= length:
                break
        return out[:length]
    return [splitmix64((serial << 32) | t) % VOCAB for t in range(length)]


def trace_scheduler(config: TraceConfig) -> Any:
    """vLLM's ``Scheduler`` for the trace's pool and limits (no connector, no model); built
    before the log is created, so a missing vLLM leaves no log behind."""
    c = config.synth
    try:
        return build_scheduler(
            num_gpu_blocks=c.num_gpu_blocks,
            block_size=c.block_size,
            max_model_len=config.model_len(),
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=c.max_num_seqs,
            prefix_caching=c.prefix_caching,
            model="kvlog-trace-stub",
        )[2]
    except MissingExtra as exc:
        raise MissingExtra("vllm", "vllm", "--scheduler vllm") from exc


class VllmTraceRun:
    """One trace through vLLM's scheduler, recorded on ``engine`` (see the module docstring)."""

    def __init__(
        self,
        config: TraceConfig,
        requests: Sequence[TraceRequest],
        engine: Engine,
        scheduler: Any = None,
    ) -> None:
        self.config = config
        self.engine = engine
        self.scheduler = trace_scheduler(config) if scheduler is None else scheduler
        self.pending: deque[tuple[int, TraceRequest]] = deque(enumerate(requests))
        self.result = SynthResult(config.synth, engine.log_path)
        self.result.watch(engine)

    def run(self) -> SynthResult:
        started = time.perf_counter()
        step = 0
        while step < self.config.max_steps and (self.pending or self.scheduler.has_requests()):
            if not self.scheduler.has_requests():
                step = max(step, self.config.arrival_step(self.pending[0][1].arrival_s))
            self._arrive(step)
            self.step(step)
            step += 1
        self.result.simulated_s = step * self.config.step_ms / 1000.0
        self.result.final_digest = self.engine.digest()
        self.result.elapsed_s = time.perf_counter() - started
        return self.result

    def _arrive(self, step: int) -> None:
        longest = self.config.model_len()
        while self.pending and self.config.arrival_step(self.pending[0][1].arrival_s) <= step:
            serial, trace = self.pending.popleft()
            prompt, output = trace.input_len, trace.output_len
            if prompt + output > longest:
                self.result.num_clipped += 1
                output = min(output, max(1, longest // 4))
                prompt = longest - output
            tokens = prompt_tokens(trace, serial, prompt)
            bs = self.config.synth.block_size
            self.scheduler.add_request(make_request(f"req-{serial}", tokens, output, bs))
            self.result.num_requests += 1

    def step(self, step: int) -> None:
        so = self.scheduler.schedule()
        for req_id in sorted(so.finished_req_ids):
            self._emit(RequestFinished(req_id=req_id))
        for req_id in sorted(so.preempted_req_ids or ()):
            self._emit(RequestPreempted(req_id=req_id))
            self.result.num_preemptions += 1
        self._allocations(so)
        self._emit(StepEnded(step=step))
        for outputs in self.scheduler.update_from_output(so, self._runner_output(so)).values():
            for out in outputs.outputs:
                self.result.num_finished += out.finish_reason is not None

    def _allocations(self, so: Any) -> None:
        bs = self.config.synth.block_size
        for new in so.scheduled_new_reqs:
            self._admitted(new.req_id, new.num_computed_tokens, bs)
            if new.block_ids and new.block_ids[0]:
                self._emit(BlocksAllocated(req_id=new.req_id, block_ids=list(new.block_ids[0])))
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            blocks = cached.new_block_ids[i]
            if req_id in vllm_compat.resumed_req_ids(cached):
                self._admitted(req_id, cached.num_computed_tokens[i], bs)
            if blocks and blocks[0]:
                self._emit(BlocksAllocated(req_id=req_id, block_ids=list(blocks[0])))

    def _admitted(self, req_id: str, num_computed: int, block_size: int) -> None:
        if not self.config.synth.prefix_caching:
            return
        request = self.scheduler.requests[req_id]
        self.result.num_prefix_query_blocks += (request.num_tokens - 1) // block_size
        self.result.num_prefix_hit_blocks += num_computed // block_size

    def _runner_output(self, so: Any) -> Any:
        from vllm.v1.outputs import ModelRunnerOutput

        req_ids = list(so.num_scheduled_tokens)
        sampled = []
        for r in req_ids:
            request = self.scheduler.requests[r]
            done = request.is_prefill_chunk
            token = splitmix64((int(r.rpartition("-")[2]) << 24) ^ request.num_tokens) % VOCAB
            sampled.append([] if done else [token])
        fields = vllm_compat.runner_output_fields(ModelRunnerOutput, req_ids)
        return ModelRunnerOutput(**fields, sampled_token_ids=sampled)

    def _emit(self, event: Any) -> None:
        """One scheduler input to the engine (the result's summary counts it)."""
        self.engine.apply(event)

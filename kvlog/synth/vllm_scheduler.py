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

from kvlog.engine import Engine
from kvlog.errors import MissingExtra
from kvlog.events import (
    BlocksAllocated,
    RequestFinished,
    RequestPreempted,
    StepEnded,
)
from kvlog.synth.driver import SynthResult
from kvlog.synth.serving import TraceConfig
from kvlog.synth.traces import HASH_BLOCK_TOKENS, TraceRequest

__all__ = ["VllmTraceRun", "prompt_tokens"]

_VOCAB = 32000
_MASK64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64: a well-spread 64-bit function of ``x``."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def prompt_tokens(request: TraceRequest, serial: int, length: int) -> list[int]:
    """``length`` prompt token ids: from the ``hash_ids`` (equal ids, equal tokens), else
    unique to ``serial``."""
    if request.hash_ids:
        out: list[int] = []
        for h in request.hash_ids:
            out.extend(_mix((h << 10) | t) % _VOCAB for t in range(HASH_BLOCK_TOKENS))
            if len(out) >= length:
                break
        return out[:length]
    return [_mix((serial << 32) | t) % _VOCAB for t in range(length)]


class _StubModelConfig:
    """What vLLM's scheduler and ``StructuredOutputManager`` read of a ``ModelConfig``."""

    def __init__(self, max_model_len: int) -> None:
        import torch

        self.max_model_len = max_model_len
        self.uses_mrope = False
        self.is_encoder_decoder = False
        self.runner_type = "generate"
        self.is_diffusion = False
        self.supports_multimodal_inputs = False
        self.return_sampling_mask = False
        self.skip_tokenizer_init = True
        self.multimodal_config = None
        self.use_mla = False
        self.dtype = torch.bfloat16
        self.model = "kvlog-trace-stub"

    def get_vocab_size(self) -> int:
        return _VOCAB

    def get_total_num_kv_heads(self) -> int:
        return 8


def _build_scheduler(config: TraceConfig) -> Any:
    """vLLM's ``Scheduler`` for the trace's pool and limits (no connector, no model)."""
    try:
        import torch
        from vllm.config import CacheConfig, DeviceConfig, SchedulerConfig, VllmConfig
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager
    except ImportError as exc:
        raise MissingExtra("vllm", "vllm", "--scheduler vllm") from exc
    c = config.synth
    scheduler_config = SchedulerConfig(
        max_model_len=config.model_len(),
        is_encoder_decoder=False,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_num_seqs=c.max_num_seqs,
        enable_chunked_prefill=True,
    )
    cache_config = CacheConfig(block_size=c.block_size, enable_prefix_caching=c.prefix_caching)
    vllm_config = VllmConfig(
        cache_config=cache_config,
        scheduler_config=scheduler_config,
        device_config=DeviceConfig(device="cpu"),
    )
    vllm_config.model_config = _StubModelConfig(config.model_len())
    spec = FullAttentionSpec(
        block_size=c.block_size, num_kv_heads=8, head_size=128, dtype=torch.bfloat16
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=c.num_gpu_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)],
    )
    cache_config.num_gpu_blocks = c.num_gpu_blocks
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=c.block_size,
        hash_block_size=c.block_size,
        log_stats=False,
    )


def _make_request(req_id: str, tokens: list[int], max_tokens: int, block_size: int) -> Any:
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    return Request(
        request_id=req_id,
        prompt_token_ids=tokens,
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        pooling_params=None,
        block_hasher=get_request_block_hasher(block_size, sha256),
    )


class VllmTraceRun:
    """One trace through vLLM's scheduler, recorded on ``engine`` (see the module docstring)."""

    def __init__(
        self, config: TraceConfig, requests: Sequence[TraceRequest], engine: Engine
    ) -> None:
        self.config = config
        self.engine = engine
        self.scheduler = _build_scheduler(config)
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
            self.scheduler.add_request(_make_request(f"req-{serial}", tokens, output, bs))
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
            if req_id in cached.resumed_req_ids:
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
            token = _mix((int(r.rpartition("-")[2]) << 24) ^ request.num_tokens) % _VOCAB
            sampled.append([] if done else [token])
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
        )

    def _emit(self, event: Any) -> None:
        """One scheduler input to the engine (the result's summary counts it)."""
        self.engine.apply(event)

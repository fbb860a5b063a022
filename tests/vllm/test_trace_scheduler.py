"""Where vLLM is installed (the real-vLLM stage): ``--scheduler vllm`` drives vLLM 0.33's own
scheduler with a trace, and kvlog's vLLM-like scheduler sees what vLLM sees on the same slice:
the same requests finish in about the same steps, with about the same prefix hits and defrag."""

from __future__ import annotations

import os

import pytest

from kvlog import replay
from kvlog.synth import SynthConfig, TraceConfig, bytes_per_token, read_trace, run_trace

pytest.importorskip("vllm", reason="vLLM is not installed: --scheduler vllm is checked there")

MOONCAKE = os.path.join(
    os.path.dirname(__file__), "..", "data", "mooncake_synthetic_trace_3601-3800.jsonl"
)


def test_vllm_scheduler_agrees_with_kvlogs_model(tmp_path: str) -> None:
    config = TraceConfig(
        SynthConfig(
            num_gpu_blocks=2048,
            block_size=128,
            prefix_caching=True,
            page_size_bytes=bytes_per_token() * 128,
            max_num_seqs=32,
        )
    )
    requests = read_trace(MOONCAKE, limit=80)
    runs = {}
    for scheduler in ("kvlog", "vllm"):
        path = os.path.join(tmp_path, f"{scheduler}.kvlog")
        runs[scheduler] = run_trace(config, requests, path, sync="none", scheduler=scheduler)
        replayed = replay(path)
        assert replayed.ok and replayed.final_digest == runs[scheduler].final_digest
    ours, theirs = runs["kvlog"], runs["vllm"]
    assert ours.num_finished == theirs.num_finished == 80
    assert abs(ours.num_steps - theirs.num_steps) <= 0.05 * theirs.num_steps
    assert theirs.num_prefix_hit_blocks > 0
    assert abs(ours.prefix_hit_rate - theirs.prefix_hit_rate) < 0.03
    assert (
        abs(ours.num_swapped_blocks - theirs.num_swapped_blocks) <= 0.1 * theirs.num_swapped_blocks
    )

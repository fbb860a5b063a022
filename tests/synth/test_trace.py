"""Public traces in: the readers, vLLM's block-pool rules, and trace-driven logs that replay
to their live digest (tests/data holds a slice of each trace with its provenance)."""

from __future__ import annotations

import os

import pytest

from kvlog import replay
from kvlog.cli import main
from kvlog.errors import TraceError
from kvlog.synth import (
    SynthConfig,
    TraceConfig,
    TraceRequest,
    VllmBlockPool,
    bytes_per_token,
    read_trace,
    run_trace,
)
from kvlog.synth.traces import block_keys, guess_format

DATA = os.path.join(os.path.dirname(__file__), "..", "data")
MOONCAKE = os.path.join(DATA, "mooncake_synthetic_trace_3601-3800.jsonl")
AZURE = os.path.join(DATA, "AzureLLMInferenceTrace_conv_head300.csv")


def mooncake_config(**changes: object) -> TraceConfig:
    synth = SynthConfig(
        num_gpu_blocks=2048,
        block_size=128,
        prefix_caching=True,
        page_size_bytes=bytes_per_token() * 128,
        max_num_seqs=32,
    )
    return TraceConfig(synth.replace(**changes), "mooncake")


def azure_config(**changes: object) -> TraceConfig:
    synth = SynthConfig(num_gpu_blocks=384, block_size=128, max_num_seqs=48, threshold=8)
    return TraceConfig(synth.replace(**changes), "azure", time_scale=0.5)


# -- readers -------------------------------------------------------------------------------
def test_mooncake_slice_reads_with_relative_times_and_hash_ids() -> None:
    requests = read_trace(MOONCAKE)
    assert len(requests) == 200 and requests[0].arrival_s == 0.0
    assert 44 < requests[-1].arrival_s < 46  # 929.5 s .. 974.5 s in the full trace
    assert all(len(r.hash_ids) == -(-r.input_len // 512) for r in requests)
    assert read_trace(MOONCAKE, limit=5) == requests[:5]


def test_azure_slice_reads_wall_clock_stamps() -> None:
    requests = read_trace(AZURE, "azure")
    assert len(requests) == 300 and requests[0] == TraceRequest(0.0, 374, 44)
    assert requests[1].arrival_s == pytest.approx(4.3145789, abs=1e-6)
    assert all(not r.hash_ids for r in requests)
    assert guess_format(AZURE) == "azure" and guess_format(MOONCAKE) == "mooncake"


@pytest.mark.parametrize(
    ("name", "text", "fmt"),
    [
        ("bad.jsonl", '{"timestamp": 0, "input_length": 10}\n', "mooncake"),
        (
            "bad.jsonl",
            '{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}\n',
            "mooncake",
        ),
        ("bad.jsonl", "not json\n", "mooncake"),
        ("bad.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,x,3\n", "azure"),
        ("bad.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,3,3\n", "azure"),
        ("bad.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,0,3\n", "azure"),
        ("bad.txt", "", None),
    ],
)
def test_bad_traces_raise_trace_errors(
    tmp_path: str, name: str, text: str, fmt: str | None
) -> None:
    path = os.path.join(tmp_path, name)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    with pytest.raises(TraceError) as info:
        read_trace(path, fmt)
    assert isinstance(info.value, ValueError)
    with pytest.raises(TraceError):
        read_trace(os.path.join(tmp_path, "missing.csv"))


def test_block_keys_share_full_prompt_blocks_only() -> None:
    a = TraceRequest(0.0, 1100, 5, (7, 8, 9))  # 2 full 512-blocks and 76 tokens
    b = TraceRequest(0.0, 700, 5, (7, 10))
    keys_a, keys_b = block_keys(a, 0, 128, 1100 + 60), block_keys(b, 1, 128, 700)
    assert keys_a[:4] == [(7, 0), (7, 1), (7, 2), (7, 3)] == keys_b[:4]
    assert keys_a[4:8] == [(8, 0), (8, 1), (8, 2), (8, 3)]
    assert keys_a[8] == ("u", 0, 8)  # holds prompt tokens and generated ones
    assert keys_b[4] == (10, 0) and len(keys_b) == 5  # tokens 512..639 of hash 10's 512
    assert block_keys(b, 1, 128, 768)[5] == ("u", 1, 5)  # 640..767: past the prompt
    assert block_keys(TraceRequest(0.0, 300, 2), 3, 128, 302) == [("u", 3, 0), ("u", 3, 1)]


# -- vLLM's block pool -------------------------------------------------------------------
def test_free_queue_order_follows_vllm() -> None:
    pool = VllmBlockPool(10, prefix_caching=True)
    assert pool.free_queue() == list(range(1, 10))  # block 0 is the null block
    a = pool.allocate(3)
    assert a == [1, 2, 3]
    pool.cache(1, "h1")  # a full, computed block: hashed
    pool.free(a)  # reverse order: 3, 2 unhashed to the head, 1 hashed to the tail
    assert pool.free_queue() == [3, 2, 4, 5, 6, 7, 8, 9, 1]
    assert pool.lookup(["h1", "h2"]) == [1] and pool.lookup(["h2", "h1"]) == []
    assert pool.num_reclaimed_by([1]) == 1
    pool.touch([1])  # a hit on a free cached block takes it off the queue
    assert 1 not in pool.free_queue() and pool.refs[1] == 1
    pool.free([1])
    assert pool.free_queue()[-1] == 1
    taken = pool.allocate(9)  # reaches the cached block last and evicts its hash
    assert taken[-1] == 1 and pool.lookup(["h1"]) == [] and pool.num_evictions == 1


def test_shared_blocks_need_every_reference_dropped() -> None:
    pool = VllmBlockPool(6, prefix_caching=True)
    first = pool.allocate(2)
    pool.cache(first[0], "p")
    hits = pool.lookup(["p"])
    pool.touch(hits)
    pool.free(first)
    assert first[0] not in pool.free_queue()  # the second request still holds it
    pool.free(hits)
    assert pool.free_queue()[-1] == first[0]
    with pytest.raises(ValueError):
        pool.free(hits)


def test_without_prefix_caching_nothing_is_cached() -> None:
    pool = VllmBlockPool(6, prefix_caching=False)
    blocks = pool.allocate(3)
    pool.cache(blocks[0], "x")
    assert pool.lookup(["x"]) == []
    pool.free(blocks)
    assert pool.free_queue() == [3, 2, 1, 4, 5]


# -- trace-driven logs ---------------------------------------------------------------------
def test_mooncake_log_has_real_prefix_hits_and_replays(tmp_path: str) -> None:
    path = os.path.join(tmp_path, "mooncake.kvlog")
    requests = read_trace(MOONCAKE)
    live = run_trace(mooncake_config(), requests, path, sync="none", checkpoint_every=64)
    assert live.num_requests == live.num_finished == 200
    assert live.num_prefix_hit_blocks > 1000 and 0.05 < live.prefix_hit_rate < 0.5
    assert live.num_swap_plans > 0 and live.num_clipped <= 5
    result = replay(path)
    assert result.ok and result.final_digest == live.final_digest and result.num_verified > 5
    again = run_trace(mooncake_config(), requests, None)
    assert again.final_digest == live.final_digest  # deterministic


def test_azure_log_with_offload_replays(tmp_path: str) -> None:
    path = os.path.join(tmp_path, "azure.kvlog")
    config = azure_config(num_cpu_blocks=512, block_size_factor=2)
    live = run_trace(config, read_trace(AZURE), path, sync="none", checkpoint_every=64)
    assert live.num_finished == 300 and live.num_preemptions > 0
    assert live.num_stores > 0 and live.num_prefix_query_blocks == 0
    result = replay(path)
    assert result.ok and result.final_digest == live.final_digest


def test_trace_run_on_tensors_keeps_every_canary(tmp_path: str) -> None:
    config = mooncake_config(num_gpu_blocks=640, num_cpu_blocks=1024, block_size_factor=2)
    config = TraceConfig(config.synth.replace(check_every=100), "mooncake", max_model_len=16384)
    live = run_trace(config, read_trace(MOONCAKE, limit=60), None, execute=True, backend="fake")
    assert live.canary_checks and live.canary_ok and live.num_loads > 0


def test_cli_synth_trace_prints_hits_and_writes_a_replayable_log(
    tmp_path: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = os.path.join(tmp_path, "m.kvlog")
    argv = ["synth", "--trace", MOONCAKE, "--requests", "120", "--num-gpu-blocks", "2048"]
    argv += ["--prefix-caching", "--policy", "tail", "--sync", "none", "--out", path]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "hit rate" in out and "120 arrived, 120 finished" in out
    assert main(["replay", path]) == 0
    assert "verified: the replay agrees" in capsys.readouterr().out
    bad = ["synth", "--trace", MOONCAKE, "--block-size", "96", "--out", path + ".x"]
    assert main(bad) == 2
    assert "must divide 512" in capsys.readouterr().err


def test_run_trace_from_python_has_the_command_lines_defaults_and_checks(
    tmp_path: str,
) -> None:
    from kvlog.synth import TRACE_DEFAULTS, SynthConfig, TraceConfig, run_trace, trace_geometry

    geometry = trace_geometry()
    assert geometry["num_gpu_blocks"] == TRACE_DEFAULTS["num_gpu_blocks"] == 4096
    assert geometry["page_size_bytes"] == 128 * (128 << 10)  # 128 KiB of KV per token
    requests = read_trace(MOONCAKE, limit=5)
    bad = TraceConfig(SynthConfig(**trace_geometry(block_size=96)))
    out = os.path.join(tmp_path, "bad.kvlog")
    with pytest.raises(TraceError, match="--block-size 96 must divide 512"):
        run_trace(bad, requests, out)
    assert not os.path.exists(out)  # refused before the log exists

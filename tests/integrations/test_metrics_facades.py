"""Issue 31 on the facades, no vLLM: the reporter of a defragmenter's session, a detached
recorder in the metrics within one step, the defrag-only exporter, the plugin's lines.

The runner loop is the synthetic one (``kvlog.synth``'s workload through
``OnlineDefragmenter`` as the Gaudi runner calls it).
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from kvlog.integrations import OnlineDefragmenter
from kvlog.log import writer as writer_module

BS = 4
ROOT = str(Path(__file__).resolve().parents[2])
NUM_BLOCKS = 64


def _caches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = ((NUM_BLOCKS + 1) * BS, 2, 8)
    return [(torch.zeros(shape, dtype=torch.int16), torch.zeros(shape, dtype=torch.int16))]


def _steps(num_steps: int, seed: int = 3) -> Iterator[tuple[dict[str, list[int]], list[str]]]:
    """A runner's steps over a 64-block pool: requests arrive with 2-6 blocks, finish at
    random (holes, so defrag fires), block ids from a FIFO free list like vLLM's."""
    import random

    rng = random.Random(seed)
    free = list(range(1, NUM_BLOCKS))
    live: dict[str, list[int]] = {}
    for step in range(num_steps):
        finished = [r for r in sorted(live) if rng.random() < 0.3]
        for r in finished:
            free.extend(live.pop(r))
        new: dict[str, list[int]] = {}
        want = rng.randint(2, 6)
        if len(free) >= want:
            rid = f"r{step}"
            new[rid] = [free.pop(0) for _ in range(want)]
            live[rid] = list(new[rid])
        yield new, finished


@contextmanager
def _enospc_from(monkeypatch: pytest.MonkeyPatch, after: int) -> Iterator[None]:
    real = writer_module._write_all
    calls = {"n": 0}

    def failing(*args: Any) -> Any:
        calls["n"] += 1
        if calls["n"] > after:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(*args)

    monkeypatch.setattr(writer_module, "_write_all", failing)
    yield


def test_a_detached_recorder_shows_in_the_next_payload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ENOSPC on the log: the payload taken at the end of the very step the recorder
    detached says so (attached 0, errno ENOSPC), though the interval is an hour."""
    monkeypatch.setenv("KVLOG_METRICS_INTERVAL_S", "3600")
    defrag = OnlineDefragmenter(
        _caches(), BS, threshold=1, backend="cpu", log_path=str(tmp_path / "a.kvlog"), sync="step"
    )
    reporter = defrag.session.reporter
    detached_at = None
    with _enospc_from(monkeypatch, after=40):
        for step, (new, finished) in enumerate(_steps(200)):
            defrag.update_state(new, finished)
            defrag.defragment()
            reporter = defrag.session.reporter
            assert reporter is not None
            payload = reporter.take()
            if step == 0:
                assert payload is not None  # the first payload, then an hour's wait
                continue
            if not defrag.log_status().attached and detached_at is None:
                detached_at = step
                assert payload is not None, "the detach waited for the interval"
                data = payload["data"]
                assert data["kvlog_recorder_attached"][("worker",)] == 0
                assert data["kvlog_recorder_errno"][("worker",)] == errno.ENOSPC
            elif detached_at is None:
                assert payload is None  # nothing due: one attribute test a step
    assert detached_at is not None
    defrag.close()


def test_metrics_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVLOG_METRICS", "0")
    defrag = OnlineDefragmenter(_caches(), BS, threshold=1, backend="cpu")
    for new, finished in _steps(5):
        defrag.update_state(new, finished)
        defrag.defragment()
    assert defrag.session.reporter is None
    assert not defrag.session.engine.machine.observers


def test_defrag_only_exports_through_prometheus_multiprocess(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PROMETHEUS_MULTIPROC_DIR set and no connector: the defragmenter writes its series
    where vLLM's /metrics collects them (prometheus_client's MultiProcessCollector)."""
    import subprocess
    import sys

    mp = tmp_path / "prom"
    mp.mkdir()
    code = f"""
import torch, sys
sys.path.insert(0, {ROOT!r})
from tests.integrations.test_metrics_facades import _caches, _steps, BS
from kvlog.integrations import OnlineDefragmenter
defrag = OnlineDefragmenter(_caches(), BS, threshold=1, backend="cpu")
for new, finished in _steps(300):
    defrag.update_state(new, finished)
    defrag.defragment()
state = defrag.session.engine.state
figures = defrag.session.reporter.figures
print(figures.steps, figures.defrag_pairs, state.num_used)
"""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(mp), "KVLOG_METRICS_INTERVAL_S": "0"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    steps, pairs, used = (int(x) for x in out.stdout.split())
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(mp))
    assert registry.get_sample_value("kvlog_steps_total") == steps == 300
    assert registry.get_sample_value("kvlog_defrag_pairs_total") == pairs > 0
    assert registry.get_sample_value("kvlog_kv_used_blocks") == used


def test_the_plugins_debug_lines_word_for_word(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("VLLM_DEBUG", "defrag")
    caplog.set_level(logging.INFO)
    defrag = OnlineDefragmenter(_caches(), BS, threshold=1, backend="cpu")
    defrag.warmup()
    steps = list(_steps(60))
    for new, finished in steps:
        defrag.update_state(new, finished)
        defrag.defragment()
    lines = [r.getMessage() for r in caplog.records]
    assert "[defrag] initialized" in lines
    assert "Warming up defragmenter with thresholds: [8, 16, 32, 64, 128, 256, 512]" in lines
    assert "Defragmenter warmup completed successfully" in lines
    new, finished = steps[5]
    total = sum(len(b) for b in new.values())
    assert f"[defrag] updating state: {total} new_blocks {len(finished)} finished reqs" in lines
    done = [line for line in lines if line.startswith("[defrag] defragmentation done ")]
    assert done, "defrag fired and said so"
    import re

    pattern = (
        r"\[defrag\] defragmentation done max_id_used=(\d+)->(\d+) num_used=(\d+) "
        r"swapped=(\d+)/(\d+)"
    )
    for line in done:
        found = re.fullmatch(pattern, line)
        assert found is not None, line
        pre, post, used, swapped, pad = map(int, found.groups())
        assert post < pre and used <= post + 1 and swapped <= pad
        assert pad in (8, 16, 32, 64, 128, 256, 512)


def test_no_debug_lines_without_vllm_debug(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("VLLM_DEBUG", raising=False)
    caplog.set_level(logging.DEBUG)
    defrag = OnlineDefragmenter(_caches(), BS, threshold=1, backend="cpu")
    for new, finished in _steps(30):
        defrag.update_state(new, finished)
        defrag.defragment()
    assert not [r for r in caplog.records if "[defrag]" in r.getMessage()]
    assert defrag.debug is None

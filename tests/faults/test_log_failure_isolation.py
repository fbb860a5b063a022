"""Failure isolation: an I/O error on the log never stops the facades, the connector's
worker, or an Engine built with ``on_log_error="detach"``.

ENOSPC and EIO are injected into the writer's ``write`` and ``fdatasync`` (persistent: the
disk stays bad, so no gap record can be written; transient: the gap record goes in). In every
case the serving loop runs to the end with the decisions and tables of a run without a log,
``log_status()`` reports the detach, the ``kvlog`` logger says it once, and the log up to the
gap replays and verifies. A direct ``Engine`` keeps raising ``LogPoisoned``.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvlog import Engine, replay
from kvlog.errors import LogPoisoned
from kvlog.integrations import OffloadingWorker, OnlineDefragmenter
from kvlog.log import LogReader
from kvlog.log import writer as writer_module
from kvlog.synth import SynthConfig, SynthRun
from tests.support.seed_reference import make_hpu_caches

BS = 4
CODES = [errno.ENOSPC, errno.EIO]


@contextmanager
def disk_fault(
    monkeypatch: pytest.MonkeyPatch, code: int, site: str, after: int, transient: bool
) -> Iterator[dict[str, int]]:
    """Make the writer's ``site`` ("write" or "sync") fail with ``code`` from its call
    ``after + 1`` on (once only when ``transient``)."""
    name = "_write_all" if site == "write" else "_datasync"
    real = getattr(writer_module, name)
    calls = {"calls": 0, "failed": 0}

    def failing(*args: object) -> object:
        calls["calls"] += 1
        if calls["calls"] > after and not (transient and calls["failed"]):
            calls["failed"] += 1
            raise OSError(code, os.strerror(code))
        return real(*args)

    monkeypatch.setattr(writer_module, name, failing)
    yield calls
    monkeypatch.setattr(writer_module, name, real)


SYNTH = SynthConfig(steps=400, seed=3, num_cpu_blocks=64)


def synth(
    log_path: Path | None, engine: Engine | None = None, **options: object
) -> tuple[Engine, dict[str, object]]:
    """A synthetic serving run (offload and defrag), on ``engine`` if given; what it
    decided (its counts)."""
    config = SYNTH
    if engine is None:
        engine = Engine(config.cache_config(), log_path, **options)  # type: ignore[arg-type]
    run = SynthRun(config, engine, None).run()
    result = {f.name: getattr(run, f.name) for f in dataclasses.fields(run)}
    for name in ("log_path", "elapsed_s", "tally"):
        result.pop(name)
    result["tally"] = _figures(run.tally)
    return engine, result


def _figures(summary: object) -> dict[str, object]:
    """What a run's summary counted (its timings left out)."""
    fields = {k: v for k, v in vars(summary).items() if not k.endswith("_s")}
    for name in ("on_step", "cost", "config"):
        fields.pop(name, None)
    plans = fields.pop("plans")
    fields["plans"] = {k: getattr(plans, k) for k in dir(plans) if k.startswith(("num_", "bytes"))}
    return fields


def test_a_direct_engine_keeps_log_poisoned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with disk_fault(monkeypatch, errno.ENOSPC, "sync", 5, False), pytest.raises(LogPoisoned):
        synth(tmp_path / "a.kvlog")


@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("site", ["write", "sync"])
@pytest.mark.parametrize("transient", [False, True])
def test_a_detaching_engine_serves_on_and_the_log_replays_to_the_gap(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    code: int,
    site: str,
    transient: bool,
) -> None:
    baseline, expected = synth(None)
    path = tmp_path / "a.kvlog"
    caplog.set_level(logging.ERROR, logger="kvlog")
    with disk_fault(monkeypatch, code, site, 40, transient) as calls:
        engine, result = synth(path, sync="step", on_log_error="detach")
        engine.close()
    assert calls["failed"] >= 1
    assert result == expected  # every decision the same as without a log
    assert engine.digest() == baseline.digest()
    status = engine.log_status()
    assert (status.attached, status.errno, status.num_errors) == (False, code, 1)
    assert status.path == str(path) and status.gap_marked == transient
    said = [r for r in caplog.records if r.name == "kvlog"]
    assert len(said) == 1 and str(path) in said[0].getMessage()
    assert os.strerror(code) in said[0].getMessage()
    replayed = replay(path)
    assert replayed.ok and replayed.divergence is None
    assert 0 < replayed.num_events < expected["tally"]["num_events"]  # type: ignore[index,operator]
    # a persistent fsync error still lets the gap record reach the page cache (not known
    # durable: status.gap_marked is False); a persistent write error keeps it out
    assert len(replayed.gaps) == 1 if transient else len(replayed.gaps) <= (site == "sync")
    if transient:
        assert os.strerror(code) in replayed.gaps[0]
        reader = LogReader(path)
        list(reader.records())
        assert [gap.errno for _, gap in reader.gaps] == [code]


def test_a_log_poisoned_by_the_background_flusher_detaches_at_the_next_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    baseline, expected = synth(None)
    path = tmp_path / "a.kvlog"
    engine = Engine(
        SYNTH.cache_config(), path, sync="background", on_log_error="detach"
    )  # opened (its header synced) before the fault: every fsync from here on fails
    with disk_fault(monkeypatch, errno.EIO, "sync", 0, False) as calls:
        engine, result = synth(path, engine)
        deadline = time.monotonic() + 30  # the flusher's next round meets the fault
        while not calls["failed"] and time.monotonic() < deadline:
            time.sleep(0.005)
        assert calls["failed"], "the flusher never synced what the run wrote"
        engine.close()
    assert result == expected and engine.digest() == baseline.digest()
    assert engine.log_status().errno == errno.EIO
    assert replay(path).ok


def test_a_detached_engine_can_be_resumed_from_its_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "a.kvlog"
    with disk_fault(monkeypatch, errno.ENOSPC, "write", 30, True):
        engine, _ = synth(path, sync="step", on_log_error="detach")
        engine.close()
    resumed = Engine.resume(path)
    resumed.checkpoint(snapshot=True)
    resumed.close()
    result = replay(path)
    assert result.ok and len(result.gaps) == 1


# -- the facades ---------------------------------------------------------------------------
def runner_trace(num_steps: int, num_blocks: int, seed: int = 0) -> list[tuple[dict, list]]:
    """A runner's update_state calls: requests arrive, grow by a block, finish (FIFO ids)."""
    rng = random.Random(seed)
    free = list(range(1, num_blocks))
    live: dict[str, list[int]] = {}
    out: list[tuple[dict, list]] = []
    for step in range(num_steps):
        finished = [r for r in sorted(live) if rng.random() < 0.08]
        for req_id in finished:
            free.extend(live.pop(req_id))
        new: dict[str, list[int]] = {}
        for req_id in sorted(live):
            if free and rng.random() < 0.5:
                block = free.pop(0)
                live[req_id].append(block)
                new[req_id] = [block]
        if len(free) > 8 and rng.random() < 0.6:
            blocks = [free.pop(0) for _ in range(rng.randint(1, 6))]
            live[f"r{step}"] = blocks
            new[f"r{step}"] = list(blocks)
        out.append((new, finished))
    return out


def run_facade(log: str | None, num_steps: int = 600) -> tuple[OnlineDefragmenter, list]:
    env = {"VLLM_DEFRAG_THRESHOLD": "4", "KVLOG_SYNC": "step"}
    if log is not None:
        env["KVLOG_PATH"] = log
    defrag = OnlineDefragmenter(environ=env, backend="fake")
    defrag.initialize(make_hpu_caches(128, BS), BS)
    worker = OffloadingWorker(defrag, num_cpu_blocks=16)
    seen: list = []
    live: dict[str, list[int]] = {}
    for step, (new, finished) in enumerate(runner_trace(num_steps, 128)):
        for req_id in finished:
            live.pop(req_id)
        for req_id, blocks in new.items():
            live.setdefault(req_id, []).extend(blocks)
        defrag.update_state(new, finished)
        defrag.defragment()
        swap = defrag.last_swap
        seen.append((None if swap is None else swap.pairs, defrag.resolve_all(list(live.values()))))
        if step % 7 == 0 and live:  # the connector's worker: a store of a live block
            block = next(iter(live.values()))[0]
            assert worker.submit_store(step + 1, [block], [step % 16])
            worker.wait(None)
            seen.append([r.job_id for r in worker.get_finished()])
    return defrag, seen


@pytest.mark.parametrize("code", CODES)
def test_the_facade_and_its_offloading_worker_serve_through_a_failing_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    _, expected = run_facade(None)
    log = tmp_path / "facade.kvlog"
    with disk_fault(monkeypatch, code, "sync", 100, False):
        defrag, seen = run_facade(str(log))
    assert seen == expected  # the same swaps, tables and transfers as without a log
    status = defrag.log_status()
    assert (status.attached, status.errno) == (False, code)
    defrag.close()
    assert replay(log).ok


def test_a_log_that_cannot_be_created_never_stops_the_facade(tmp_path: Path) -> None:
    _, expected = run_facade(None, num_steps=50)
    missing = tmp_path / "no-such-dir" / "facade.kvlog"
    defrag, seen = run_facade(str(missing), num_steps=50)
    assert seen == expected
    status = defrag.log_status()
    assert not status.attached and status.errno == errno.ENOENT
    defrag.close()

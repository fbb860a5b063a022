"""kvlog under each supported vLLM (issue 30): the vLLM version stages of CI run this module
in a virtualenv per release (the real-vLLM stage runs the whole harness matrix on 0.33).

- the installed release is one of ``SUPPORTED_VLLM``, and the adapter reads it as that
  release (the tier rule its manager follows, device pointers, sync loads);
- an unsupported release is refused at connector start, through vLLM's own factory, with
  one line naming the supported releases;
- vLLM's factory builds kvlog's connector for both roles (the scheduler's with its CPU tier
  recorder; the worker's with kvlog's worker on the registered caches);
- a subset of the harness matrix: prefix caching on and off, sync and async loads (0.26 has
  async loads only), ``blocks_per_chunk`` 1 and 2, the Gaudi switch's call site. Every
  configuration runs the V1 runner's shape where the release has it: 0.26's V2 runner needs
  Triton, 0.34 has the V2 runner only.

The tier differential against the release's real manager is ``tests/test_cpu_tier_vllm.py``.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "vllm", reason="vLLM is not installed here: the vLLM stages run this module in their venvs"
)

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole

from kvlog.errors import UnsupportedVllm
from kvlog.integrations import SUPPORTED_VLLM, OffloadingWorker
from kvlog.integrations.vllm import KvlogConnectorWorker, KvlogOffloadingConnector, check_vllm
from kvlog.tier.record import TierRecorder
from kvlog.util import vllm_compat
from tests import vllm_harness as harness
from tests.vllm.harness.vllm_objects import _env

VERSION = check_vllm()
MINOR = ".".join(VERSION.split(".")[:2])
RULES = {"0.26": "vllm-0.26", "0.33": "vllm-0.33", "0.34": "vllm-0.34"}
"""The manager rule each supported release's CPUOffloadingManager follows."""
SYNC_LOADS = MINOR != "0.26"
"""Releases whose scheduler runs a load within its step (0.26: async loads only)."""

SUBSET = [
    "nopc-bpc1-async",
    "nopc-bpc2-sync",
    "pc-bpc2-async",
    "pc-bpc1-sync",
    "switch-pc-bpc2-async",
]
"""The stage's configurations (each as the V1 runner's shape where the release has one)."""
RESULTS: list[Any] = []
REAL_STAGE = ".".join(
    (Path(__file__).resolve().parents[2] / ".ci" / "vllm-nodeps.txt")
    .read_text(encoding="utf-8")
    .split("vllm==", 1)[1]
    .split(".")[:2]
)
"""The release the real-vLLM stage runs its whole harness matrix on (0.33)."""


def test_the_installed_vllm_is_a_supported_release() -> None:
    assert MINOR in RULES
    assert any(v.startswith(MINOR + ".") for v in SUPPORTED_VLLM)


def test_the_harness_script_runs_the_installed_vllm() -> None:
    """``python tests/vllm_harness.py`` imports vLLM itself, not the package tests/vllm that
    the script's own directory on the path would put first."""
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "tests/vllm_harness.py", "--list"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    ).stdout
    header = out.splitlines()[0]
    assert header.startswith(f"# vLLM {VERSION} from "), header
    assert Path(header.split(" from ", 1)[1]) != root / "tests" / "vllm", header


def test_an_unsupported_vllm_is_refused_at_connector_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's factory builds the connector: the refusal is kvlog's one line, never an error
    from inside vLLM's classes."""
    cfg = harness.CONFIGS["nopc-bpc1-async"]
    with _env("VLLM_USE_V2_MODEL_RUNNER", "0"):
        vllm_config, kv_cache_config, _ = harness.build_vllm(_v1(cfg))
    monkeypatch.setattr(vllm_compat, "installed_vllm", lambda: "0.25.1")
    with pytest.raises(UnsupportedVllm) as info, _env("VLLM_USE_V2_MODEL_RUNNER", "0"):
        KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
    message = str(info.value)
    assert "\n" not in message and "0.25.1" in message
    assert all(version in message for version in SUPPORTED_VLLM)


def test_the_factory_builds_both_roles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _v1(harness.CONFIGS["nopc-bpc2-sync"])
    monkeypatch.setenv("KVLOG_PATH", str(tmp_path / "run.kvlog"))
    with _env("VLLM_USE_V2_MODEL_RUNNER", "0"):
        vllm_config, kv_cache_config, scheduler = harness.build_vllm(cfg)
    connector = scheduler.connector
    assert isinstance(connector, KvlogOffloadingConnector)
    recorder = connector.connector_scheduler.manager
    assert isinstance(recorder, TierRecorder)
    tier = connector.tier_engine
    assert tier is not None
    connector.shutdown()
    with _env("VLLM_USE_V2_MODEL_RUNNER", "0"):
        worker_side = KVConnectorFactory.create_connector(
            vllm_config, KVConnectorRole.WORKER, kv_cache_config
        )
    assert isinstance(worker_side, KvlogOffloadingConnector)
    conn_worker = worker_side.connector_worker
    assert isinstance(conn_worker, KvlogConnectorWorker)
    kv = harness.KvCache(cfg)
    worker_side.register_kv_caches(kv.kv_caches_4d())
    assert isinstance(conn_worker.kvlog_worker, OffloadingWorker)
    pointers = vllm_compat.takes_device_pointers(type(conn_worker))
    assert (conn_worker.worker is conn_worker.kvlog_worker) is not pointers
    assert pointers is (MINOR == "0.34")
    assert worker_side.engine.config.num_cpu_blocks == vllm_compat.spec_num_chunks(conn_worker.spec)
    worker_side.shutdown()
    worker_side.engine.close()


def test_the_tier_log_records_the_releases_manager_rule(tmp_path: Path) -> None:
    res = _run("pc-bpc2-async", tmp_path)
    from kvlog.integrations.vllm import scheduler_log_path
    from kvlog.tier.replay import tier_events

    log = scheduler_log_path(str(tmp_path / "pc-bpc2-async.kvlog"))
    first = next(tier_events(log))
    assert first.rule == RULES[MINOR]
    assert res.tier is not None and res.tier.exact, res.tier


@pytest.mark.parametrize("name", SUBSET)
def test_kvlog_in_this_vllm(name: str, tmp_path: Path) -> None:
    if MINOR == REAL_STAGE:
        pytest.skip(f"vLLM {MINOR}: the real-vLLM stage runs the whole matrix on this release")
    res = _run(name, tmp_path)
    cfg = res.cfg
    assert res.ok, res.summary()
    assert res.requests >= 150 and res.preemptions >= 30
    assert res.stores_done > 0 and res.loads_done > 0
    assert (res.loads_sync > 0) == (cfg.sync_loads and SYNC_LOADS)
    assert res.replay_ok is True
    assert res.tier is not None and res.tier.exact, res.tier
    assert res.swap_steps > 0 and res.table_checks > 0
    assert res.plain_s > 0 and "plain shadow" not in res.details, res.details  # the baseline


def test_subset_table(capsys: pytest.CaptureFixture[str]) -> None:
    """Print the figures of the configurations above (also on failures)."""
    if not RESULTS:
        pytest.skip("no configuration ran")
    with capsys.disabled():
        print(f"\nvLLM {VERSION}:")
        print(harness.format_table(RESULTS))


_DONE: dict[str, Any] = {}


def _v1(cfg: harness.RunConfig) -> harness.RunConfig:
    return dataclasses.replace(cfg, v2_runner=False)


def _run(name: str, tmp_path: Path) -> Any:
    """One configuration of the subset, run once per session."""
    if name not in _DONE:
        res = harness.run_config(_v1(harness.CONFIGS[name]), str(tmp_path))
        _DONE[name] = res
        RESULTS.append(res)
    return _DONE[name]

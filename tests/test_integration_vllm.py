"""Where vLLM is installed: the facades against vLLM's real offloading classes.

vLLM is no dependency of kvlog (and not installed in CI), so this module is skipped there;
the fakes in ``test_integration_runner.py`` follow the same documented shapes. Two vLLM
layouts exist: ``vllm.v1.kv_offload.base`` (``OffloadingWorker`` with ``submit_store`` /
``submit_load``) and the older ``vllm.v1.kv_offload.worker.worker`` (``OffloadingHandler``
with ``transfer_async``); each check runs on the ones this vLLM has.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect

import pytest
from seed_reference import make_hpu_caches

from kvlog.integrations import OffloadingHandler, OffloadingWorker, OnlineDefragmenter
from kvlog.integrations import TransferResult as FacadeResult

pytest.importorskip("vllm", reason="vLLM is not installed: its shapes are checked elsewhere")


def _module(name: str) -> object | None:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


NEW = _module("vllm.v1.kv_offload.base")
OLD = _module("vllm.v1.kv_offload.worker.worker")
MEDIUMS = _module("vllm.v1.kv_offload.mediums") or NEW


def _params(cls: type, name: str) -> list[str]:
    return list(inspect.signature(getattr(cls, name)).parameters)


def test_worker_methods_match_vllms_offloading_worker() -> None:
    base = getattr(NEW, "OffloadingWorker", None)
    if base is None or not hasattr(base, "submit_store"):
        pytest.skip("this vLLM has no submit_store/submit_load OffloadingWorker")
    for name in ("submit_store", "submit_load", "get_finished", "wait", "shutdown"):
        assert _params(OffloadingWorker, name) == _params(base, name), name


def test_handler_methods_match_vllms_offloading_handler() -> None:
    base = getattr(OLD, "OffloadingHandler", None) or getattr(NEW, "OffloadingHandler", None)
    if base is None:
        pytest.skip("this vLLM has no OffloadingHandler")
    for name in ("transfer_async", "get_finished", "wait"):
        assert _params(OffloadingHandler, name)[:2] == _params(base, name)[:2], name


def test_transfer_result_fields_match() -> None:
    real = getattr(NEW, "TransferResult", None) or getattr(OLD, "TransferResult", None)
    if real is None or not dataclasses.is_dataclass(real):
        pytest.skip("this vLLM's TransferResult is a plain tuple")
    ours = set(FacadeResult.__struct_fields__)
    assert {f.name for f in dataclasses.fields(real)} <= ours | {"transfer_type"}


def test_real_specs_drive_the_worker() -> None:
    gpu_spec = getattr(MEDIUMS, "GPULoadStoreSpec", None)
    cpu_spec = getattr(MEDIUMS, "CPULoadStoreSpec", None)
    if gpu_spec is None or cpu_spec is None:
        pytest.skip("this vLLM has no GPU/CPU LoadStoreSpec")
    defrag = OnlineDefragmenter(environ={}, backend="cpu")
    defrag.initialize(make_hpu_caches(16, 4), 4)
    worker = OffloadingWorker(defrag, num_cpu_blocks=4)
    defrag.update_state({"a": [3, 4]}, [])
    try:
        src = gpu_spec([3, 4], group_sizes=[2], block_indices=[0])
    except TypeError:
        src = gpu_spec([3, 4])
    assert worker.submit_store(1, src, cpu_spec([0, 1]))
    worker.wait({1})
    (result,) = worker.get_finished()
    assert result.job_id == 1 and result.success

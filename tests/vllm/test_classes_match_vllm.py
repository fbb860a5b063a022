"""kvlog's vLLM-facing classes against vLLM 0.33's real ones (the vLLM stage of CI).

Every method vLLM calls on kvlog must have vLLM's signature: the offloading worker's
(``submit_store``, ``submit_load(..., expedited=False)``, ``get_finished``, ``wait``,
``shutdown``), the connector worker's (``register_kv_caches``, ``handle_preemptions``,
``start_kv_transfers``, ``prepare_store_kv``, ``get_finished``), the connector's (every
``KVConnectorBase_V1`` method vLLM's runners call). Real ``GPULoadStoreSpec`` /
``CPULoadStoreSpec`` objects drive the worker. The whole flow under vLLM's scheduler is in
``test_vllm_real.py``. Skipped (with this reason) only where vLLM is not installed: the main
CI venv; the vLLM stage runs it.
"""

from __future__ import annotations

import dataclasses
import inspect

import numpy as np
import pytest

from tests.support.seed_reference import make_hpu_caches

pytest.importorskip("vllm", reason="vLLM is not installed: the vLLM stage of CI runs this")

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
    OffloadingConnectorWorker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.v1.kv_offload import base
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from kvlog.integrations import OffloadingWorker, OnlineDefragmenter
from kvlog.integrations import TransferResult as FacadeResult
from kvlog.integrations.vllm import (
    KvlogConnectorWorker,
    KvlogOffloadingConnector,
)


def _params(cls: type, name: str) -> list[tuple[str, object]]:
    signature = inspect.signature(getattr(cls, name))
    return [(p.name, p.default) for p in signature.parameters.values()]


@pytest.mark.parametrize(
    "name", ["submit_store", "submit_load", "get_finished", "wait", "shutdown"]
)
def test_worker_methods_match_vllms_offloading_worker(name: str) -> None:
    assert _params(OffloadingWorker, name) == _params(base.OffloadingWorker, name)


@pytest.mark.parametrize(
    "name",
    ["register_kv_caches", "handle_preemptions", "start_kv_transfers", "prepare_store_kv"],
)
def test_connector_worker_methods_match_vllms(name: str) -> None:
    assert issubclass(KvlogConnectorWorker, OffloadingConnectorWorker)
    assert [p for p, _ in _params(KvlogConnectorWorker, name)] == [
        p for p, _ in _params(OffloadingConnectorWorker, name)
    ]


def test_connector_is_vllms_offloading_connector_and_overrides_keep_signatures() -> None:
    assert issubclass(KvlogOffloadingConnector, OffloadingConnector)
    own = [
        n
        for n in vars(KvlogOffloadingConnector)
        if inspect.isfunction(getattr(KvlogOffloadingConnector, n)) and not n.startswith("_")
    ]
    # build_connector_meta writes the step's tier calls, shutdown closes the tier log;
    # log_status is kvlog's own (no vLLM method)
    # get_kv_connector_stats and build_prom_metrics (a classmethod) carry kvlog's metrics
    assert sorted(own) == [
        "bind_connector_metadata",
        "build_connector_meta",
        "get_kv_connector_stats",
        "log_status",
        "shutdown",
    ]
    assert not hasattr(KVConnectorBase_V1, "log_status")
    for name in (
        "bind_connector_metadata",
        "build_connector_meta",
        "shutdown",
        "get_kv_connector_stats",
        "build_prom_metrics",
    ):
        assert _params(KvlogOffloadingConnector, name) == _params(KVConnectorBase_V1, name)
    assert _params(KvlogOffloadingConnector, "__init__") == _params(OffloadingConnector, "__init__")


def test_transfer_result_fields_match() -> None:
    real = {f.name for f in dataclasses.fields(base.TransferResult)}
    assert real <= set(FacadeResult.__struct_fields__)


def test_real_specs_with_groups_drive_the_worker() -> None:
    defrag = OnlineDefragmenter(make_hpu_caches(16, 4), 4, environ={}, backend="cpu")
    worker = OffloadingWorker(defrag, num_cpu_blocks=4, block_size_factor=2)
    defrag.update_state({"a": [3, 4, 5]}, [])
    src = base.GPULoadStoreSpec([3, 4, 5], group_sizes=[3], block_indices=[1])
    assert worker.submit_store(1, src, CPULoadStoreSpec([0, 1]))
    worker.wait({1})
    (result,) = worker.get_finished()
    assert (result.job_id, result.success) == (1, True)
    assert result.transfer_size == 3 * defrag.engine.config.page_size_bytes
    dst = base.GPULoadStoreSpec(np.array([7], dtype=np.int32), group_sizes=[1], block_indices=[3])
    assert worker.submit_load(2, CPULoadStoreSpec([1]), dst, expedited=True)
    worker.wait({2})
    assert [r.job_id for r in worker.get_finished()] == [2]
    executor = defrag.engine.executor
    assert executor is not None
    # block index 3 is sub-block 1 of its chunk: CPU block 1's second half, i.e. block 5
    assert executor.read_gpu_block(defrag.resolve(7)) == executor.read_gpu_block(defrag.resolve(5))

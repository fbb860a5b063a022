"""The Gaudi switch's connector output: vllm-gaudi's runner, patched by
``kvlog.integrations.gaudi_connector``, hands the scheduler what vLLM's GPU runner does.

A stand-in runner module has the real one's shape (``HpuKVConnectorModelRunnerMixin`` with
the static ``maybe_setup_kv_connector`` / ``maybe_wait_for_kv_save`` /
``get_finished_kv_transfers``; ``sample_tokens`` building ``KVConnectorOutput(finished_sending=,
finished_recving=)`` then clearing the metadata; the module's own ``KVConnectorOutput``,
``has_kv_transfer_group``, ``get_kv_transfer_group``). Where vllm-gaudi's source is at hand,
the mixin's methods are the plugin's own, taken out of its file (``plugin`` runs).
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass, field, make_dataclass
from types import SimpleNamespace
from typing import Any

import pytest

from kvlog.integrations import gaudi_connector
from kvlog.integrations.gaudi_connector import CONNECTOR_EXTRAS, patch_runner_module
from tests.support.gaudi_source import (
    FILES,
    MIXIN,
    MIXIN_METHODS,
    MIXIN_SOURCE,
    extract_methods,
    source_root,
)

MODULE = "kvlog_test_gaudi_runner"
RUNNER_SOURCE = (
    MIXIN_SOURCE
    + """

class HPUModelRunner(HpuKVConnectorModelRunnerMixin):
    def sample_tokens(self, scheduler_output, warmup_mode=False):
        if not warmup_mode:
            self.maybe_setup_kv_connector(scheduler_output)
        finished_sending, finished_recving = set(), set()
        if not warmup_mode:
            self.maybe_wait_for_kv_save()
            finished_sending, finished_recving = self.get_finished_kv_transfers(scheduler_output)
        output = KVConnectorOutput(
            finished_sending=finished_sending,
            finished_recving=finished_recving,
        )
        if has_kv_transfer_group():
            get_kv_transfer_group().clear_connector_metadata()
        return output
"""
)


@dataclass
class Output:
    """vLLM 0.33's ``KVConnectorOutput`` fields."""

    finished_sending: set[str] | None = None
    finished_recving: set[str] | None = None
    kv_connector_stats: Any = None
    kv_cache_events: Any = None
    kv_connector_worker_meta: Any = None
    invalid_block_ids: set[int] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)


class Connector:
    """Records every call; each step reports its own completions, once."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.completed: list[int] = []
        self.stats_calls = 0

    def _note(self, name: str) -> None:
        self.calls.append(name)

    def bind_connector_metadata(self, meta: Any) -> None:
        self._note("bind_connector_metadata")
        self.completed.append(meta)

    def start_load_kv(self, ctx: Any) -> None:
        self._note("start_load_kv")

    def wait_for_save(self) -> None:
        self._note("wait_for_save")

    def get_finished(self, finished: set[str]) -> tuple[set[str], set[str]]:
        self._note("get_finished")
        return {"s"}, {"r"}

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._note("get_block_ids_with_load_errors")
        return {7}

    def get_kv_connector_stats(self) -> Any:
        self._note("get_kv_connector_stats")
        self.stats_calls += 1
        return {"stats": self.stats_calls}

    def get_kv_connector_kv_cache_events(self) -> Any:
        self._note("get_kv_connector_kv_cache_events")
        return None

    def build_connector_worker_meta(self) -> Any:
        self._note("build_connector_worker_meta")
        done, self.completed = self.completed, []
        return SimpleNamespace(completed_jobs=done) if done else None

    def clear_connector_metadata(self) -> None:
        self._note("clear_connector_metadata")


# vLLM's GPU runner, one step (``_get_kv_connector_output``, sync loads off)
GPU_ORDER = [
    "bind_connector_metadata",
    "start_load_kv",
    "wait_for_save",
    "get_finished",
    *(method for _, method in CONNECTOR_EXTRAS),
    "clear_connector_metadata",
]


@pytest.fixture(params=["stand-in", "plugin"])
def runner_module(request: pytest.FixtureRequest) -> Iterator[types.ModuleType]:
    module = types.ModuleType(MODULE)
    state = SimpleNamespace(connector=None)
    module.__dict__.update(
        KVConnectorOutput=Output,
        has_kv_transfer_group=lambda: state.connector is not None,
        get_kv_transfer_group=lambda: state.connector,
        get_forward_context=lambda: None,
        state=state,
    )
    exec(compile(RUNNER_SOURCE, "<hpu_model_runner stand-in>", "exec"), module.__dict__)
    if request.param == "plugin":
        root = source_root()
        if root is None:
            pytest.skip("vllm-gaudi's source is not at ../shared/vllm_gaudi")
        mixin = getattr(module, MIXIN)
        namespace = module.__dict__ | {"KVConnectorBase": Connector}
        for name, method in extract_methods(
            root, FILES[1], MIXIN, MIXIN_METHODS, namespace
        ).items():
            setattr(mixin, name, method)
    sys.modules[MODULE] = module
    yield module
    del sys.modules[MODULE]


def _step(module: Any, connector: Connector | None, warmup: bool = False, meta: int = 1) -> Any:
    module.state.connector = connector
    so = SimpleNamespace(kv_connector_metadata=meta, finished_req_ids=set())
    return module.HPUModelRunner().sample_tokens(so, warmup)


def test_without_the_patch_the_runner_drops_what_vllms_runner_hands_over(
    runner_module: Any,
) -> None:
    connector = Connector()
    out = _step(runner_module, connector)
    assert out.kv_connector_worker_meta is None and out.kv_connector_stats is None
    assert "build_connector_worker_meta" not in connector.calls  # completions stay behind


def test_the_patched_runner_hands_over_every_field_in_vllms_order(runner_module: Any) -> None:
    patched = patch_runner_module(runner_module)
    assert patched == [f"{MODULE}.KVConnectorOutput", f"{MODULE}.{MIXIN}.get_finished_kv_transfers"]
    connector = Connector()
    for step in range(1, 4):
        connector.calls.clear()
        out = _step(runner_module, connector, meta=step)
        assert connector.calls == GPU_ORDER
        assert out.kv_connector_worker_meta.completed_jobs == [step]  # this step's, once
        assert out.kv_connector_stats == {"stats": step}
        assert out.invalid_block_ids == {7} and out.kv_cache_events is None
        assert (out.finished_sending, out.finished_recving) == ({"s"}, {"r"})


def test_no_connector_and_warm_up_steps_are_left_as_they_are(runner_module: Any) -> None:
    patch_runner_module(runner_module)
    out = _step(runner_module, None)
    assert out == Output(finished_sending=None, finished_recving=None)
    connector = Connector()
    out = _step(runner_module, connector, warmup=True)
    assert out == Output(finished_sending=set(), finished_recving=set())
    assert connector.calls == ["clear_connector_metadata"]


def test_an_output_never_built_leaves_the_completions_for_the_next_step(
    runner_module: Any,
) -> None:
    patch_runner_module(runner_module)
    connector = Connector()
    runner_module.state.connector = connector
    so = SimpleNamespace(kv_connector_metadata=1, finished_req_ids=set())
    runner = runner_module.HPUModelRunner()
    runner.maybe_setup_kv_connector(so)
    runner.get_finished_kv_transfers(so)  # the step fails before its output is built
    out = _step(runner_module, connector, meta=2)
    assert out.kv_connector_worker_meta.completed_jobs == [1, 2]


def test_the_patch_is_applied_once(runner_module: Any) -> None:
    patch_runner_module(runner_module)
    assert patch_runner_module(runner_module) == []
    connector = Connector()
    _step(runner_module, connector)
    assert connector.calls.count("build_connector_worker_meta") == 1


def test_fields_this_vllm_lacks_or_the_caller_gave_are_not_touched(runner_module: Any) -> None:
    old = make_dataclass("Old", [("finished_sending", Any, None), ("finished_recving", Any, None),
                                 ("kv_connector_worker_meta", Any, None)])  # fmt: skip
    runner_module.KVConnectorOutput = old
    patch_runner_module(runner_module)
    connector = Connector()
    out = _step(runner_module, connector)
    assert out.kv_connector_worker_meta.completed_jobs == [1]
    assert "get_kv_connector_stats" not in connector.calls
    given = gaudi_connector.connector_extras(connector, Output, {"kv_connector_stats": 1})
    assert "kv_connector_stats" not in given and given["invalid_block_ids"] == {7}


def test_a_module_without_the_pieces_is_left_alone(runner_module: Any) -> None:
    del runner_module.get_kv_transfer_group
    before = runner_module.KVConnectorOutput
    assert patch_runner_module(runner_module) == []
    assert runner_module.KVConnectorOutput is before


def test_the_gaudi_switch_patches_the_runners_connector_output(runner_module: Any) -> None:
    from kvlog.integrations import gaudi

    patched = gaudi.install([MODULE])
    assert f"{MODULE}.KVConnectorOutput" in patched
    assert f"{MODULE}.{MIXIN}.get_finished_kv_transfers" in patched
    out = _step(runner_module, Connector())
    assert out.kv_connector_worker_meta.completed_jobs == [1]
    assert gaudi.install([MODULE]) == []  # installed twice: patched once

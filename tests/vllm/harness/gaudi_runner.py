"""vllm-gaudi's runner end of a step with a connector, as a module kvlog's Gaudi switch patches.

``HPUModelRunner`` (vllm-gaudi 091bbadd, ``v1/worker/hpu_model_runner.py``) ends a forward step
with the connector through its mixin's static ``maybe_setup_kv_connector`` (bind, start the
loads), the forward, ``maybe_wait_for_kv_save`` and ``get_finished_kv_transfers``, then builds
``KVConnectorOutput(finished_sending=, finished_recving=)`` and clears the metadata: the
connector's worker metadata (every store and load completion of vLLM's offloading connector)
and stats stay behind. A step with nothing scheduled goes to vLLM's own
``kv_connector_no_forward``, which hands everything over. :func:`runner_module` builds that
shape as a module (same names as the plugin's: the module's ``KVConnectorOutput``,
``has_kv_transfer_group``, ``get_kv_transfer_group``; ``tests/test_gaudi_source.py`` checks
those names against the plugin's file), and with ``switch`` applies kvlog's Gaudi switch to
it (``kvlog.integrations.gaudi.install``), as ``KVLOG_GAUDI=1`` does to the real module.
"""

from __future__ import annotations

import itertools
import sys
import types
from collections.abc import Callable
from typing import Any

from tests.support.gaudi_source import MIXIN_SOURCE

__all__ = ["GAUDI_STEP_SOURCE", "KvlogCalls", "runner_module"]

GAUDI_STEP_SOURCE = (
    MIXIN_SOURCE
    + '''

class HPUModelRunner(HpuKVConnectorModelRunnerMixin):
    """``sample_tokens``'s connector lines around the forward (``forward``)."""

    def __init__(self, forward):
        self.forward = forward

    def sample_tokens(self, scheduler_output):
        self.maybe_setup_kv_connector(scheduler_output)
        finished_sending, finished_recving = set(), set()
        sampled = self.forward(scheduler_output)
        self.maybe_wait_for_kv_save()
        finished_sending, finished_recving = self.get_finished_kv_transfers(scheduler_output)
        output = KVConnectorOutput(
            finished_sending=finished_sending,
            finished_recving=finished_recving,
        )
        if has_kv_transfer_group():
            get_kv_transfer_group().clear_connector_metadata()
        return sampled, output
'''
)
_ids = itertools.count()


class KvlogCalls:
    """The connector with each method called through ``call(name, method, *args)`` (the
    run's ``_conn``: kvlog's time, an exception kvlog's error; then the same call on the
    plain worker's shadow)."""

    def __init__(self, call: Callable[..., Any], connector: Any) -> None:
        self._call = call
        self._connector = connector

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self._connector, name)
        return lambda *args: self._call(name, method, *args)


def runner_module(connector: Callable[[], Any], switch: bool) -> types.ModuleType:
    """The runner's module over this connector (``connector()``: the configured one, or
    None for no connector), with kvlog's Gaudi switch applied when ``switch``."""
    from vllm.v1.outputs import KVConnectorOutput

    module = types.ModuleType(f"kvlog_harness_hpu_model_runner_{next(_ids)}")
    module.__dict__.update(
        KVConnectorOutput=KVConnectorOutput,
        has_kv_transfer_group=lambda: connector() is not None,
        get_kv_transfer_group=connector,
        get_forward_context=lambda: None,
    )
    exec(compile(GAUDI_STEP_SOURCE, "<vllm-gaudi runner shape>", "exec"), module.__dict__)
    if switch:
        from kvlog.integrations.gaudi import install

        sys.modules[module.__name__] = module
        try:
            patched = install([module.__name__])
        finally:
            del sys.modules[module.__name__]
        if f"{module.__name__}.KVConnectorOutput" not in patched:
            raise AssertionError(f"the Gaudi switch did not patch the runner: {patched}")
    return module

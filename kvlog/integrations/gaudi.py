"""Switch a vllm-gaudi deployment to kvlog with no edit to vLLM or vllm-gaudi.

kvlog registers a vLLM general plugin (entry point ``vllm.general_plugins``, name
``kvlog``), which vLLM loads in every engine and worker process. With ``KVLOG_GAUDI=1`` in
the environment it swaps, in the plugin's own monkeypatching style:

- ``OnlineDefragmenter`` in ``vllm_gaudi.extension.defragmentation`` and in every module
  that imported the name (the HPU model runner and worker), for
  :class:`GaudiDefragmenter`: kvlog's facade with its defaults from the plugin's
  ``get_config()`` (``defrag``, ``VLLM_DEFRAG_THRESHOLD``, ``VLLM_DEFRAG_WITH_GRAPHS``,
  ``prefix_caching``) where the plugin is importable, else from the environment;
- the runner's ``run_defragmenter``, so that ``update_state`` also gets what the
  scheduler output says about preemptions (``preempted_req_ids``) and full tables (new
  and resumed requests), instead of kvlog inferring them;
- the runner's connector output (``get_finished_kv_transfers`` and the module's
  ``KVConnectorOutput``, :mod:`kvlog.integrations.gaudi_connector`), so that, when a connector
  is configured, its worker metadata (every store and load completion of vLLM's offloading
  connector) and stats reach the scheduler on every step, as vLLM's own runner hands them,
  not only on steps with nothing scheduled;
- the runner's ``_create_decode_input_data``, so that the decodes' block tables are resolved
  in one compiled pass a step instead of id by id (:mod:`kvlog.integrations.gaudi_decode`).

Without ``KVLOG_GAUDI`` the plugin does nothing. ``install()`` applies the same patches
by hand (tests call it on stand-in modules); it returns the patched module names.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections.abc import Iterable
from typing import Any

from kvlog.integrations.config import parse_bool
from kvlog.integrations.defragmenter import OnlineDefragmenter
from kvlog.integrations.gaudi_connector import patch_runner_module
from kvlog.integrations.gaudi_decode import patch_decode_inputs

__all__ = ["ENV_ENABLE", "GaudiDefragmenter", "install", "register", "run_defragmenter"]

ENV_ENABLE = "KVLOG_GAUDI"
DEFRAG_MODULE = "vllm_gaudi.extension.defragmentation"
RUNNER_MODULES = ("vllm_gaudi.v1.worker.hpu_model_runner", "vllm_gaudi.v1.worker.hpu_worker")
_log = logging.getLogger(__name__)


def _plugin_defaults() -> dict[str, Any]:
    """The Gaudi plugin's own defrag settings, where it is importable."""
    try:
        runtime = importlib.import_module("vllm_gaudi.extension.runtime")
        config = runtime.get_config()
    except Exception:  # no plugin, or its config is not ready: the environment decides
        return {}
    out: dict[str, Any] = {"prefix_caching": bool(config.prefix_caching)}
    for name, key in (("defrag", "defrag"), ("threshold", "VLLM_DEFRAG_THRESHOLD")):
        value = getattr(config, key, None)
        if value is not None:
            out[name] = bool(value) if name == "defrag" else int(value)
    return out


class GaudiDefragmenter(OnlineDefragmenter):
    """kvlog's defragmenter as the runner builds it: ``(kv_caches, block_size)``."""

    def __init__(self, kv_caches: Any = None, block_size: int | None = None, **kwargs: Any):
        for name, value in _plugin_defaults().items():
            kwargs.setdefault(name, value)
        super().__init__(kv_caches, block_size, **kwargs)


def _flatten(block_ids: Any) -> list[int]:
    """vLLM's per-group tuple of block-id lists, flattened (the runner's ``flatten``)."""
    if block_ids and isinstance(block_ids[0], (list, tuple)):
        return [int(b) for group in block_ids for b in group]
    return [int(b) for b in block_ids]


def run_defragmenter(self: Any, scheduler_output: Any, warmup_mode: bool = False) -> None:
    """The runner's ``run_defragmenter``, passing preemptions and full tables along."""
    defragmenter = getattr(self, "defragmenter", None)
    if not (defragmenter and defragmenter.enabled and self.kv_caches and not warmup_mode):
        return
    new = {r.req_id: _flatten(r.block_ids) for r in scheduler_output.scheduled_new_reqs}
    cached_reqs = scheduler_output.scheduled_cached_reqs
    cached = {
        req_id: _flatten(block_ids)
        for req_id, block_ids in zip(cached_reqs.req_ids, cached_reqs.new_block_ids, strict=True)
        if block_ids
    }
    whole = set(new) | set(getattr(cached_reqs, "resumed_req_ids", ()) or ())
    preempted = getattr(scheduler_output, "preempted_req_ids", None) or ()
    blocks = {r: b for r, b in (new | cached).items() if b}
    if isinstance(defragmenter, OnlineDefragmenter):
        defragmenter.update_state(blocks, scheduler_output.finished_req_ids, preempted, whole)
    else:
        defragmenter.update_state(blocks, scheduler_output.finished_req_ids)
    defragmenter.defragment()


def install(module_names: Iterable[str] | None = None) -> list[str]:
    """Patch the defragmenter class, the runner's call site and its connector output; the
    patched names."""
    names = [DEFRAG_MODULE, *RUNNER_MODULES] if module_names is None else list(module_names)
    patched: list[str] = []
    for name in names:
        module = sys.modules.get(name)
        if module is None:
            try:
                module = importlib.import_module(name)
            except Exception as error:  # e.g. no habana_frameworks on this machine
                _log.warning("kvlog: cannot patch %s: %s", name, error)
                continue
        if hasattr(module, "OnlineDefragmenter"):
            setattr(module, "OnlineDefragmenter", GaudiDefragmenter)  # noqa: B010
            patched.append(name)
        for value in list(vars(module).values()):
            if isinstance(value, type) and "run_defragmenter" in vars(value):
                setattr(value, "run_defragmenter", run_defragmenter)  # noqa: B010
                patched.append(f"{name}.{value.__name__}.run_defragmenter")
        patched += patch_runner_module(module)
        patched += patch_decode_inputs(module)
    return patched


def register() -> None:
    """The vLLM general-plugin entry point: ``install()`` when ``KVLOG_GAUDI`` is set."""
    if parse_bool(ENV_ENABLE, os.environ.get(ENV_ENABLE, "0") or "0"):
        _log.info("kvlog: patched %s", ", ".join(install()))

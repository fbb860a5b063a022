"""The connector's worker metadata and stats, handed to the scheduler by vllm-gaudi's runner.

vLLM's GPU runner ends every step with the connector in one order (its
``KVConnectorModelRunnerMixin._get_kv_connector_output``): ``wait_for_save``, the finished
transfers, then ``get_block_ids_with_load_errors``, ``get_kv_connector_stats``,
``get_kv_connector_kv_cache_events`` and ``build_connector_worker_meta`` into the step's
``KVConnectorOutput``, then ``clear_connector_metadata``. vllm-gaudi's
``HPUModelRunner.sample_tokens`` stops after the finished transfers
(``get_finished_kv_transfers``) and builds ``KVConnectorOutput(finished_sending=...,
finished_recving=...)``: the rest reaches the scheduler only on steps with nothing scheduled
(vLLM's own ``kv_connector_no_forward``). vLLM's offloading connector reports every store and
load completion in the worker metadata (``OffloadingWorkerMetadata.completed_jobs``), so on
forward steps the scheduler never learns of them, and asserts (``any_job.is_store``) once a
request with a load still pending in its books gets a store.

:func:`patch_runner_module` completes the runner's output where it is built, in the runner
module, with no edit to vLLM or vllm-gaudi:

- ``get_finished_kv_transfers`` (on the class of the module that defines it) marks the step
  when a connector is configured (the module's own ``has_kv_transfer_group()``); warm-up
  steps never call it, so they stay as they are;
- the module's ``KVConnectorOutput`` becomes a builder that, on a marked step, asks the
  connector (``get_kv_transfer_group()``) for every field vLLM's runner fills that the
  caller left out and this vLLM's ``KVConnectorOutput`` has, in vLLM's order, then builds
  vLLM's own class. The marked step ends with it (before the runner's
  ``clear_connector_metadata``, as in vLLM).

The calls are the connector's public methods, made once a step as vLLM's runner makes them:
completions are handed over the step they are reported, none twice, none lost (an output
never built leaves them with the connector for the next step).
"""

from __future__ import annotations

import functools
import logging
import threading
import types
from collections.abc import Callable
from dataclasses import fields, is_dataclass
from typing import Any

__all__ = [
    "CONNECTOR_EXTRAS",
    "FINISHED_HOOK",
    "OUTPUT_NAME",
    "RUNNER_GLOBALS",
    "connector_extras",
    "patch_runner_module",
]

# (KVConnectorOutput field, connector method), in the order vLLM's GPU runner calls them
CONNECTOR_EXTRAS: tuple[tuple[str, str], ...] = (
    ("invalid_block_ids", "get_block_ids_with_load_errors"),
    ("kv_connector_stats", "get_kv_connector_stats"),
    ("kv_cache_events", "get_kv_connector_kv_cache_events"),
    ("kv_connector_worker_meta", "build_connector_worker_meta"),
)
OUTPUT_NAME = "KVConnectorOutput"  # the runner module's global it builds its output with
FINISHED_HOOK = "get_finished_kv_transfers"  # the runner's call for the finished transfers
# the runner module's globals the patch uses (imported there from vllm.distributed.kv_transfer)
RUNNER_GLOBALS = ("has_kv_transfer_group", "get_kv_transfer_group")
_PATCHED = "__kvlog_patched__"
_log = logging.getLogger(__name__)


def connector_extras(connector: Any, output_type: Any, given: Any) -> dict[str, Any]:
    """What vLLM's runner adds to the output: each field of ``output_type`` in
    :data:`CONNECTOR_EXTRAS` not in ``given``, from the connector's method of that name."""
    have = {f.name for f in fields(output_type)} if is_dataclass(output_type) else set()
    out: dict[str, Any] = {}
    for field_name, method in CONNECTOR_EXTRAS:
        call = getattr(connector, method, None)
        if field_name in have and field_name not in given and callable(call):
            value = call()
            if value is not None:  # None is each field's default or "nothing"
                out[field_name] = value
    return out


class _Step(threading.local):
    """Whether this thread's runner asked for the finished transfers of a step with a
    connector and has not built the step's output yet."""

    marked = False


def _output_builder(module: types.ModuleType, output_type: Any, step: _Step) -> Any:
    """The module's ``KVConnectorOutput``: vLLM's class, completed on a marked step."""

    @functools.wraps(output_type, updated=())
    def build(*args: Any, **kwargs: Any) -> Any:
        if step.marked:
            step.marked = False
            connector = getattr(module, RUNNER_GLOBALS[1])()
            kwargs.update(connector_extras(connector, output_type, kwargs))
        return output_type(*args, **kwargs)

    setattr(build, _PATCHED, output_type)
    return build


def _finished_hook(module: types.ModuleType, raw: Any, step: _Step) -> Any:
    """``get_finished_kv_transfers`` (static or not, as the class has it), marking the step."""
    inner: Callable[..., Any] = raw.__func__ if isinstance(raw, staticmethod) else raw

    @functools.wraps(inner)
    def get_finished_kv_transfers(*args: Any, **kwargs: Any) -> Any:
        finished = inner(*args, **kwargs)
        step.marked = bool(getattr(module, RUNNER_GLOBALS[0])())
        return finished

    setattr(get_finished_kv_transfers, _PATCHED, inner)
    if isinstance(raw, staticmethod):
        return staticmethod(get_finished_kv_transfers)
    return get_finished_kv_transfers


def _hook_owners(module: types.ModuleType) -> list[type]:
    """The module's classes that define the finished-transfers call themselves."""
    return [
        value
        for value in vars(module).values()
        if isinstance(value, type)
        and value.__module__ == module.__name__
        and FINISHED_HOOK in vars(value)
    ]


def patch_runner_module(module: types.ModuleType) -> list[str]:
    """Complete the connector output the runner module builds; the names patched (none if
    the module lacks a piece: then it is left as it is, with a warning)."""
    output_type = vars(module).get(OUTPUT_NAME)
    owners = _hook_owners(module)
    missing = [n for n in RUNNER_GLOBALS if not callable(vars(module).get(n))]
    if output_type is None or not owners or missing:
        if output_type is not None or owners:
            _log.warning(
                "kvlog: %s has no %s; its connector output is left as it is",
                module.__name__,
                ", ".join(missing or ([FINISHED_HOOK] if not owners else [OUTPUT_NAME])),
            )
        return []
    if getattr(output_type, _PATCHED, None) is not None:
        return []  # patched already
    step = _Step()
    setattr(module, OUTPUT_NAME, _output_builder(module, output_type, step))
    patched = [f"{module.__name__}.{OUTPUT_NAME}"]
    for owner in owners:
        raw = vars(owner)[FINISHED_HOOK]
        setattr(owner, FINISHED_HOOK, _finished_hook(module, raw, step))
        patched.append(f"{module.__name__}.{owner.__name__}.{FINISHED_HOOK}")
    return patched

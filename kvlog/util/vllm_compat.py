"""Every difference between the vLLM releases kvlog supports, owned by this one module.

vLLM changes its connector API every few releases. kvlog reaches vLLM's moving parts only
through the functions here (no other kvlog module names a private vLLM attribute):

=========================  ==============  ========================  ==============
what                       vLLM 0.26       vLLM 0.33                 vLLM 0.34
=========================  ==============  ========================  ==============
connector worker __init__  (spec, kv_cfg)  (spec, vllm_cfg, kv_cfg)  as 0.33
CPU tier size              ``num_blocks``  ``num_chunks``            ``num_chunks``
``ReqContext`` state       none            ``get/set_state``         as 0.33
load entries               async only      ``sync`` loads            as 0.33
worker submit_*            specs           specs (+ expedited)       device pointers
CPU manager rule           ``vllm-0.26``   ``vllm-0.33``             ``vllm-0.34``
model runner output        V1 (V2: Triton) V1 and V2                 V2 only
finished requests' stores  uncomputed KV   computed KV only          as 0.33
=========================  ==============  ========================  ==============

Feature detection where vLLM's objects show the difference (a method's parameters, an
attribute, a module's names); the release number only to refuse, at connector start, a vLLM
kvlog was never run on (:func:`unsupported`; the connector raises ``UnsupportedVllm``).
Importing this module does not import vLLM: its functions take vLLM's objects, and the few
that need vLLM's classes import them when called. It imports nothing of kvlog, so every
layer that meets vLLM
(``synth``'s scheduler loop, ``tier``'s recorder, ``integrations``' connector) uses it;
``kvlog.integrations.SUPPORTED_VLLM`` is this module's.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import re
import weakref
from collections.abc import Mapping
from typing import Any

__all__ = [
    "SUPPORTED_VLLM",
    "ContextMarks",
    "IdentityPointers",
    "attach_worker",
    "clamp_finished_stores",
    "connector_worker_args",
    "has_touch",
    "installed_vllm",
    "is_cpu_manager",
    "is_store_writer",
    "kv_cache_tensors",
    "load_is_sync",
    "manager_rule",
    "runner_output_fields",
    "resumed_req_ids",
    "spec_num_chunks",
    "supported",
    "takes_device_pointers",
    "tier_fields",
    "unsupported",
]

SUPPORTED_VLLM = ("0.26.0", "0.33.0", "0.34.0")
"""The vLLM releases kvlog supports and CI runs (a patch release of one counts as it)."""

_RELEASE = re.compile(r"^(\d+)\.(\d+)\.(\d+)")


def installed_vllm() -> str:
    """The installed vLLM's version string ("" where none is installed)."""
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return ""


def supported(version: str) -> bool:
    """Whether ``version`` is a supported release or a patch release of one."""
    match = _RELEASE.match(version)
    if match is None:
        return False
    minor = match.group(1, 2)
    return any(_RELEASE.match(v).group(1, 2) == minor for v in SUPPORTED_VLLM)  # type: ignore[union-attr]


def unsupported(version: str | None = None) -> str | None:
    """None where ``version`` (default: the installed vLLM's) is supported; else what was
    found ("none": no vLLM), for the refusal (``kvlog.errors.UnsupportedVllm``)."""
    found = installed_vllm() if version is None else version
    return None if supported(found) else found or "none"


# -- the connector worker ---------------------------------------------------------------------
def connector_worker_args(
    worker_class: type, spec: Any, vllm_config: Any, kv_cache_config: Any
) -> tuple[Any, ...]:
    """The arguments ``worker_class.__init__`` takes: ``(spec, vllm_config, kv_cache_config)``
    (0.33 on) or ``(spec, kv_cache_config)`` (0.26)."""
    params = inspect.signature(worker_class).parameters
    if "vllm_config" in params:
        return (spec, vllm_config, kv_cache_config)
    return (spec, kv_cache_config)


def is_store_writer(worker: Any) -> bool:
    """Whether this rank submits stores (0.33 on: replicated layouts write on one rank)."""
    return bool(getattr(worker, "_is_store_writer", True))


def load_is_sync(entry: Any) -> bool:
    """Whether a load job runs within its step (0.33 on; 0.26 has async loads only)."""
    return bool(getattr(entry, "sync", False))


def spec_num_chunks(spec: Any) -> int:
    """The CPU tier's size in chunks of ``blocks_per_chunk`` GPU blocks (0.26: ``num_blocks``)."""
    count = getattr(spec, "num_chunks", None)
    return int(spec.num_blocks if count is None else count)


# -- 0.34's device pointers -------------------------------------------------------------------
def takes_device_pointers(worker_class: type) -> bool:
    """Whether vLLM's connector worker hands its worker device pointers instead of the
    scheduler's GPU specs (0.34: ``resolve_device_pointers`` in the worker's module)."""
    modules = {cls.__module__ for cls in worker_class.__mro__}  # vLLM's, or a subclass's base
    return any(hasattr(importlib.import_module(m), "resolve_device_pointers") for m in modules)


class IdentityPointers:
    """Canonical KV caches whose "pointers" are the scheduler's own block ids.

    vLLM 0.34's connector worker turns each GPU spec into device pointers
    (``base + block_id * stride(0)`` of every data reference of its group) before handing it
    to the worker. kvlog pins and resolves the scheduler's logical ids (it declares every job
    from the specs when the metadata is bound); over these caches (one data reference per
    group, base ``base``, stride 1) vLLM's pointers are ``base + logical id``, which
    :meth:`spec_of` turns back into the spec exactly."""

    def __init__(self, kv_cache_config: Any) -> None:
        import torch
        from vllm.v1.kv_offload.base import (
            CanonicalKVCacheRef,
            CanonicalKVCaches,
            CanonicalKVCacheTensor,
        )

        self._anchor = torch.zeros((1, 1), dtype=torch.int8)
        self.base = int(self._anchor.data_ptr())
        tensor = CanonicalKVCacheTensor(tensor=self._anchor, page_size_bytes=1)
        refs = [
            [CanonicalKVCacheRef(tensor_idx=0, page_size_bytes=1)]
            for _ in range(_num_offloaded_groups(kv_cache_config))
        ]
        self.caches = CanonicalKVCaches(tensors=[tensor], group_data_refs=refs)

    def spec_of(self, pointers: Any) -> Any:
        """The GPU spec (``block_ids``, ``group_sizes``, ``block_indices``) vLLM resolved
        into ``pointers``; anything without ``ptrs`` is returned as it is."""
        ptrs = getattr(pointers, "ptrs", None)
        if ptrs is None:
            return pointers
        return _LogicalSpec(
            [int(p) - self.base for p in ptrs.tolist()],
            tuple(int(n) for n in pointers.group_block_counts),
            tuple(int(i) for i in pointers.block_indices),
        )


class _LogicalSpec:
    """A GPU spec's fields, as kvlog's offloading worker reads them."""

    __slots__ = ("block_ids", "block_indices", "group_sizes")

    def __init__(
        self, block_ids: list[int], group_sizes: tuple[int, ...], block_indices: tuple[int, ...]
    ) -> None:
        self.block_ids = block_ids
        self.group_sizes = group_sizes
        self.block_indices = block_indices


class _PointerWorker:
    """kvlog's worker as vLLM 0.34 calls it: device pointers in, the scheduler's specs on."""

    def __init__(self, worker: Any, pointers: IdentityPointers) -> None:
        self.worker = worker
        self.pointers = pointers

    def __getattr__(self, name: str) -> Any:
        return getattr(self.worker, name)

    def submit_store(self, job_id: int, device_ptrs: Any, dst_spec: Any) -> bool:
        return bool(self.worker.submit_store(job_id, self.pointers.spec_of(device_ptrs), dst_spec))

    def submit_load(
        self, job_id: int, src_spec: Any, device_ptrs: Any, expedited: bool = False
    ) -> bool:
        spec = self.pointers.spec_of(device_ptrs)
        return bool(self.worker.submit_load(job_id, src_spec, spec, expedited))


def attach_worker(
    connector_worker: Any, worker: Any, worker_class: type, kv_cache_config: Any
) -> None:
    """Make ``worker`` (kvlog's) the one vLLM's ``connector_worker`` submits to: as it is,
    or where vLLM resolves device pointers first (0.34), behind :class:`IdentityPointers`
    over caches vLLM resolves the scheduler's block ids against."""
    if not takes_device_pointers(worker_class):
        connector_worker.worker = worker
        return
    pointers = IdentityPointers(kv_cache_config)
    connector_worker._kv_caches = pointers.caches
    connector_worker.worker = _PointerWorker(worker, pointers)


def _num_offloaded_groups(kv_cache_config: Any) -> int:
    try:
        config = importlib.import_module(
            "vllm.distributed.kv_transfer.kv_connector.v1.offloading.config"
        )
        return len(config.get_offloading_group_ids(kv_cache_config))
    except (ImportError, AttributeError):
        return len(kv_cache_config.kv_cache_groups)


# -- the scheduler side's stores ----------------------------------------------------------------
def clamp_finished_stores(connector_scheduler: Any) -> bool:
    """Keep vLLM 0.26's scheduler side from storing KV that was never computed.

    0.26 stores a finished request's chunks up to ``num_tokens``, with vLLM's own worker too:
    an aborted request's tokens past ``num_computed_tokens`` (never computed: garbage in the
    CPU tier, or an ``assert len(offload_keys) == len(offload_block_ids)`` in
    ``_build_store_jobs`` where no block backs them); a request preempted, then finished by
    the output of the step before (async scheduling), from the blocks it held before its
    preemption, which vLLM has given to other requests since; and a finished request's last
    sampled token, whose KV no forward wrote. Where ``_build_store_jobs`` does not tell
    aborted requests apart (0.26), this scheduler's ``_calc_num_offloadable_tokens`` caps a
    finished request at ``num_computed_tokens`` (0 after a preemption), and a request not
    aborted also at 0.33's ``max(num_prompt_tokens, num_tokens - 1)``. True where it did."""
    build = getattr(type(connector_scheduler), "_build_store_jobs", None)
    code = getattr(build, "__code__", None)
    if code is None or "FINISHED_ABORTED" in code.co_names:
        return False
    from vllm.v1.request import RequestStatus

    offloadable = connector_scheduler._calc_num_offloadable_tokens

    def capped(req_status: Any, num_tokens: int) -> int:
        req = req_status.req
        if req.is_finished():
            bound = req.num_computed_tokens
            if req.status != RequestStatus.FINISHED_ABORTED:
                bound = min(bound, max(req.num_prompt_tokens, req.num_tokens - 1))
            num_tokens = min(num_tokens, bound)
        return int(offloadable(req_status, num_tokens))

    connector_scheduler._calc_num_offloadable_tokens = capped
    return True


# -- the CPU offloading manager ---------------------------------------------------------------
def manager_rule(manager: Any) -> str:
    """Which vLLM's ``CPUOffloadingManager`` this is (``TIER_RULES``): ``vllm-0.26`` counts a
    tier of blocks and offers at lookup; ``vllm-0.34`` counts a key toward
    ``store_threshold`` once per request and has no ``touch``; else ``vllm-0.33``."""
    if not hasattr(manager, "_num_chunks") and hasattr(manager, "_num_blocks"):
        return "vllm-0.26"
    record = getattr(manager, "_record_accesses", None)
    if record is not None and "counted" in inspect.signature(record).parameters:
        return "vllm-0.34"
    return "vllm-0.33"


def is_cpu_manager(manager: Any) -> bool:
    """Whether ``manager`` is a ``CPUOffloadingManager`` (with one eviction policy)."""
    return hasattr(manager, "_policy") and (
        hasattr(manager, "_num_chunks") or hasattr(manager, "_num_blocks")
    )


def has_touch(manager: Any) -> bool:
    """Whether the manager takes ``touch(keys, req_context)`` (gone in 0.34)."""
    return callable(getattr(manager, "touch", None))


def tier_fields(manager: Any) -> dict[str, Any]:
    """A vLLM ``CPUOffloadingManager``'s ``TierConfigured`` fields: its size in chunks, its
    eviction policy, store threshold, tracker size, and rule (:func:`manager_rule`)."""
    policy = type(manager._policy).__name__
    num_chunks = getattr(manager, "_num_chunks", None)
    return {
        "num_chunks": int(manager._num_blocks if num_chunks is None else num_chunks),
        "eviction": "arc" if policy.startswith("ARC") else "lru",
        "store_threshold": int(manager.store_threshold),
        "max_tracker_size": int(manager.max_tracker_size),
        "rule": manager_rule(manager),
    }


class ContextMarks:
    """kvlog's per-request mark of a ``ReqContext`` and the key positions vLLM set on it.

    0.33 on: kept in the context's own typed state (``set_state``), as the manager keeps
    its own. 0.26's contexts have no state: the mark is kept here, by the context's
    identity, for as long as the context lives."""

    def __init__(self) -> None:
        self._marks: dict[int, tuple[weakref.ref[Any], Any]] = {}

    def get(self, context: Any, kind: type) -> Any:
        if hasattr(context, "get_state"):
            return context.get_state(kind)
        entry = self._marks.get(id(context))
        return entry[1] if entry is not None and entry[0]() is context else None

    def set(self, context: Any, mark: Any) -> None:
        if hasattr(context, "set_state"):
            context.set_state(mark)
            return
        key = id(context)
        marks = self._marks
        marks[key] = (weakref.ref(context, lambda _ref: marks.pop(key, None)), mark)

    @staticmethod
    def positions(context: Any) -> Mapping[bytes, int]:
        """Key -> end-token position, in the order the scheduler set them (none on 0.26)."""
        positions: Mapping[bytes, int] = getattr(context, "_offload_key_positions", None) or {}
        return positions


# -- a model-less scheduler's KV cache config -------------------------------------------------
def kv_cache_tensors(tensor_class: type, total_bytes: int, layer_names: list[str]) -> list[Any]:
    """The ``kv_cache_tensors`` of a scheduler built with no model (``kvlog.synth``'s
    stubs): vLLM 0.26 sizes its CPU tier by their bytes (a ``KVCacheTensor(size,
    shared_by)``: one allocation for every layer); later releases, whose ``KVCacheTensor``
    describes placement, size it by the KV-cache groups when there is none."""
    if "shared_by" not in inspect.signature(tensor_class).parameters:
        return []
    return [tensor_class(size=total_bytes, shared_by=list(layer_names))]


# -- the scheduler's output and the model runner's ----------------------------------------------
def resumed_req_ids(cached_reqs: Any) -> Any:
    """The scheduled requests that resume from preemption with whole tables: the V1 runner
    shape's ``resumed_req_ids`` (0.34 sends resumed requests as new ones: none here)."""
    return getattr(cached_reqs, "resumed_req_ids", None) or frozenset()


def runner_output_fields(output_class: type, req_ids: list[str]) -> dict[str, Any]:
    """``ModelRunnerOutput``'s request fields: ``req_ids``, and ``req_id_to_index`` where
    the class still has it (the V1 runner's, gone in 0.34)."""
    fields: dict[str, Any] = {"req_ids": req_ids}
    if "req_id_to_index" in inspect.signature(output_class).parameters:
        fields["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
    return fields

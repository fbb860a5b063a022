"""The event and plan types of schema version 1 (see DESIGN.md).

Every type is a frozen, tagged ``msgspec.Struct``; the tag is the class name and is part of
the on-disk format, so a class is never renamed. The schema only grows: a new field goes at
the end with a default; no field is reordered or retyped.
"""

from __future__ import annotations

import itertools
import typing
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Literal

import msgspec
import numpy as np
import numpy.typing as npt

__all__ = [
    "CONFIG_DEFAULTS",
    "DEFAULT_PAD_SIZES",
    "HOLD_PREFIX",
    "DEFRAG_POLICIES",
    "SCHEMA_VERSION",
    "STEP_EVENTS",
    "BlocksAllocated",
    "CacheConfigured",
    "Checkpoint",
    "Event",
    "LoadRequested",
    "Plan",
    "Record",
    "RequestFinished",
    "RequestPreempted",
    "StepEnded",
    "StepPacked",
    "StepScheduled",
    "WHOLE_STEPS",
    "packed_counts",
    "packed_ids",
    "packed_step",
    "StoreRequested",
    "SwapPlan",
    "FencePlan",
    "TransferFinished",
    "TransferPlan",
    "TransferSubmitted",
    "BlocksReleased",
    "MAX_TIER_BATCH",
    "TIER_EVENTS",
    "TIER_EVICTIONS",
    "TIER_RULES",
    "TIER_LOOKUP_RESULTS",
    "TierEvent",
    "TierConfigured",
    "TierRequestStarted",
    "TierLookedUp",
    "TierTouched",
    "TierLoadPrepared",
    "TierLoadCompleted",
    "TierStorePrepared",
    "TierStoreCompleted",
    "TierRequestFinished",
    "TierReset",
    "TierBatch",
    "pair_bytes",
    "swap_mode",
]

HOLD_PREFIX = "kvlog-load-hold-"
"""Request ids of the placeholders that hold a load's blocks until a request claims them
(``kvlog.integrations.holds``) start with this, then a random 64-bit nonce per session:
vLLM accepts client-chosen request ids, and a runner request named like a placeholder must
never be taken for one (its blocks would be released with the placeholder's)."""

SCHEMA_VERSION = 1
DEFAULT_PAD_SIZES: tuple[int, ...] = (8, 16, 32, 64, 128, 256, 512)
DEFRAG_POLICIES: tuple[str, ...] = ("seed", "tail")
"""The defrag policies ``CacheConfigured.policy`` may name (see ``reducers/policies.py``)."""


class _Tagged(msgspec.Struct, frozen=True, tag_field="type", tag=True):
    """Base of every record type: frozen, tagged by class name."""


class CacheConfigured(_Tagged, frozen=True):
    """First event of every log: cache geometry and defrag policy."""

    num_gpu_blocks: int
    block_size: int
    num_cpu_blocks: int = 0
    block_size_factor: int = 1
    prefix_caching: bool = False
    defrag: bool = True
    threshold: int = 32
    max_swaps: int = 512
    pad_sizes: tuple[int, ...] = DEFAULT_PAD_SIZES
    page_size_bytes: int = 0
    # -- grown after schema 1 (each omitted from the state digest while at its default) --
    quarantine_released: bool = False
    """Blocks released since the last ``StepEnded`` are no defrag destination at the next
    one: a transfer the scheduler decided this step may still read them, and the worker
    learns of it only after the runner's defrag call (set by the vLLM connector)."""
    policy: str = "seed"
    """Defrag policy (``DEFRAG_POLICIES``): ``"seed"``, the seed's rule above, or ``"tail"``,
    vllm-gaudi PR #376's tail compaction (``kvlog/reducers/policies.py``)."""
    policy_ratio_pct: int = 150
    """``"tail"`` fires when ``max_used * 100 > policy_ratio_pct * num_used``."""
    policy_min_swaps: int = 4
    """``"tail"`` makes no plan of fewer than ``min(policy_min_swaps, cap)`` pairs."""
    max_bytes_per_step: int = 0
    """Any policy: one step's defrag moves at most this many bytes (0: no cap)."""


CONFIG_DEFAULTS: Mapping[str, Any] = MappingProxyType(
    dict(
        zip(
            CacheConfigured.__struct_fields__[-len(CacheConfigured.__struct_defaults__) :],
            CacheConfigured.__struct_defaults__,
            strict=True,
        )
    )
)
"""``CacheConfigured``'s defaults by field name (every field but the required geometry):
the one definition of the policy defaults, which ``SynthConfig`` and the facades' config
take theirs from."""


class BlocksAllocated(_Tagged, frozen=True):
    """New (logical) blocks appended to a request's block table."""

    req_id: str
    block_ids: list[int]


class RequestFinished(_Tagged, frozen=True):
    """Release a request's blocks; a request that never got blocks is a no-op."""

    req_id: str


class RequestPreempted(_Tagged, frozen=True):
    """Release a request's blocks; it may come back later with a fresh table."""

    req_id: str


class StepEnded(_Tagged, frozen=True):
    """End of one scheduler step: the defrag decision is taken here."""

    step: int


class StoreRequested(_Tagged, frozen=True):
    """Offload (logical) GPU blocks to CPU blocks.

    ``group_sizes`` / ``block_indices`` (vLLM 0.33's ``GPULoadStoreSpec``): the GPU blocks
    per KV-cache group, and each group's first block index within its request; given, the
    CPU sub-blocks follow vLLM's chunk rule (see ``reducers/transfers.py``); empty, the
    seed's count rule. ``deferred``: the scheduler decided the store now, but it reads KV
    still being computed; its blocks are pinned at once and its plan comes with
    ``TransferSubmitted`` (or earlier, when the scheduler reuses a block it reads).
    """

    job_id: int
    gpu_block_ids: list[int]
    cpu_block_ids: list[int]
    group_sizes: tuple[int, ...] = ()
    block_indices: tuple[int, ...] = ()
    deferred: bool = False


class LoadRequested(_Tagged, frozen=True):
    """Load CPU blocks into (logical) GPU blocks (``group_sizes``, ``block_indices`` and
    ``deferred`` as for ``StoreRequested``: the vLLM connector declares every job of a step
    when it learns of them, in job-id order, and submits them later)."""

    job_id: int
    cpu_block_ids: list[int]
    gpu_block_ids: list[int]
    group_sizes: tuple[int, ...] = ()
    block_indices: tuple[int, ...] = ()
    deferred: bool = False


class TransferFinished(_Tagged, frozen=True):
    """A transfer completed; logged by the engine where the executor reported it."""

    job_id: int
    success: bool


class BlocksReleased(_Tagged, frozen=True):
    """Some of a live request's (logical) blocks were freed, the rest stay: what the vLLM
    facade proves about a preemption the runner did not report (a block the scheduler gave
    away was freed with every block its holder received up to then)."""

    req_id: str
    block_ids: list[int]


class TransferSubmitted(_Tagged, frozen=True):
    """The worker submits a deferred store or load: its ``TransferPlan`` runs now (a store
    whose plan already ran, because the scheduler reused one of its blocks, is a no-op)."""

    job_id: int


class StepScheduled(_Tagged, frozen=True):
    """One whole scheduler step as the runner gets it: applying it is exactly the Gaudi
    facade's ``update_state(allocated, finished, preempted, resumed)`` followed by
    ``defragment()``, i.e. the fine-grained events it stands for, in this order:
    ``RequestFinished`` for each of ``finished``, ``RequestPreempted`` for each of
    ``preempted``, then for each ``allocated`` request with blocks (in the dict's order) a
    ``RequestPreempted`` first if it is in ``resumed`` and holds a table (its list is its
    whole new table), then ``BlocksAllocated``; last ``StepEnded(step)``. The same state,
    plans and digest as those events; all or nothing (a refused step changes nothing).
    """

    step: int
    allocated: dict[str, list[int]]
    finished: list[str]
    preempted: list[str] = []
    resumed: list[str] = []


class StepPacked(_Tagged, frozen=True):
    """A ``StepScheduled`` whose allocations are packed as arrays: the form the log
    records a step in (the runner's path, ``Engine``), so that a replay decodes a step's
    hundreds of block ids straight into one array instead of a Python int each.

    ``req_ids`` are ``allocated``'s requests in order, ``counts`` how many block ids each
    has (little-endian int32, ``np.frombuffer(counts, "<i4")``) and ``block_ids`` all of them
    concatenated, ``id_bytes`` bytes each: 2 (little-endian uint16) where every id of the
    step is below 65,536, the pools most servers run, so that the log spends 2 bytes an id
    where msgpack spends 3; else 4 (little-endian int32); ``packed_ids`` reads them. It is
    exactly the ``StepScheduled`` with ``allocated = dict(zip(req_ids, the ids split by
    counts))`` (``allocated``, ``unpacked``): the same checks, refusals (and their
    messages), state, plans and digest.
    """

    step: int
    req_ids: list[str]
    counts: bytes
    block_ids: bytes
    finished: list[str]
    preempted: list[str] = []
    resumed: list[str] = []
    id_bytes: int = 4

    @property
    def allocated(self) -> dict[str, list[int]]:
        """``StepScheduled.allocated`` of this step (new lists at each call; the step's
        validation checks first that ``counts`` and ``block_ids`` fit ``req_ids``)."""
        counts = packed_counts(self)
        ids = packed_ids(self).tolist()
        ends = list(itertools.accumulate(counts))
        starts = [0, *ends][: len(ends)]
        return {r: ids[a:b] for r, a, b in zip(self.req_ids, starts, ends, strict=True)}

    def unpacked(self) -> StepScheduled:
        """The same step as a ``StepScheduled``."""
        return StepScheduled(
            step=self.step,
            allocated=self.allocated,
            finished=self.finished,
            preempted=self.preempted,
            resumed=self.resumed,
        )


_COUNT_DTYPE = np.dtype("<i4")
"""How a ``StepPacked`` stores its ``counts``."""
_ID_DTYPES: dict[int, np.dtype[Any]] = {2: np.dtype("<u2"), 4: _COUNT_DTYPE}
"""``StepPacked.id_bytes`` -> how its block ids are stored."""


def packed_counts(event: StepPacked) -> list[int]:
    """A ``StepPacked``'s counts, one per request, as ints (``counts`` a whole number of
    int32: the caller checks its length first, as the validation does)."""
    counts: list[int] = np.frombuffer(event.counts, dtype=_COUNT_DTYPE).tolist()
    return counts


def packed_ids(event: StepPacked) -> npt.NDArray[np.integer]:
    """A ``StepPacked``'s block ids, read in place (``id_bytes`` 2 or 4; its validation
    refuses any other)."""
    ids: npt.NDArray[np.integer] = np.frombuffer(event.block_ids, dtype=_ID_DTYPES[event.id_bytes])
    return ids


def packed_step(
    event: StepScheduled,
    block_ids: npt.NDArray[np.integer] | None = None,
    pool: int = 0,
) -> StepPacked:
    """``event`` as a ``StepPacked`` (its block ids all below 2**31; 2 bytes an id where all
    are below 65,536, else 4). ``block_ids``: all of ``allocated``'s ids concatenated, when
    the caller has them as an array already; ``pool`` (0: unknown): the caller knows every
    id lies in ``[0, pool)`` (a checked step's), so a pool of at most 65,536 blocks packs
    2 bytes an id without reading them, and a larger one reads only their maximum."""
    allocated = event.allocated
    counts = np.fromiter(map(len, allocated.values()), _COUNT_DTYPE, len(allocated))
    flat: npt.NDArray[np.integer]
    if block_ids is None:
        flat = np.fromiter(itertools.chain.from_iterable(allocated.values()), np.int64)
    else:
        flat = block_ids
    if pool:
        narrow = pool <= 1 << 16 or not flat.size or int(flat.max()) < 1 << 16
    else:
        narrow = not flat.size or (int(flat.min()) >= 0 and int(flat.max()) < 1 << 16)
    id_bytes = 2 if narrow else 4
    return StepPacked(
        step=event.step,
        req_ids=list(allocated),
        counts=counts.tobytes(),
        block_ids=flat.astype(_ID_DTYPES[id_bytes]).tobytes(),
        finished=event.finished,
        preempted=event.preempted,
        resumed=event.resumed,
        id_bytes=id_bytes,
    )


class Checkpoint(_Tagged, frozen=True):
    """A log record, not an event: the state digest after record ``seq`` was applied.

    Replay verifies these as it goes and may start from the latest one that carries a
    snapshot.
    """

    seq: int
    digest: str
    step: int = -1
    snapshot: bytes = b""


class SwapPlan(_Tagged, frozen=True):
    """Defrag moves: ``pairs`` of physical ``(src, dst)``, highest used into lowest free.

    ``mode`` is ``"swap"`` with prefix caching (free blocks may hold cached data, so both
    move) and ``"move"`` otherwise (one-way copy). ``padded_to`` is the pad bucket.
    """

    step: int
    pairs: list[tuple[int, int]]
    padded_to: int
    mode: Literal["swap", "move"]


def swap_mode(config: CacheConfigured) -> Literal["swap", "move"]:
    """The ``SwapPlan.mode`` of a configuration's defrag plans (see ``SwapPlan``)."""
    return "swap" if config.prefix_caching else "move"


def pair_bytes(page_size_bytes: int, mode: str) -> int:
    """Bytes one pair of a ``SwapPlan`` in ``mode`` moves: a page, or two for ``"swap"``
    (both blocks are copied). The one definition that budgets, tallies and reports use."""
    return page_size_bytes * (2 if mode == "swap" else 1)


class TransferPlan(_Tagged, frozen=True):
    """One store or load job, as ``(src, dst)`` sub-block pairs in physical ids.

    For a store, ``src`` is a physical GPU block id and ``dst`` a CPU sub-block id
    (``cpu_block_id * block_size_factor + k``); for a load the other way round.
    ``after_job_id`` is the previous job of the same direction, which this one must
    start after (-1 when there is none in flight).
    """

    job_id: int
    kind: Literal["store", "load"]
    pairs: list[tuple[int, int]]
    num_bytes: int
    after_job_id: int = -1


class FencePlan(_Tagged, frozen=True):
    """Later compute must not touch these jobs' blocks before the jobs finish.

    Emitted when the scheduler hands a block that an unfinished store still reads to a new
    request (vLLM fences its own reuse with ``jobs_to_flush``; the Gaudi runner does not).
    Executors wait for the jobs (or make the compute stream wait on them).
    """

    job_ids: list[int]


# -- the CPU tier: what the scheduler side asks of vLLM's CPUOffloadingManager -------------
# Keys are vLLM's ``OffloadKey`` bytes (block hash + 4-byte KV-cache group). ``context`` numbers
# the ``ReqContext`` object the call came with (a request may get a fresh one); ``positions``
# are the entries of that context's key positions (``set_offload_key_position``) set or
# changed since the context's previous event, as parallel lists. See reducers/cpu_tier.py.

TIER_LOOKUP_RESULTS: tuple[str, ...] = ("miss", "hit", "hit_pending", "retry")
TIER_EVICTIONS: tuple[str, ...] = ("lru", "arc")
TIER_RULES: tuple[str, ...] = ("vllm-0.33", "vllm-0.26", "vllm-0.34")
"""Which vLLM's ``CPUOffloadingManager`` a tier log follows (``TierConfigured.rule``):
``vllm-0.33`` (the default: every log written before the field); ``vllm-0.26``, a tier of
blocks whose store threshold counts lookups, with policies that know nothing of requests;
``vllm-0.34``, 0.33's with each key counted toward the store threshold once per request and
no ``touch``."""


class TierConfigured(_Tagged, frozen=True):
    """The CPU tier's configuration: ``num_chunks`` slots of ``blocks_per_chunk`` GPU
    blocks (``chunk_bytes`` each), ``eviction`` (``"lru"``/``"arc"``), ``store_threshold``
    (below 2: no admission filter) over a tracker of at most ``max_tracker_size`` keys;
    ``rule``: the vLLM release whose manager the tier follows (``TIER_RULES``)."""

    num_chunks: int
    eviction: str = "lru"
    store_threshold: int = 0
    max_tracker_size: int = 64_000
    blocks_per_chunk: int = 1
    tokens_per_chunk: int = 0
    chunk_bytes: int = 0
    rule: str = "vllm-0.33"


class TierRequestStarted(_Tagged, frozen=True):
    """``on_new_request``."""

    req_id: str
    context: int
    position_keys: list[bytes] = []
    positions: list[int] = []


class TierLookedUp(_Tagged, frozen=True):
    """``lookup(key)`` and the manager's answer (``TIER_LOOKUP_RESULTS``)."""

    req_id: str
    context: int
    key: bytes
    result: str
    position_keys: list[bytes] = []
    positions: list[int] = []


class TierTouched(_Tagged, frozen=True):
    """``touch(keys)``."""

    req_id: str
    context: int
    keys: list[bytes]
    position_keys: list[bytes] = []
    positions: list[int] = []


class TierLoadPrepared(_Tagged, frozen=True):
    """``prepare_load(keys)`` and the chunk (slot) of each key it answered."""

    req_id: str
    context: int
    keys: list[bytes]
    chunk_ids: list[int]
    position_keys: list[bytes] = []
    positions: list[int] = []


class TierLoadCompleted(_Tagged, frozen=True):
    """``complete_load(keys)``."""

    req_id: str
    context: int
    keys: list[bytes]


class TierStorePrepared(_Tagged, frozen=True):
    """``prepare_store(keys)`` and its answer: ``accepted`` False where it returned None;
    else the keys it chose to store, their chunks, and the keys it evicted for them."""

    req_id: str
    context: int
    keys: list[bytes]
    accepted: bool
    keys_to_store: list[bytes]
    chunk_ids: list[int]
    evicted_keys: list[bytes]
    position_keys: list[bytes] = []
    positions: list[int] = []


class TierStoreCompleted(_Tagged, frozen=True):
    """``complete_store(keys, success)``."""

    req_id: str
    context: int
    keys: list[bytes]
    success: bool = True


class TierRequestFinished(_Tagged, frozen=True):
    """``on_request_finished``."""

    req_id: str
    context: int
    position_keys: list[bytes] = []
    positions: list[int] = []


class TierReset(_Tagged, frozen=True):
    """``reset_cache``: every chunk dropped, a new cache generation."""

    generation: int = 0


TierEvent = (
    TierConfigured
    | TierRequestStarted
    | TierLookedUp
    | TierTouched
    | TierLoadPrepared
    | TierLoadCompleted
    | TierStorePrepared
    | TierStoreCompleted
    | TierRequestFinished
    | TierReset
)
TIER_EVENTS: frozenset[type] = frozenset(typing.get_args(TierEvent))
"""The CPU tier's events: the GPU books ignore them (``reducers/cpu_tier.py`` folds them)."""
MAX_TIER_BATCH = 1024
"""Most tier events one ``TierBatch`` holds (the recorder flushes sooner)."""


class TierBatch(_Tagged, frozen=True):
    """Several tier events in one record, in the order the manager was called: what the
    scheduler side's recorder writes once per scheduler step (``TierRecorder(batched=True)``),
    so that the scheduler's log costs one append a step instead of one a manager call.
    Readers see its events one by one (``kvlog.tier.replay.tier_events``); the GPU books
    ignore it. At most ``MAX_TIER_BATCH`` events, none of them a batch."""

    events: list[TierEvent]


MAX_TRANSFER_BATCH = 1 << 16
"""Most events in one ``TransferBatch`` (as many as ``MAX_JOBS_IN_FLIGHT``)."""
TransferEvent = StoreRequested | LoadRequested | TransferSubmitted | TransferFinished
"""The transfer events a ``TransferBatch`` holds."""


class TransferBatch(_Tagged, frozen=True):
    """Several transfer events as one, in order: what the vLLM connector logs once per
    call instead of one event a job (a step's job declarations at ``bind_connector_metadata``,
    their submissions at ``start_load_kv``; the Engine's finished transfers of one poll).

    Applying it is exactly applying its events one after another (``StoreRequested``,
    ``LoadRequested``, ``TransferSubmitted``, ``TransferFinished``): the same state, plans
    (concatenated) and digest. All or nothing: a batch is refused with the error of the
    first of its events that the fine-grained history would refuse, and then nothing of it
    is applied or logged. 1 to ``MAX_TRANSFER_BATCH`` events, none of them a batch.
    """

    events: list[TransferEvent]


Event = (
    CacheConfigured
    | BlocksAllocated
    | RequestFinished
    | RequestPreempted
    | StepEnded
    | StoreRequested
    | LoadRequested
    | TransferFinished
    | TransferSubmitted
    | BlocksReleased
    | StepScheduled
    | StepPacked
    | TierConfigured
    | TierRequestStarted
    | TierLookedUp
    | TierTouched
    | TierLoadPrepared
    | TierLoadCompleted
    | TierStorePrepared
    | TierStoreCompleted
    | TierRequestFinished
    | TierReset
    | TierBatch
    | TransferBatch
)
Record = Event | Checkpoint
STEP_EVENTS: frozenset[type] = frozenset({StepEnded, StepScheduled, StepPacked})
"""The events that end a scheduler step (each carries ``step``): checkpoints, group commits
and per-step statistics count them."""
WHOLE_STEPS: frozenset[type] = frozenset({StepScheduled, StepPacked})
"""The events that stand for a whole scheduler step (``StepScheduled`` and its packed form)."""
Plan = SwapPlan | TransferPlan | FencePlan

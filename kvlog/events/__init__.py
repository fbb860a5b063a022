"""Events, plans and their codec: the schema of the kvlog log (version 1)."""

from kvlog.events.codec import decode, decode_plan, encode, to_dict, to_json
from kvlog.events.types import (
    DEFAULT_PAD_SIZES,
    SCHEMA_VERSION,
    BlocksAllocated,
    CacheConfigured,
    Checkpoint,
    Event,
    LoadRequested,
    Plan,
    Record,
    RequestFinished,
    RequestPreempted,
    StepEnded,
    StoreRequested,
    SwapPlan,
    TransferFinished,
    TransferPlan,
)
from kvlog.events.validate import validate_event

__all__ = [
    "DEFAULT_PAD_SIZES",
    "SCHEMA_VERSION",
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
    "StoreRequested",
    "SwapPlan",
    "TransferFinished",
    "TransferPlan",
    "decode",
    "decode_plan",
    "encode",
    "to_dict",
    "to_json",
    "validate_event",
]

"""Every bad input is a typed ``KvlogError`` (also the fitting
builtin), with or without a log, leaves the log and the digest unchanged, and the engine
goes on; a refused constructor leaves no file, descriptor or lock; numpy ids are accepted
and logged as plain ints.

The table holds over 90 bad inputs: out-of-range and non-integer ids, lone surrogates in
names (with and without a log), sizes no record can hold.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvlog.runtime.memory as memory_module
from kvlog import Engine, errors, reducers
from kvlog.events import (
    BlocksAllocated,
    CacheConfigured,
    Checkpoint,
    LoadRequested,
    RequestFinished,
    RequestPreempted,
    StepEnded,
    StoreRequested,
    SwapPlan,
    TransferFinished,
    TransferSubmitted,
)
from kvlog.events.validate import MAX_BLOCKS, MAX_GPU_BLOCKS
from kvlog.log import read_log

CONFIG = CacheConfigured(
    num_gpu_blocks=64, block_size=16, num_cpu_blocks=16, block_size_factor=2, threshold=8
)


class MyStep(StepEnded):
    """A subclass of an event type: it would not decode from the log as itself."""


def _engine(path: Path | None) -> Engine:
    """Request "a" holds 1..4, store job 5 reads blocks 1 and 2 into CPU block 0 (two GPU
    blocks per CPU block), step 3 ended."""
    engine = Engine(CONFIG, path, sync="always")
    engine.apply(BlocksAllocated("a", [1, 2, 3, 4]))
    engine.apply(StoreRequested(4, [3, 4], [1]))
    engine.apply(TransferFinished(4, True))
    engine.apply(StoreRequested(5, [1, 2], [0]))
    engine.apply(StepEnded(3))
    return engine


INVALID = errors.InvalidEvent
RANGE = errors.BlockOutOfRange
BAD_EVENTS: list[tuple[str, Any, type[Exception]]] = [
    ("second config", CONFIG, errors.AlreadyConfigured),
    # BlocksAllocated
    ("empty req_id", BlocksAllocated("", [9]), INVALID),
    ("int req_id", BlocksAllocated(5, [9]), INVALID),
    ("None req_id", BlocksAllocated(None, [9]), INVALID),
    ("long req_id", BlocksAllocated("x" * 4097, [9]), INVALID),
    ("lone surrogate req_id", BlocksAllocated("\ud800", [9]), INVALID),
    ("trailing surrogate req_id", BlocksAllocated("a\udcff", [9]), INVALID),
    ("block = pool size", BlocksAllocated("b", [64]), RANGE),
    ("negative block", BlocksAllocated("b", [-1]), RANGE),
    ("block 2**31", BlocksAllocated("b", [2**31]), RANGE),
    ("block 2**63", BlocksAllocated("b", [2**63]), RANGE),
    ("block 2**64", BlocksAllocated("b", [2**64]), RANGE),
    ("block -2**63-1", BlocksAllocated("b", [-(2**63) - 1]), RANGE),
    ("float block", BlocksAllocated("b", [1.5]), INVALID),
    ("str block", BlocksAllocated("b", ["9"]), INVALID),
    ("bool block", BlocksAllocated("b", [True]), INVALID),
    ("None block", BlocksAllocated("b", [None]), INVALID),
    ("duplicate block", BlocksAllocated("b", [9, 9]), errors.DuplicateBlock),
    ("block in use", BlocksAllocated("b", [2]), errors.BlockInUse),
    ("str block_ids", BlocksAllocated("b", "12"), INVALID),
    ("None block_ids", BlocksAllocated("b", None), INVALID),
    ("int block_ids", BlocksAllocated("b", 7), INVALID),
    ("set block_ids", BlocksAllocated("b", {9, 10}), INVALID),
    ("2-D array", BlocksAllocated("b", np.array([[9, 10]])), INVALID),
    ("float array", BlocksAllocated("b", np.array([9.0])), INVALID),
    ("bool array", BlocksAllocated("b", np.array([True])), INVALID),
    ("int32 array out of range", BlocksAllocated("b", np.array([64], np.int32)), RANGE),
    ("int32 array in use", BlocksAllocated("b", np.array([2], np.int32)), errors.BlockInUse),
    ("int64 array 2**40", BlocksAllocated("b", np.array([2**40])), RANGE),
    ("uint64 array 2**63", BlocksAllocated("b", np.array([2**63], np.uint64)), RANGE),
    (
        "int32 array duplicate",
        BlocksAllocated("b", np.array([9, 9], np.int32)),
        errors.DuplicateBlock,
    ),
    ("numpy float block", BlocksAllocated("b", [np.float64(9)]), INVALID),
    ("numpy int out of range", BlocksAllocated("b", [np.int64(64)]), RANGE),
    # RequestFinished, RequestPreempted
    ("finished empty req_id", RequestFinished(""), INVALID),
    ("finished int req_id", RequestFinished(3), INVALID),
    ("finished None req_id", RequestFinished(None), INVALID),
    ("finished surrogate req_id", RequestFinished("\udc80"), INVALID),
    ("preempted empty req_id", RequestPreempted(""), INVALID),
    ("preempted bytes req_id", RequestPreempted(b"a"), INVALID),
    ("preempted surrogate req_id", RequestPreempted("x\ud83d"), INVALID),
    ("preempted long req_id", RequestPreempted("y" * 5000), INVALID),
    # StepEnded
    ("step -1", StepEnded(-1), INVALID),
    ("step 2**63", StepEnded(2**63), INVALID),
    ("step 2**64", StepEnded(2**64), INVALID),
    ("step -2**64", StepEnded(-(2**64)), INVALID),
    ("str step", StepEnded("1"), INVALID),
    ("float step", StepEnded(1.0), INVALID),
    ("None step", StepEnded(None), INVALID),
    ("bool step", StepEnded(True), INVALID),
    ("numpy float step", StepEnded(np.float32(1)), INVALID),
    ("numpy int step -1", StepEnded(np.int64(-1)), INVALID),
    # StoreRequested
    ("job in flight", StoreRequested(5, [3, 4], [2]), errors.DuplicateJob),
    ("job used before", StoreRequested(4, [3, 4], [2]), errors.DuplicateJob),
    ("job id -1", StoreRequested(-1, [3, 4], [2]), INVALID),
    ("job id 2**63", StoreRequested(2**63, [3, 4], [2]), INVALID),
    ("job id 2**64", StoreRequested(2**64, [3, 4], [2]), INVALID),
    ("str job id", StoreRequested("6", [3, 4], [2]), INVALID),
    ("no GPU blocks", StoreRequested(6, [], [2]), INVALID),
    ("no CPU blocks", StoreRequested(6, [3, 4], []), INVALID),
    ("GPU block = pool", StoreRequested(6, [64, 3], [2]), RANGE),
    ("CPU block = pool", StoreRequested(6, [3, 4], [16]), RANGE),
    ("negative CPU block", StoreRequested(6, [3, 4], [-1]), RANGE),
    ("GPU block 2**63", StoreRequested(6, [2**63, 3], [2]), RANGE),
    ("CPU block 2**64", StoreRequested(6, [3, 4], [2**64]), RANGE),
    ("duplicate GPU", StoreRequested(6, [3, 3], [2]), errors.DuplicateBlock),
    ("duplicate CPU", StoreRequested(6, [1, 2, 3, 4], [2, 2]), errors.DuplicateBlock),
    ("3 GPU into 1 CPU", StoreRequested(6, [1, 2, 3], [2]), errors.TransferSizeMismatch),
    ("1 GPU into 2 CPU", StoreRequested(6, [3], [2, 3]), errors.TransferSizeMismatch),
    (
        "group sizes sum",
        StoreRequested(6, [3, 4], [2], group_sizes=(3,), block_indices=(0,)),
        INVALID,
    ),
    ("groups unpaired", StoreRequested(6, [3, 4], [2], group_sizes=(2,)), INVALID),
    ("str deferred", StoreRequested(6, [3, 4], [2], deferred="yes"), INVALID),
    ("str GPU id", StoreRequested(6, ["a", 3], [2]), INVALID),
    ("float CPU array", StoreRequested(6, [3, 4], np.array([2.0])), INVALID),
    # LoadRequested
    ("load job in flight", LoadRequested(5, [2], [9, 10]), errors.DuplicateJob),
    ("load of a CPU block a store writes", LoadRequested(6, [0], [20, 21]), errors.BlockInUse),
    ("load CPU 99", LoadRequested(6, [99], [9, 10]), RANGE),
    ("load 1 CPU into 3 GPU", LoadRequested(6, [2], [9, 10, 11]), errors.TransferSizeMismatch),
    ("load job -5", LoadRequested(-5, [2], [9, 10]), INVALID),
    ("load no GPU", LoadRequested(6, [2], []), INVALID),
    ("load GPU 2**64", LoadRequested(6, [2], [2**64, 9]), RANGE),
    # TransferFinished, TransferSubmitted
    ("unknown job", TransferFinished(99, True), errors.UnknownJob),
    ("finished job", TransferFinished(4, True), errors.UnknownJob),
    ("str success", TransferFinished(5, "yes"), INVALID),
    ("int success", TransferFinished(5, 1), INVALID),
    ("finish job -1", TransferFinished(-1, True), INVALID),
    ("finish job 2**64", TransferFinished(2**64, True), INVALID),
    ("finish None job", TransferFinished(None, True), INVALID),
    ("submit unknown job", TransferSubmitted(99), errors.UnknownJob),
    ("submit job 2**64", TransferSubmitted(2**64), INVALID),
    # not events
    ("subclass of an event", MyStep(4), errors.KvlogError),
    ("a plan", SwapPlan(0, [(5, 1)], 8, "move"), errors.KvlogError),
    ("a checkpoint", Checkpoint(0, "00"), errors.KvlogError),
    ("a dict", {"type": "StepEnded", "step": 4}, errors.KvlogError),
    ("None", None, errors.KvlogError),
    ("a str", "StepEnded", errors.KvlogError),
]


def _usable_after(engine: Engine) -> str:
    """The engine takes valid events after a refusal; the digest they lead to."""
    engine.apply(RequestFinished("a"))
    engine.apply(BlocksAllocated("c", np.array([60, 61], np.int32)))
    engine.apply(TransferFinished(5, True))
    engine.apply(StepEnded(4))
    return engine.digest()


@pytest.fixture(scope="module")
def expected_digest() -> str:
    return _usable_after(_engine(None))


def test_the_table_has_at_least_90_bad_inputs() -> None:
    assert len(BAD_EVENTS) + len(BAD_CONFIGS) + len(BAD_CALLS) >= 90


@pytest.mark.parametrize("with_log", [True, False], ids=["log", "no-log"])
@pytest.mark.parametrize(("name", "event", "expected"), BAD_EVENTS, ids=[c[0] for c in BAD_EVENTS])
def test_a_bad_event_is_typed_and_changes_nothing(
    tmp_path: Path, expected_digest: str, with_log: bool, name: str, event: Any, expected: type
) -> None:
    path = tmp_path / "a.kvlog" if with_log else None
    engine = _engine(path)
    digest, size = engine.digest(), path.stat().st_size if path else 0
    with pytest.raises(expected) as info:
        engine.apply(event)
    assert isinstance(info.value, errors.KvlogError) and isinstance(info.value, ValueError)
    assert engine.digest() == digest, f"{name}: the state changed"
    engine.snapshot()  # still encodable (a lone surrogate once broke both without a log)
    if path is not None:
        assert path.stat().st_size == size, f"{name}: the log changed"
    assert _usable_after(engine) == expected_digest
    engine.close()
    if path is not None:
        from kvlog import replay

        assert replay(path).ok


# -- constructor refusals: typed, no file, no descriptor, no lock ---------------------------
def _config(**fields: Any) -> CacheConfigured:
    base = {"num_gpu_blocks": 64, "block_size": 16}
    return CacheConfigured(**{**base, **fields})


BAD_CONFIGS: list[tuple[str, Any, type[Exception]]] = [
    ("no blocks", _config(num_gpu_blocks=0), INVALID),
    ("negative blocks", _config(num_gpu_blocks=-1), INVALID),
    ("2**31-1 blocks", _config(num_gpu_blocks=2**31 - 1), INVALID),
    ("above the bound", _config(num_gpu_blocks=MAX_GPU_BLOCKS + 1), INVALID),
    ("2**64 blocks", _config(num_gpu_blocks=2**64), INVALID),
    ("float blocks", _config(num_gpu_blocks=1.5), INVALID),
    ("block_size 0", _config(block_size=0), INVALID),
    ("negative CPU blocks", _config(num_cpu_blocks=-1), INVALID),
    ("factor 0", _config(block_size_factor=0), INVALID),
    ("negative threshold", _config(threshold=-1), INVALID),
    ("no pad sizes", _config(pad_sizes=()), INVALID),
    ("descending pad sizes", _config(pad_sizes=(16, 8)), INVALID),
    ("max_swaps 0", _config(max_swaps=0), INVALID),
    ("max_swaps above the pad", _config(max_swaps=1024), INVALID),
    ("str prefix_caching", _config(prefix_caching="yes"), INVALID),
    ("int defrag", _config(defrag=1), INVALID),
    ("negative page size", _config(page_size_bytes=-1), INVALID),
    ("unknown policy", _config(policy="nope"), INVALID),
    ("CPU id space", _config(num_cpu_blocks=MAX_BLOCKS, block_size_factor=2), INVALID),
    ("not a config", StepEnded(0), errors.NotConfigured),
    ("a config subclass", None, errors.KvlogError),
]


class MyConfig(CacheConfigured):
    """A subclass of CacheConfigured."""


BAD_CONFIGS[-1] = ("a config subclass", MyConfig(num_gpu_blocks=8, block_size=16), INVALID)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize(
    ("name", "config", "expected"), BAD_CONFIGS, ids=[c[0] for c in BAD_CONFIGS]
)
def test_a_refused_config_leaves_no_file_descriptor_or_lock(
    tmp_path: Path, name: str, config: Any, expected: type
) -> None:
    path = tmp_path / "a.kvlog"
    fds = _fds()
    with pytest.raises(expected) as info:
        Engine(config, path)
    assert isinstance(info.value, errors.KvlogError) and isinstance(info.value, ValueError)
    assert _fds() == fds, f"{name}: a descriptor leaked"
    assert not path.exists(), f"{name}: the refused config created the log"
    with pytest.raises(expected):
        Engine(config)  # the same without a log
    Engine(CONFIG, path).close()  # neither locked nor taken


def test_a_refused_constructor_on_a_touched_file_releases_it(tmp_path: Path) -> None:
    """The issue's case: after ``InvalidEvent`` any Engine on the path raised LogLocked."""
    path = tmp_path / "a.kvlog"
    path.touch()
    with pytest.raises(errors.InvalidEvent):
        Engine(CacheConfigured(num_gpu_blocks=0, block_size=16), log_path=path)
    with Engine(CONFIG, path) as engine:
        engine.apply(StepEnded(0))


def test_a_pool_this_machine_cannot_hold_is_refused_before_logging(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(memory_module, "available_memory", lambda: 10 << 20)
    path = tmp_path / "a.kvlog"
    fds = _fds()
    with pytest.raises(errors.StateTooLarge) as info:
        Engine(CacheConfigured(num_gpu_blocks=1_000_000, block_size=16), path)
    assert isinstance(info.value, MemoryError) and isinstance(info.value, ValueError)
    assert not path.exists() and _fds() == fds
    Engine(CacheConfigured(num_gpu_blocks=1000, block_size=16), path).close()


def test_the_pool_bound_allocates_nothing_before_refusing() -> None:
    """2**31-1 blocks passed validation and was logged; the state then needed ~40 GiB."""
    with pytest.raises(errors.InvalidEvent, match="num_gpu_blocks"):
        Engine(CacheConfigured(num_gpu_blocks=2**31 - 1, block_size=16))


def test_resolved_ids_never_wrap_into_a_narrow_dtype() -> None:
    """Block 299 in an int8 table came back as 43 (and in a uint64 list, 2**64-1 came back
    as padding, 1.9 as block 1): a table's dtype must hold every id of the pool."""
    engine = Engine(CacheConfigured(num_gpu_blocks=300, block_size=16, threshold=0))
    engine.apply(BlocksAllocated(req_id="a", block_ids=[0]))
    engine.apply(BlocksAllocated(req_id="b", block_ids=[299]))
    engine.apply(StepEnded(step=1))
    assert engine.resolve(1) == 299 and engine.resolve(299) == 1
    for narrow in (np.int8, np.uint8):
        with pytest.raises(INVALID, match="cannot hold the ids of a 300-block pool"):
            engine.resolve_all(np.array([[1, 0]], dtype=narrow))
        with pytest.raises(INVALID, match="cannot hold"):
            engine.state.resolve_array(np.array([1], dtype=narrow))
    resolved = engine.resolve_all(np.array([[1, 299, -1]], dtype=np.int16))
    assert resolved.dtype == np.int16 and resolved.tolist() == [[299, 1, -1]]
    assert engine.resolve_all([np.array([1], dtype=np.uint64), [299], []]) == [[299], [1], []]
    for bad in ([np.array([2**64 - 1], dtype=np.uint64)], [[1.9, 0.2]], [[True]], [[None]]):
        with pytest.raises(RANGE):
            engine.resolve_all(bad)
    engine.close()


BAD_CALLS: list[tuple[str, Callable[[Engine], object], type[Exception]]] = [
    ("sync", lambda e: Engine(CONFIG, sync="sometimes"), errors.ConfigError),
    ("checkpoint_every", lambda e: Engine(CONFIG, checkpoint_every=-1), errors.ConfigError),
    ("snapshot_every", lambda e: Engine(CONFIG, snapshot_every="1"), errors.ConfigError),
    ("resolve pool", lambda e: e.resolve(64), RANGE),
    ("resolve -1", lambda e: e.resolve(-1), RANGE),
    ("resolve 2**64", lambda e: e.resolve(2**64), RANGE),
    ("resolve str", lambda e: e.resolve("3"), INVALID),
    ("resolve_all 2**63", lambda e: e.resolve_all([[2**63]]), RANGE),
    ("resolve_all str", lambda e: e.resolve_all([["x"]]), RANGE),
    ("resolve_all float", lambda e: e.resolve_all(np.array([[1.5]])), INVALID),
    ("resolve_all pool", lambda e: e.resolve_all([[64]]), RANGE),
    ("restore garbage", lambda e: Engine.restore(b"garbage"), errors.CorruptLogError),
    ("restore int", lambda e: Engine.restore(123), errors.CorruptLogError),
    (
        "restore unconfigured",
        lambda e: Engine.restore(reducers.snapshot(reducers.initial_state())),
        errors.NotConfigured,
    ),
]


@pytest.mark.parametrize(("name", "call", "expected"), BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_a_bad_argument_is_typed(
    name: str, call: Callable[[Engine], object], expected: type
) -> None:
    engine = _engine(None)
    digest = engine.digest()
    with pytest.raises(expected) as info:
        call(engine)
    assert isinstance(info.value, errors.KvlogError) and isinstance(info.value, ValueError)
    assert engine.digest() == digest


# -- numpy ids are accepted and logged as plain ints ----------------------------------------
def test_numpy_ids_are_accepted_and_logged_as_plain_ints(tmp_path: Path) -> None:
    plain, numpy_path = tmp_path / "plain.kvlog", tmp_path / "numpy.kvlog"
    as_numpy = [
        BlocksAllocated("r", np.array([7, 8, 9], np.int32)),
        StoreRequested(np.int64(10), np.array([7, 8], np.int32), [np.int32(1)]),
        TransferFinished(np.int32(10), np.True_),
        LoadRequested(np.uint16(11), np.array([2], np.int64), np.array([20, 21], np.int32)),
        StepEnded(np.int64(0)),
    ]
    as_plain = [
        BlocksAllocated("r", [7, 8, 9]),
        StoreRequested(10, [7, 8], [1]),
        TransferFinished(10, True),
        LoadRequested(11, [2], [20, 21]),
        StepEnded(0),
    ]
    digests = []
    for path, events in ((plain, as_plain), (numpy_path, as_numpy)):
        with Engine(CONFIG, path, sync="none") as engine:
            for event in events:
                engine.apply(event)
            digests.append(engine.digest())
    assert digests[0] == digests[1]
    logged = [r for _, r in read_log(numpy_path) if not isinstance(r, Checkpoint)][1:]
    assert logged == as_plain
    assert all(type(b) is int for r in logged for b in getattr(r, "gpu_block_ids", []))
    no_log = Engine(CONFIG)
    for event in as_numpy:
        no_log.apply(event)
    assert no_log.digest() == digests[0]

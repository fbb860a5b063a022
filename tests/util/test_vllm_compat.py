"""The vLLM adapter (``kvlog.util.vllm_compat``) without vLLM: the version gate and its
one-line refusal, and each feature test on stand-ins shaped like each release's objects.
The real releases run the connector through it in their CI stages
(``tests/vllm/test_versions.py``)."""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvlog.errors import ConfigError, UnsupportedVllm
from kvlog.events import TIER_RULES, TierConfigured
from kvlog.integrations import SUPPORTED_VLLM
from kvlog.tier.record import tier_config_of
from kvlog.util import vllm_compat


@pytest.mark.parametrize(
    ("version", "ok"),
    [
        ("0.26.0", True),
        ("0.33.0", True),
        ("0.34.0", True),
        ("0.33.1", True),
        ("0.34.0+cpu", True),
        ("0.25.1", False),
        ("0.27.0", False),
        ("1.0.0", False),
        ("", False),
        ("main", False),
    ],
)
def test_supported_releases_and_their_patch_releases(version: str, ok: bool) -> None:
    assert vllm_compat.supported(version) is ok


def test_an_unsupported_vllm_is_refused_in_one_line_naming_the_supported() -> None:
    assert vllm_compat.unsupported("0.34.0") is None
    assert vllm_compat.unsupported("") == "none"
    found = vllm_compat.unsupported("0.25.1")
    assert found == "0.25.1"
    error = UnsupportedVllm(found, SUPPORTED_VLLM)
    message = str(error)
    assert "\n" not in message
    assert "0.25.1" in message
    for version in SUPPORTED_VLLM:
        assert version in message
    assert isinstance(error, ImportError)  # also a builtin, as every kvlog error
    assert error.found == "0.25.1" and error.supported == SUPPORTED_VLLM


def test_supported_vllm_is_public_and_names_three_releases() -> None:
    assert SUPPORTED_VLLM == ("0.26.0", "0.33.0", "0.34.0")
    assert not isinstance(UnsupportedVllm("x", SUPPORTED_VLLM), ConfigError)


class _Worker026:
    def __init__(self, spec: Any, kv_cache_config: Any) -> None: ...


class _Worker033:
    def __init__(self, spec: Any, vllm_config: Any, kv_cache_config: Any) -> None: ...


def test_the_connector_worker_gets_the_arguments_its_release_takes() -> None:
    assert vllm_compat.connector_worker_args(_Worker026, "s", "v", "k") == ("s", "k")
    assert vllm_compat.connector_worker_args(_Worker033, "s", "v", "k") == ("s", "v", "k")


class _Spec026:
    num_blocks = 12


class _Spec033:
    num_chunks = 7


def test_the_tier_size_is_read_in_chunks_or_blocks() -> None:
    assert vllm_compat.spec_num_chunks(_Spec026()) == 12
    assert vllm_compat.spec_num_chunks(_Spec033()) == 7


class LRUCachePolicy:
    pass


class ARCCachePolicy:
    pass


class _Manager026:
    def __init__(self) -> None:
        self._num_blocks = 5
        self._policy = LRUCachePolicy()
        self.store_threshold = 2
        self.max_tracker_size = 9

    def touch(self, keys: Any, req_context: Any) -> None: ...


class _Manager033:
    def __init__(self) -> None:
        self._num_chunks = 6
        self._policy = ARCCachePolicy()
        self.store_threshold = 0
        self.max_tracker_size = 64_000

    def _record_accesses(self, keys: Any) -> None: ...

    def touch(self, keys: Any, req_context: Any) -> None: ...


class _Manager034(_Manager033):
    touch = None  # type: ignore[assignment]

    def _record_accesses(self, keys: Any, counted: Any = ()) -> None: ...  # type: ignore[override]


def test_the_manager_rule_is_detected_from_the_manager() -> None:
    assert vllm_compat.manager_rule(_Manager026()) == "vllm-0.26"
    assert vllm_compat.manager_rule(_Manager033()) == "vllm-0.33"
    assert vllm_compat.manager_rule(_Manager034()) == "vllm-0.34"
    assert vllm_compat.has_touch(_Manager033()) and not vllm_compat.has_touch(_Manager034())
    assert set(TIER_RULES) == {"vllm-0.26", "vllm-0.33", "vllm-0.34"}


def test_tier_config_of_records_the_rule() -> None:
    old = tier_config_of(_Manager026(), blocks_per_chunk=2)
    assert old == TierConfigured(
        num_chunks=5,
        eviction="lru",
        store_threshold=2,
        max_tracker_size=9,
        blocks_per_chunk=2,
        rule="vllm-0.26",
    )
    new = tier_config_of(_Manager034())
    assert (new.num_chunks, new.eviction, new.rule) == (6, "arc", "vllm-0.34")
    assert TierConfigured(num_chunks=1).rule == "vllm-0.33"  # logs from before the field


@dataclass
class _Context026:
    req_id: str


@dataclass
class _Context033:
    req_id: str
    _state: dict[type, Any] = field(default_factory=dict)
    _offload_key_positions: dict[bytes, int] = field(default_factory=dict)

    def set_state(self, val: Any) -> None:
        self._state[type(val)] = val

    def get_state(self, cls: type) -> Any:
        return self._state.get(cls)


class _Mark:
    pass


def test_context_marks_use_the_context_state_where_there_is_one() -> None:
    marks = vllm_compat.ContextMarks()
    context = _Context033("r")
    mark = _Mark()
    assert marks.get(context, _Mark) is None
    marks.set(context, mark)
    assert marks.get(context, _Mark) is mark and context.get_state(_Mark) is mark
    context._offload_key_positions[b"k"] = 16
    assert dict(marks.positions(context)) == {b"k": 16}


def test_context_marks_of_0_26_contexts_live_as_long_as_the_context() -> None:
    marks = vllm_compat.ContextMarks()
    first, second = _Context026("a"), _Context026("a")  # equal, yet two requests' contexts
    mark = _Mark()
    marks.set(first, mark)
    assert marks.get(first, _Mark) is mark
    assert marks.get(second, _Mark) is None
    assert dict(marks.positions(first)) == {}
    del first
    gc.collect()
    assert not marks._marks  # forgotten with its context


class _OutputV1:
    def __init__(self, req_ids: list[str], req_id_to_index: dict[str, int]) -> None: ...


class _OutputV2:
    def __init__(self, req_ids: list[str]) -> None: ...


def test_runner_output_fields_follow_the_output_class() -> None:
    assert vllm_compat.runner_output_fields(_OutputV1, ["a", "b"]) == {
        "req_ids": ["a", "b"],
        "req_id_to_index": {"a": 0, "b": 1},
    }
    assert vllm_compat.runner_output_fields(_OutputV2, ["a"]) == {"req_ids": ["a"]}


def test_loads_are_async_and_every_rank_writes_where_vllm_says_nothing() -> None:
    class Entry:
        pass

    entry = Entry()
    assert vllm_compat.load_is_sync(entry) is False
    entry.sync = True  # type: ignore[attr-defined]
    assert vllm_compat.load_is_sync(entry) is True
    assert vllm_compat.is_store_writer(object()) is True

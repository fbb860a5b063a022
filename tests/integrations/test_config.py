"""Facade configuration: the plugin's environment variables, kvlog's, and their precedence."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvlog.errors import ConfigError
from kvlog.events import CacheConfigured
from kvlog.integrations.config import FacadeConfig, config_from_env, parse_bool


def test_defaults_without_environment() -> None:
    assert config_from_env({}) == FacadeConfig(
        defrag=True, threshold=32, with_graphs=False, log_path=None, sync="background"
    )


def test_policy_defaults_are_cache_configured_ones() -> None:
    event = CacheConfigured(num_gpu_blocks=8, block_size=4)
    assert (FacadeConfig().defrag, FacadeConfig().threshold) == (event.defrag, event.threshold)


def test_every_variable_is_read() -> None:
    env = {
        "VLLM_DEFRAG": "false",
        "VLLM_DEFRAG_THRESHOLD": " 8 ",
        "VLLM_DEFRAG_WITH_GRAPHS": "TRUE",
        "KVLOG_PATH": "/var/log/kvlog/{pid}.kvlog",
        "KVLOG_SYNC": "Always",
    }
    assert config_from_env(env) == FacadeConfig(
        defrag=False,
        threshold=8,
        with_graphs=True,
        log_path="/var/log/kvlog/{pid}.kvlog",
        sync="always",
    )


def test_empty_variables_count_as_unset() -> None:
    env = dict.fromkeys(("VLLM_DEFRAG", "VLLM_DEFRAG_THRESHOLD", "KVLOG_PATH", "KVLOG_SYNC"), "  ")
    assert config_from_env(env) == FacadeConfig()


def test_arguments_win_over_the_environment() -> None:
    env = {"VLLM_DEFRAG": "0", "VLLM_DEFRAG_THRESHOLD": "8", "KVLOG_SYNC": "none"}
    config = config_from_env(env, defrag=True, threshold=64, sync="step", log_path="x.kvlog")
    assert (config.defrag, config.threshold, config.sync, config.log_path) == (
        True,
        64,
        "step",
        "x.kvlog",
    )


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("VLLM_DEFRAG", "maybe"),
        ("VLLM_DEFRAG_WITH_GRAPHS", "2"),
        ("VLLM_DEFRAG_THRESHOLD", "-1"),
        ("VLLM_DEFRAG_THRESHOLD", "3.5"),
        ("VLLM_DEFRAG_THRESHOLD", "lots"),
        ("KVLOG_SYNC", "sometimes"),
    ],
)
def test_unparsable_variables_raise_config_error_naming_them(name: str, text: str) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_env({name: text})
    assert info.value.name == name
    assert isinstance(info.value, ValueError)
    assert name in str(info.value)


@pytest.mark.parametrize(
    "overrides",
    [{"threshold": -3}, {"threshold": True}, {"defrag": "yes"}, {"sync": "fsync"}],
)
def test_bad_arguments_raise_config_error(overrides: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        config_from_env({}, **overrides)  # type: ignore[arg-type]


@given(
    word=st.sampled_from(["1", "true", "yes", "on", "0", "false", "no", "off"]),
    upper=st.booleans(),
    pad=st.sampled_from(["", " ", "\t"]),
)
def test_parse_bool_accepts_the_usual_spellings(word: str, upper: bool, pad: str) -> None:
    text = pad + (word.upper() if upper else word) + pad
    assert parse_bool("X", text) is (word in {"1", "true", "yes", "on"})


@given(threshold=st.integers(0, 2**31 - 1))
def test_threshold_round_trips_through_the_environment(threshold: int) -> None:
    assert config_from_env({"VLLM_DEFRAG_THRESHOLD": str(threshold)}).threshold == threshold


def test_the_background_flusher_interval_comes_from_the_environment(tmp_path: object) -> None:
    """``KVLOG_SYNC_INTERVAL_MS`` reaches the facade's log writer; arguments win; the
    Engine takes it directly too."""
    import os

    from kvlog import Engine
    from kvlog.integrations import OnlineDefragmenter
    from tests.support.seed_reference import make_hpu_caches

    assert config_from_env({}).sync_interval_s == 0.005
    assert config_from_env({"KVLOG_SYNC_INTERVAL_MS": " 20 "}).sync_interval_s == 0.02
    assert (
        config_from_env({"KVLOG_SYNC_INTERVAL_MS": "20"}, sync_interval_s=0.5).sync_interval_s
        == 0.5
    )
    path = os.path.join(str(tmp_path), "f.kvlog")
    env = {"KVLOG_PATH": path, "KVLOG_SYNC_INTERVAL_MS": "50"}
    defrag = OnlineDefragmenter(environ=env, backend="cpu")
    defrag.initialize(make_hpu_caches(16, 16), 16)
    defrag.update_state({"a": [1]}, [])
    defrag.defragment()
    writer = defrag.session.engine._log
    assert writer is not None and writer.sync_mode == "background"
    assert writer.sync_interval_s == 0.05
    defrag.close()
    config = CacheConfigured(num_gpu_blocks=8, block_size=4)
    with Engine(config, os.path.join(str(tmp_path), "e.kvlog"), sync="background",
                sync_interval_s=0.25) as engine:  # fmt: skip
        assert engine._log is not None and engine._log.sync_interval_s == 0.25
    for bad in (0, -1, float("nan"), 1e9, "5"):
        with pytest.raises(ConfigError):
            Engine(config, sync_interval_s=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("text", ["0", "-5", "nan", "inf", "1e9", "fast"])
def test_a_bad_flusher_interval_names_the_variable(text: str) -> None:
    with pytest.raises(ConfigError, match="KVLOG_SYNC_INTERVAL_MS"):
        config_from_env({"KVLOG_SYNC_INTERVAL_MS": text})

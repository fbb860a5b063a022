"""Facade configuration from the environment variables the Gaudi plugin reads, plus kvlog's.

The plugin reads ``VLLM_DEFRAG`` (its ``defrag`` feature), ``VLLM_DEFRAG_THRESHOLD`` and
``VLLM_DEFRAG_WITH_GRAPHS``; kvlog adds a variable for every other policy field of
``CacheConfigured`` (``KVLOG_POLICY``, ``KVLOG_RATIO_LIMIT``, ``KVLOG_MIN_SWAPS``,
``KVLOG_MAX_SWAPS``, ``KVLOG_PAD_SIZES``, ``KVLOG_MAX_BYTES_PER_STEP``: the table in
:mod:`kvlog.analysis.policy`, which also gives the keyword of each, its field name), ``KVLOG_PATH``
(where to record the log; unset or empty: no log) and ``KVLOG_SYNC`` (``background``, the
default: one write per step and an fdatasync on a background thread within about 5 ms;
``step``: an fsync per step on the serving thread; ``always``; ``none``) and
``KVLOG_SYNC_INTERVAL_MS`` (the background flusher's interval, 5 by default, 0.1 to
60000). ``KVLOG_PATH`` naming a directory (or ending in ``/``) records a segmented log:
``KVLOG_SEGMENT_BYTES`` (256 MiB by default), ``KVLOG_RETAIN_BYTES``,
``KVLOG_RETAIN_SECONDS`` and ``KVLOG_COMPRESS`` (zstd) set its segments and retention.
Constructor arguments win over the
environment, the environment over the defaults. A value that cannot be parsed, or that
the event validator or the command line would refuse (a tail parameter under the seed
policy), raises :class:`~kvlog.errors.ConfigError` naming the variable or the keyword, at
construction, not later in the serving loop.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

import msgspec

from kvlog.analysis import policy as policy_table
from kvlog.analysis.policy import (
    POLICY_FIELDS,
    check_policy_values,
    check_tail_only,
    policy_from_env,
)
from kvlog.errors import ConfigError
from kvlog.events import CONFIG_DEFAULTS
from kvlog.log import (
    DEFAULT_SYNC_INTERVAL_S,
    SYNC_INTERVAL_BOUNDS,
    SYNC_MODES,
    SyncMode,
    check_sync_interval,
    is_log_directory,
)
from kvlog.log.segments import MIN_SEGMENT_BYTES

__all__ = [
    "ENV_DEFRAG",
    "ENV_COMPRESS",
    "ENV_LOG_PATH",
    "ENV_RETAIN_BYTES",
    "ENV_RETAIN_SECONDS",
    "ENV_SEGMENT_BYTES",
    "ENV_SYNC",
    "ENV_SYNC_INTERVAL",
    "ENV_THRESHOLD",
    "ENV_WITH_GRAPHS",
    "FacadeConfig",
    "SyncMode",
    "config_from_env",
    "parse_bool",
]

ENV_DEFRAG = policy_table.policy_field("defrag").env
ENV_THRESHOLD = policy_table.policy_field("threshold").env
ENV_WITH_GRAPHS = "VLLM_DEFRAG_WITH_GRAPHS"
ENV_LOG_PATH = "KVLOG_PATH"
ENV_SYNC = "KVLOG_SYNC"
ENV_SYNC_INTERVAL = "KVLOG_SYNC_INTERVAL_MS"
ENV_SEGMENT_BYTES = "KVLOG_SEGMENT_BYTES"
ENV_RETAIN_BYTES = "KVLOG_RETAIN_BYTES"
ENV_RETAIN_SECONDS = "KVLOG_RETAIN_SECONDS"
ENV_COMPRESS = "KVLOG_COMPRESS"


class FacadeConfig(msgspec.Struct, frozen=True):
    """What the facades need beyond the KV caches themselves.

    ``defrag``: run online defragmentation (the plugin's ``defrag`` feature);
    ``threshold``: the trigger slack (``max_used - threshold > num_used``);
    ``with_graphs``: wrap swaps in HPU graphs / ``torch.compile`` (HPU only);
    ``log_path``: the log file, or None for no log; ``sync``: the log's group commit
    (``background``: the fsync off the serving thread); ``sync_interval_s``: the background
    flusher's interval, the bound of its durability lag (``KVLOG_SYNC_INTERVAL_MS``);
    ``segment_bytes``, ``retain_bytes``, ``retain_seconds``, ``compress``: a log directory's
    segments and retention (``kvlog.log.segments``). The other fields are
    ``CacheConfigured``'s policy fields (``kvlog.analysis.policy``), whose defaults they have
    (``CONFIG_DEFAULTS``).
    """

    defrag: bool = CONFIG_DEFAULTS["defrag"]
    threshold: int = CONFIG_DEFAULTS["threshold"]
    with_graphs: bool = False
    log_path: str | None = None
    sync: SyncMode = "background"
    sync_interval_s: float = DEFAULT_SYNC_INTERVAL_S
    max_swaps: int = CONFIG_DEFAULTS["max_swaps"]
    pad_sizes: tuple[int, ...] = CONFIG_DEFAULTS["pad_sizes"]
    policy: str = CONFIG_DEFAULTS["policy"]
    policy_ratio_pct: int = CONFIG_DEFAULTS["policy_ratio_pct"]
    policy_min_swaps: int = CONFIG_DEFAULTS["policy_min_swaps"]
    max_bytes_per_step: int = CONFIG_DEFAULTS["max_bytes_per_step"]
    segment_bytes: int | None = None
    retain_bytes: int | None = None
    retain_seconds: float | None = None
    compress: bool = False

    def policy_fields(self) -> dict[str, Any]:
        """The ``CacheConfigured`` policy fields (for the log's first event)."""
        return {row.name: getattr(self, row.name) for row in POLICY_FIELDS}


assert {row.name for row in POLICY_FIELDS} <= set(FacadeConfig.__struct_fields__), (
    "FacadeConfig holds every policy field of CacheConfigured"
)


def parse_bool(name: str, text: str) -> bool:
    """``1/true/yes/on`` or ``0/false/no/off``, any case and surrounding space."""
    try:
        return policy_table.parse_bool(text)
    except ValueError:
        raise ConfigError(name, text, "a boolean (1/true/yes/on or 0/false/no/off)") from None


def _check_sync(name: str, value: object) -> SyncMode:
    if value not in SYNC_MODES:
        raise ConfigError(name, value, f"one of {', '.join(SYNC_MODES)}")
    return value  # type: ignore[return-value]


def _check_bool(name: str, value: object) -> bool:
    if type(value) is not bool:
        raise ConfigError(name, value, "a bool")
    return value


def _from_environ(env: Mapping[str, str], base: FacadeConfig) -> FacadeConfig:
    """``base`` with every variable that is set (and not empty) parsed over it, but the
    policy's (:func:`_policy`)."""
    out = base
    if env.get(ENV_WITH_GRAPHS, "").strip():
        graphs = parse_bool(ENV_WITH_GRAPHS, env[ENV_WITH_GRAPHS])
        out = msgspec.structs.replace(out, with_graphs=graphs)
    if env.get(ENV_LOG_PATH, "").strip():
        out = msgspec.structs.replace(out, log_path=env[ENV_LOG_PATH].strip())
    if env.get(ENV_SYNC, "").strip():
        sync = _check_sync(ENV_SYNC, env[ENV_SYNC].strip().lower())
        out = msgspec.structs.replace(out, sync=sync)
    if env.get(ENV_SYNC_INTERVAL, "").strip():
        interval = _parse_interval_ms(ENV_SYNC_INTERVAL, env[ENV_SYNC_INTERVAL])
        out = msgspec.structs.replace(out, sync_interval_s=interval)
    return _segments_from_environ(env, out)


def _segments_from_environ(env: Mapping[str, str], out: FacadeConfig) -> FacadeConfig:
    """The log directory's variables; refused (``ConfigError``) for a log that is a file."""
    if env.get(ENV_SEGMENT_BYTES, "").strip():
        size = _parse_int(ENV_SEGMENT_BYTES, env[ENV_SEGMENT_BYTES], MIN_SEGMENT_BYTES)
        out = msgspec.structs.replace(out, segment_bytes=size)
    if env.get(ENV_RETAIN_BYTES, "").strip():
        retain = _parse_int(ENV_RETAIN_BYTES, env[ENV_RETAIN_BYTES], 0)
        out = msgspec.structs.replace(out, retain_bytes=retain)
    if env.get(ENV_RETAIN_SECONDS, "").strip():
        text = env[ENV_RETAIN_SECONDS]
        try:
            seconds = float(text.strip())
        except ValueError:
            seconds = math.nan
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ConfigError(ENV_RETAIN_SECONDS, text, "a number of seconds >= 0")
        out = msgspec.structs.replace(out, retain_seconds=seconds)
    if env.get(ENV_COMPRESS, "").strip():
        text = env[ENV_COMPRESS].strip().lower()
        compress = True if text == "zstd" else parse_bool(ENV_COMPRESS, text)
        out = msgspec.structs.replace(out, compress=compress)
    segmented = (out.segment_bytes, out.retain_bytes, out.retain_seconds, out.compress or None)
    if any(v is not None for v in segmented) and not (
        out.log_path and is_log_directory(out.log_path)
    ):
        raise ConfigError(
            ENV_LOG_PATH,
            out.log_path,
            "a log directory (a directory, or a path ending in '/') for KVLOG_SEGMENT_BYTES, "
            "KVLOG_RETAIN_BYTES, KVLOG_RETAIN_SECONDS and KVLOG_COMPRESS",
        )
    return out


def _parse_int(name: str, text: str, low: int) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise ConfigError(name, text, f"an integer >= {low}") from None
    if value < low:
        raise ConfigError(name, text, f"an integer >= {low}")
    return value


def _policy(env: Mapping[str, str], keywords: Mapping[str, Any]) -> dict[str, Any]:
    """The policy fields set by variables or (winning) keywords, each checked as the log's
    ``CacheConfigured`` will be, and refused as the command line refuses them; a refusal
    names the variable or the keyword."""
    unknown = sorted(set(keywords) - {row.name for row in POLICY_FIELDS})
    if unknown:
        raise TypeError(f"unknown facade policy keyword(s): {unknown}")
    from_env = policy_from_env(env)
    given = {n: v for n, v in keywords.items() if v is not None}
    if "pad_sizes" in given:
        given["pad_sizes"] = tuple(given["pad_sizes"])
    values = {**from_env, **given}

    def name_of(name: str) -> str:
        return name if name in given else policy_table.policy_field(name).env

    check_policy_values(values, name_of)
    policy = values.get("policy", CONFIG_DEFAULTS["policy"])
    check_tail_only(values, policy, name_of, f"{name_of('policy')}='tail' with it")
    return values


def _parse_interval_ms(name: str, text: str) -> float:
    """Milliseconds (a finite number) as seconds within ``SYNC_INTERVAL_BOUNDS``."""
    low, high = SYNC_INTERVAL_BOUNDS
    try:
        seconds = float(text.strip()) / 1000
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or not low <= seconds <= high:
        raise ConfigError(name, text, f"milliseconds in [{low * 1000:g}, {high * 1000:g}]")
    return seconds


def config_from_env(
    environ: Mapping[str, str] | None = None,
    *,
    with_graphs: bool | None = None,
    log_path: str | os.PathLike[str] | None = None,
    sync: str | None = None,
    sync_interval_s: float | None = None,
    **policy: Any,
) -> FacadeConfig:
    """The facade configuration: arguments (not None) over ``environ`` over the defaults.

    ``policy``: any policy field of ``CacheConfigured`` by name (``defrag``, ``threshold``,
    ``policy="tail"``, ``max_bytes_per_step``...); ``environ`` defaults to ``os.environ``
    (pass a dict in tests).
    """
    env = os.environ if environ is None else environ
    out = _from_environ(env, FacadeConfig())
    out = msgspec.structs.replace(out, **_policy(env, policy))
    if with_graphs is not None:
        graphs = _check_bool("with_graphs", with_graphs)
        out = msgspec.structs.replace(out, with_graphs=graphs)
    if log_path is not None:
        out = msgspec.structs.replace(out, log_path=os.fspath(log_path))
    if sync is not None:
        out = msgspec.structs.replace(out, sync=_check_sync("sync", sync))
    if sync_interval_s is not None:
        check_sync_interval(sync_interval_s)
        out = msgspec.structs.replace(out, sync_interval_s=float(sync_interval_s))
    return out

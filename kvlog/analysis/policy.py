"""Defrag policy settings: one table of ``CacheConfigured``'s policy fields, and how each is
named on the command line and in the environment, parsed from text, and refused.

The policy fields are ``CacheConfigured``'s fields but the geometry (:data:`GEOMETRY_FIELDS`);
:data:`POLICY_FIELDS` holds one :class:`PolicyField` per field, in the event's order (checked
when this module loads: a field grown on ``CacheConfigured`` needs its row here). Defaults
are ``CacheConfigured``'s (``CONFIG_DEFAULTS``). The command line (``synth``, ``replay``,
``sweep``), replay's what-ifs and the facades (keywords and environment variables) take
their names, parsers and refusals from here. Refused, beyond what the event validator
refuses (``kvlog.events.validate``):

- a parameter that only the tail policy reads (``policy_ratio_pct``, ``policy_min_swaps``)
  given under another policy: it would be ignored (:func:`check_tail_only`);
- a byte budget below one page with defrag on: it moves nothing (:func:`check_byte_budget`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvlog.errors import ConfigError, InvalidEvent
from kvlog.events import CONFIG_DEFAULTS, DEFRAG_POLICIES, CacheConfigured, validate_event
from kvlog.util.units import MAX_SIZE_BYTES, parse_size

__all__ = [
    "GEOMETRY_FIELDS",
    "MAX_BYTES_PER_STEP",
    "MAX_RATIO",
    "POLICY_FIELDS",
    "TAIL_ONLY",
    "PolicyField",
    "check_byte_budget",
    "check_policy_values",
    "check_tail_only",
    "parse_bool",
    "parse_int",
    "parse_pad_sizes",
    "parse_policy",
    "parse_ratio_pct",
    "parse_size",
    "policy_field",
    "policy_from_env",
]

GEOMETRY_FIELDS = frozenset(
    {
        "num_gpu_blocks",
        "block_size",
        "num_cpu_blocks",
        "block_size_factor",
        "prefix_caching",
        "page_size_bytes",
        "quarantine_released",
    }
)
"""``CacheConfigured`` fields that describe the cache, not the policy: a what-if keeps them."""
MAX_BYTES_PER_STEP = MAX_SIZE_BYTES
"""``CacheConfigured``'s bound on ``max_bytes_per_step`` (the validator's)."""
MAX_RATIO = 100.0
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


# -- parsers: text (a flag's or a variable's) to a field's value, ValueError naming why -----
def parse_bool(text: str) -> bool:
    """``1/true/yes/on`` or ``0/false/no/off``, any case and surrounding space."""
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"not a boolean: {text!r} (1/true/yes/on or 0/false/no/off)")


def parse_int(text: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError(f"not an integer: {text!r}") from None


def parse_pad_sizes(text: str) -> tuple[int, ...]:
    """``8,16,32``: the pad buckets."""
    try:
        sizes = tuple(int(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError as exc:
        raise ValueError(f"--pad-sizes wants integers like 8,16,32: {exc}") from exc
    if not sizes:
        raise ValueError("--pad-sizes needs at least one size")
    return sizes


def parse_ratio_pct(text: str) -> int:
    """A ratio like ``1.5`` (highest used id to used blocks) as the percent the event holds."""
    try:
        ratio = float(text)
    except ValueError:
        raise ValueError(f"a ratio like 1.5, not {text!r}") from None
    if not 1.0 <= ratio <= MAX_RATIO:
        raise ValueError(
            f"a ratio of highest used id to used blocks in [1, {MAX_RATIO:g}] like 1.5 "
            f"(not a percent), not {text!r}"
        )
    return round(ratio * 100)


def parse_policy(text: str) -> str:
    name = text.strip()
    if name not in DEFRAG_POLICIES:
        raise ValueError(f"{text!r} is not one of {', '.join(DEFRAG_POLICIES)}")
    return name


# -- the table -------------------------------------------------------------------------------
@dataclass(frozen=True)
class PolicyField:
    """One policy field of ``CacheConfigured``: its flag, its variable, its parser."""

    name: str
    """The ``CacheConfigured`` field (and the facades' keyword)."""
    flag: str
    """The command-line flag (a bool's: ``--no-X`` turns it off)."""
    env: str
    """The environment variable the facades read."""
    parse: Callable[[str], Any]
    help: str
    text: Callable[[Any], str] = str
    """A value as one would write it for ``parse`` (shown defaults)."""

    @property
    def default(self) -> Any:
        return CONFIG_DEFAULTS[self.name]

    @property
    def tail_only(self) -> bool:
        return self.name in TAIL_ONLY


TAIL_ONLY = frozenset({"policy_ratio_pct", "policy_min_swaps"})
"""Fields only the ``"tail"`` policy reads."""

POLICY_FIELDS: tuple[PolicyField, ...] = (
    PolicyField("defrag", "--defrag", "VLLM_DEFRAG", parse_bool, "online defragmentation"),
    PolicyField(
        "threshold",
        "--threshold",
        "VLLM_DEFRAG_THRESHOLD",
        parse_int,
        "defrag trigger: max_used - threshold > num_used",
    ),
    PolicyField(
        "max_swaps",
        "--max-swaps",
        "KVLOG_MAX_SWAPS",
        parse_int,
        "most block pairs one defrag moves",
    ),
    PolicyField(
        "pad_sizes",
        "--pad-sizes",
        "KVLOG_PAD_SIZES",
        parse_pad_sizes,
        "pad buckets for graph capture, e.g. 8,16,32",
        lambda sizes: ",".join(map(str, sizes)),
    ),
    PolicyField(
        "policy",
        "--policy",
        "KVLOG_POLICY",
        parse_policy,
        "defrag policy: seed (the plugin's rule) or tail (vllm-gaudi PR #376)",
    ),
    PolicyField(
        "policy_ratio_pct",
        "--ratio-limit",
        "KVLOG_RATIO_LIMIT",
        parse_ratio_pct,
        "tail: defrag when highest used id / used blocks exceeds this",
        lambda pct: f"{pct / 100:g}",
    ),
    PolicyField(
        "policy_min_swaps",
        "--min-swaps",
        "KVLOG_MIN_SWAPS",
        parse_int,
        "tail: skip defrags of fewer pairs",
    ),
    PolicyField(
        "max_bytes_per_step",
        "--max-bytes-per-step",
        "KVLOG_MAX_BYTES_PER_STEP",
        parse_size,
        "any policy: bytes one step's defrag may move, e.g. 256MiB (0: no cap)",
    ),
)
"""One row per policy field of ``CacheConfigured``, in the event's order."""

_BY_NAME = {f.name: f for f in POLICY_FIELDS}
assert tuple(_BY_NAME) == tuple(
    n for n in CacheConfigured.__struct_fields__ if n not in GEOMETRY_FIELDS
), "every policy field of CacheConfigured has one row in POLICY_FIELDS, in its order"


def policy_field(name: str) -> PolicyField:
    """The row of a policy field (``KeyError`` for any other name)."""
    return _BY_NAME[name]


# -- reading and refusing ----------------------------------------------------------------------
def policy_from_env(environ: Mapping[str, str]) -> dict[str, Any]:
    """The policy fields whose variables are set (and not empty), parsed; a value that does
    not parse is a :class:`~kvlog.errors.ConfigError` naming the variable."""
    out: dict[str, Any] = {}
    for row in POLICY_FIELDS:
        text = environ.get(row.env, "")
        if text.strip():
            try:
                out[row.name] = row.parse(text)
            except ValueError as exc:
                raise ConfigError(row.env, text, str(exc)) from None
    return out


def check_tail_only(
    given: Mapping[str, Any], policy: str, name_of: Callable[[str], str], expected: str
) -> None:
    """Refuse (``ConfigError`` named by ``name_of(field)``, expecting ``expected``, e.g.
    ``"--policy tail with it"``) a tail-only field in ``given`` (not None) under another
    ``policy``: it would be ignored."""
    for name in sorted(TAIL_ONLY):
        value = given.get(name)
        if value is not None and policy != "tail":
            raise ConfigError(name_of(name), value, expected)


def check_policy_values(values: Mapping[str, Any], name_of: Callable[[str], str]) -> None:
    """Refuse (``ConfigError`` named by ``name_of(field)``) a policy value the event
    validator would refuse in the log's ``CacheConfigured``: before anything starts."""
    for name, value in values.items():
        probe = {name: value}
        if name == "max_swaps" and "pad_sizes" in values:  # bounded by the largest pad
            probe["pad_sizes"] = values["pad_sizes"]
        elif name == "pad_sizes":
            probe["max_swaps"] = 1
        try:
            validate_event(CacheConfigured(num_gpu_blocks=1, block_size=1, **probe))
        except InvalidEvent as exc:
            raise ConfigError(name_of(name), value, f"a valid {name} ({exc})") from None


def check_byte_budget(config: CacheConfigured, name: str) -> None:
    """Refuse (``ConfigError`` named ``name``) a byte budget below one page with defrag
    on: it would move nothing (and so turn defrag off)."""
    cap, page = config.max_bytes_per_step, config.page_size_bytes
    if config.defrag and 0 < cap < page:
        raise ConfigError(
            name,
            cap,
            f"0 (no cap) or at least one page ({page} bytes): a smaller cap moves nothing "
            "and turns defrag off",
        )

"""Seeded serving workload: synth configuration, request arrivals and their shapes.

Arrivals per step are Poisson; prompt lengths log-normal, output lengths geometric, both
clipped. A share of the requests starts with one of a few shared prefixes (system prompts,
few-shot headers), picked Zipf-like, so prefix caching and CPU prefix hits have something
to find. Everything comes from one ``numpy.random.Generator`` seeded by ``seed``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np

from kvlog.analysis.policy import TAIL_ONLY, check_byte_budget, check_tail_only
from kvlog.errors import ConfigError
from kvlog.events import CONFIG_DEFAULTS, CacheConfigured

__all__ = ["Request", "SynthConfig", "Workload"]


@dataclass(frozen=True)
class SynthConfig:
    """Everything that decides a synthetic run (the same config and seed give the same log).

    Every ``CacheConfigured`` field but ``quarantine_released`` (the vLLM connector's) is a
    field here, of the same name and type; their defaults are ``CacheConfigured``'s
    (``CONFIG_DEFAULTS``) except the geometry, which a synthetic run has to pick.
    """

    seed: int = 0
    steps: int = 2000
    num_gpu_blocks: int = 1024
    block_size: int = 16
    num_cpu_blocks: int = CONFIG_DEFAULTS["num_cpu_blocks"]
    block_size_factor: int = CONFIG_DEFAULTS["block_size_factor"]
    prefix_caching: bool = CONFIG_DEFAULTS["prefix_caching"]
    defrag: bool = CONFIG_DEFAULTS["defrag"]
    threshold: int = CONFIG_DEFAULTS["threshold"]
    max_swaps: int = CONFIG_DEFAULTS["max_swaps"]
    pad_sizes: tuple[int, ...] = CONFIG_DEFAULTS["pad_sizes"]
    page_size_bytes: int = 2 * 32 * 8 * 128 * 2 * 16  # K+V, 32 layers, 8 heads x 128, bf16
    arrival_rate: float = 0.25
    prompt_len_mean: float = 400.0
    prompt_len_max: int = 4096
    output_len_mean: float = 120.0
    output_len_max: int = 2048
    max_num_seqs: int = 64
    num_prefixes: int = 8
    prefix_share: float = 0.5
    prefix_len_max_blocks: int = 32
    store_latency_steps: float = 2.0
    load_latency_steps: float = 1.0
    transfer_failure_rate: float = 0.0
    watermark_blocks: int = 4
    check_every: int = 0
    policy: str = CONFIG_DEFAULTS["policy"]
    policy_ratio_pct: int = CONFIG_DEFAULTS["policy_ratio_pct"]
    policy_min_swaps: int = CONFIG_DEFAULTS["policy_min_swaps"]
    max_bytes_per_step: int = CONFIG_DEFAULTS["max_bytes_per_step"]

    def cache_config(self, page_size_bytes: int | None = None) -> CacheConfigured:
        """The ``CacheConfigured`` event this run starts its log with: every field of it
        that this config has (the others at their defaults)."""
        values = {n: getattr(self, n) for n in CacheConfigured.__struct_fields__ if n in _FIELDS}
        values["pad_sizes"] = tuple(self.pad_sizes)
        if page_size_bytes is not None:
            values["page_size_bytes"] = page_size_bytes
        return CacheConfigured(**values)

    def replace(self, **changes: object) -> SynthConfig:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def check(self) -> None:
        """Refuse, with :class:`~kvlog.errors.ConfigError` naming the field and its ``kvlog
        synth`` flag, a workload value that would crash the run midway, loop, or be
        silently reinterpreted (a NaN rate, a negative seed, no steps, a batch of 0).
        The ``CacheConfigured`` fields are the event validator's to check."""
        for name, low, high in _INT_RANGES:
            value = getattr(self, name)
            if type(value) is not int or not low <= value <= high:
                raise ConfigError(_flag(name), value, f"an int in [{low}, {high}]")
        for name, flow, fhigh in _FLOAT_RANGES:
            number = getattr(self, name)
            if not isinstance(number, int | float) or not math.isfinite(number):
                raise ConfigError(_flag(name), number, f"a finite number in [{flow}, {fhigh}]")
            if not flow <= number <= fhigh:
                raise ConfigError(_flag(name), number, f"a number in [{flow}, {fhigh}]")
        tuned = {n: getattr(self, n) for n in TAIL_ONLY if getattr(self, n) != CONFIG_DEFAULTS[n]}
        check_tail_only(tuned, self.policy, _flag, "--policy tail (only it reads them)")
        check_byte_budget(self.cache_config(), _flag("max_bytes_per_step"))


_BIG = 1 << 40
_INT_RANGES = (
    ("seed", 0, (1 << 63) - 1),
    ("steps", 1, _BIG),
    ("prompt_len_max", 1, _BIG),
    ("output_len_max", 1, _BIG),
    ("max_num_seqs", 1, _BIG),
    ("num_prefixes", 0, 1 << 20),
    ("prefix_len_max_blocks", 1, _BIG),
    ("watermark_blocks", 0, _BIG),
    ("check_every", 0, _BIG),
)
_FLOAT_RANGES = (
    ("arrival_rate", 0.0, 1e6),
    ("prompt_len_mean", 1.0, 1e9),
    ("output_len_mean", 1.0, 1e9),
    ("prefix_share", 0.0, 1.0),
    ("store_latency_steps", 0.0, 1e9),
    ("load_latency_steps", 0.0, 1e9),
    ("transfer_failure_rate", 0.0, 1.0),
)
_FLAGS = {"transfer_failure_rate": "failure-rate"}


def _flag(field_name: str) -> str:
    """``field (--flag)``: the config field and the ``kvlog synth`` flag that sets it."""
    flag = _FLAGS.get(field_name, field_name.replace("_", "-"))
    return f"{field_name} (--{flag})"


_FIELDS = frozenset(f.name for f in dataclasses.fields(SynthConfig))


@dataclass(eq=False)
class Request:
    """One request as the synthetic scheduler sees it."""

    req_id: str
    serial: int
    prompt_len: int
    output_len: int
    prefix_id: int  # -1: no shared prefix
    prefix_blocks: int  # full blocks of the prompt that are the shared prefix
    generated: int = 0
    blocks: list[int] = field(default_factory=list)
    status: str = "waiting"  # waiting | running | loading | finished | storing
    num_cached: int = 0  # leading blocks already registered in the prefix cache
    load_job: int = -1
    load_blocks: list[int] = field(default_factory=list)
    num_preemptions: int = 0

    @property
    def num_tokens(self) -> int:
        """Tokens whose KV the request holds once this step ran (recomputed after preemption)."""
        return self.prompt_len + max(self.generated, 0)

    def prefix_hash(self, index: int) -> tuple[str, int, int]:
        """Content hash of full prefix block ``index`` (shared across requests)."""
        assert index < self.prefix_blocks, "only shared prefix blocks have shared hashes"
        return ("p", self.prefix_id, index)

    def group_key(self, group: int, factor: int) -> tuple[str, int, int]:
        """CPU cache key of GPU blocks ``group*factor .. group*factor+factor-1``."""
        if (group + 1) * factor <= self.prefix_blocks:
            return ("p", self.prefix_id, group)
        return ("u", self.serial, group)


class Workload:
    """Draws the requests that arrive at each step."""

    def __init__(self, config: SynthConfig) -> None:
        self.config = config
        self.rng = np.random.default_rng(config.seed)
        bs = config.block_size
        max_prefix = max(1, min(config.prefix_len_max_blocks, config.prompt_len_max // bs - 1))
        self.prefix_blocks = [
            int(self.rng.integers(1, max_prefix + 1)) for _ in range(config.num_prefixes)
        ]
        weights = 1.0 / np.arange(1, config.num_prefixes + 1)
        self.prefix_weights = weights / weights.sum() if config.num_prefixes else weights
        self.num_arrived = 0

    def arrivals(self, step: int) -> list[Request]:
        """The requests that arrive at ``step`` (depends only on the seed and the call order)."""
        count = int(self.rng.poisson(self.config.arrival_rate))
        return [self._request(step) for _ in range(count)]

    def _request(self, step: int) -> Request:
        c = self.config
        sigma = 0.8
        mu = np.log(max(c.prompt_len_mean, 1.0)) - sigma**2 / 2
        prompt = int(np.clip(self.rng.lognormal(mu, sigma), 1, c.prompt_len_max))
        output = int(
            np.clip(self.rng.geometric(1.0 / max(c.output_len_mean, 1.0)), 1, c.output_len_max)
        )
        prefix_id, prefix_blocks = -1, 0
        if c.num_prefixes and self.rng.random() < c.prefix_share:
            prefix_id = int(self.rng.choice(c.num_prefixes, p=self.prefix_weights))
            prefix_blocks = self.prefix_blocks[prefix_id]
            prompt = max(prompt, prefix_blocks * c.block_size + 1)  # at least one own token
        serial = self.num_arrived
        self.num_arrived += 1
        return Request(f"req-{serial}", serial, prompt, output, prefix_id, prefix_blocks)

"""A run's figures and errors (:class:`RunResult`) and the matrix table."""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kvlog.integrations.config import FacadeConfig
from tests.vllm.harness.configs import CI_MATRIX, MAX_DETAILS, RunConfig


@dataclass
class RunResult:
    cfg: RunConfig
    steps: int = 0
    requests: int = 0
    finished: int = 0
    preemptions: int = 0
    stores: int = 0
    stores_done: int = 0
    loads_sync: int = 0
    loads_async: int = 0
    loads_done: int = 0
    swaps: int = 0
    swap_steps: int = 0
    live_slots_checked: int = 0
    live_bad_slots: int = 0
    store_blocks_checked: int = 0
    store_bad_blocks: int = 0
    load_blocks_checked: int = 0
    load_bad_blocks: int = 0
    table_checks: int = 0
    table_mismatches: int = 0
    missed_blocks: int = 0
    stale_tables: int = 0  # (info) kvlog tables of requests vLLM no longer runs, per step
    lagging_tables: int = 0  # (info) kvlog tables that differ from vLLM's but miss nothing
    token_mismatches: int = 0
    harness_errors: int = 0
    aborted: int = 0
    aborted_loading: int = 0  # aborted while vLLM waited for their load
    flush_steps: int = 0  # steps whose metadata has jobs_to_flush
    completions_forward: int = 0  # jobs the runner reported complete on forward steps
    completions_idle: int = 0  # ... on steps with nothing scheduled
    finished_stores: int = 0  # unfinished stores of requests vLLM has finished (blocks freed)
    skipped_first: int = 0  # transfers whose first chunk is entered at block_indices % bpc
    partial_last: int = 0  # transfers whose last chunk is partial
    kvlog_s: float = 0.0  # every kvlog call: the defragmenter's and the connector's
    copy_s: float = 0.0  # of it, the executor carrying out plans (tensor copies)
    tier_s: float = 0.0  # of it, the scheduler's CPU tier log (inside vLLM's schedule())
    defrag_s: float = 0.0  # the defragmenter's calls: update_state, defragment, the resolves
    seed_s: float = 0.0  # the same calls on the plugin's algorithm, beside kvlog's (0: none)
    plain_s: float = 0.0  # the connector's calls on vLLM's plain worker, beside kvlog's (0: none)
    sched_s: float = 0.0
    wall_s: float = 0.0
    replay_ok: bool | None = None
    live_digest: str = ""
    replay_digest: str = ""
    tier: Any = None  # the scheduler's CPU tier log refolded (kvlog.tier.replay.TierReplay)
    cannot_run: str = ""  # why the installed vLLM cannot run this configuration here
    errors: list[str] = field(default_factory=list)
    details: dict[str, list[str]] = field(default_factory=dict)

    def note(self, kind: str, text: str) -> None:
        if kind == "harness":
            self.harness_errors += 1
        got = self.details.setdefault(kind, [])
        if len(got) < MAX_DETAILS:
            got.append(text)

    @property
    def wrong(self) -> int:
        return self.live_bad_slots + self.store_bad_blocks + self.load_bad_blocks

    @property
    def ok(self) -> bool:
        return (
            not self.errors
            and self.wrong == 0
            and self.table_mismatches == 0
            and self.missed_blocks == 0
            and self.token_mismatches == 0
            and self.harness_errors == 0
            and self.finished == self.requests
            and self.replay_ok is not False
            and (self.tier is None or bool(self.tier.exact))
        )

    @property
    def baseline_s(self) -> float | None:
        """What the runner's calls cost without kvlog, in the same loop: the plugin's
        defragmenter (none with defrag off) plus vLLM's plain connector worker; None where
        either shadow stopped or the plain worker did not run (no kvlog connector)."""
        if not self.plain_s or _SEED_NOTE in self.details or _PLAIN_NOTE in self.details:
            return None
        if self.cfg.defrag and not self.seed_s:
            return None
        return self.seed_s + self.plain_s

    @property
    def over_baseline(self) -> float | None:
        """kvlog's calls over :attr:`baseline_s`."""
        base = self.baseline_s
        return None if base is None else self.kvlog_s / max(base, 1e-9)

    def per_step_us(self, seconds: float) -> float:
        return 1e6 * seconds / max(self.steps, 1)

    def summary(self) -> str:
        lines = [f"{self.cfg.name}: {self.cfg.describe()}"]
        for e in self.errors:
            lines.append(f"  ERROR {e}")
        for kind, texts in self.details.items():
            for t in texts:
                lines.append(f"  [{kind}] {t}")
        return "\n".join(lines)


COLUMNS = [
    ("config", lambda r: r.cfg.name),
    (
        "shape",
        lambda r: (
            ("V2" if r.cfg.v2_runner else "V1")
            + ("/async" if r.cfg.async_scheduling else "/sync")
            + f"/{r.cfg.order}/{r.cfg.backend}"
        ),
    ),
    ("steps", lambda r: r.steps),
    ("reqs", lambda r: f"{r.finished}/{r.requests}"),
    ("preempt", lambda r: r.preemptions),
    ("stores", lambda r: r.stores_done),
    ("loads s/a", lambda r: f"{r.loads_sync}/{r.loads_async}"),
    ("done fwd/idle", lambda r: f"{r.completions_forward}/{r.completions_idle}"),
    ("swaps", lambda r: f"{r.swaps}@{r.swap_steps}"),
    ("canary slots", lambda r: r.live_slots_checked),
    ("bad live", lambda r: r.live_bad_slots),
    ("bad store", lambda r: f"{r.store_bad_blocks}/{r.store_blocks_checked}"),
    ("bad load", lambda r: f"{r.load_bad_blocks}/{r.load_blocks_checked}"),
    ("tables bad/missed", lambda r: f"{r.table_mismatches}/{r.missed_blocks}"),
    ("lag/stale", lambda r: f"{r.lagging_tables}/{r.stale_tables}"),
    ("skip/part", lambda r: f"{r.skipped_first}/{r.partial_last}"),
    ("flush/fin/abort", lambda r: f"{r.flush_steps}/{r.finished_stores}/{r.aborted}"),
    ("errors", lambda r: len(r.errors)),
    ("replay", lambda r: {None: "-", True: "ok", False: "FAIL"}[r.replay_ok]),
    ("kvlog us/step", lambda r: f"{r.per_step_us(r.kvlog_s):.0f}"),
    ("of it defragmenter", lambda r: f"{r.per_step_us(r.defrag_s):.0f}"),
    ("seed's defragmenter", lambda r: f"{r.per_step_us(r.seed_s):.0f}" if r.seed_s else "-"),
    ("plain worker", lambda r: f"{r.per_step_us(r.plain_s):.0f}" if r.plain_s else "-"),
    ("kvlog/(seed+plain)", lambda r: _fmt(r.over_baseline)),
    ("of it copies", lambda r: f"{r.per_step_us(r.copy_s):.0f}"),
    ("of it tier log", lambda r: f"{r.per_step_us(r.tier_s):.0f}"),
    ("tier replay", lambda r: "-" if r.tier is None else "exact" if r.tier.exact else "DIFFERS"),
    ("vLLM sched us/step", lambda r: f"{r.per_step_us(r.sched_s):.0f}"),
    ("kvlog/sched", lambda r: f"{_over_scheduler(r):.2f}"),
    ("wall s", lambda r: f"{r.wall_s:.1f}"),
]


_SEED_NOTE = "seed shadow"  # Run._shadow's note where the plugin's defragmenter stopped
_PLAIN_NOTE = "plain shadow"  # shadow.NOTE: the plain worker stopped or was not built


def _fmt(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}"


DEFAULT_LOG_SYNC = FacadeConfig().sync
"""The integration's default durability (``KVLOG_SYNC`` unset): issue 19's measure."""
MAIN_CONFIGS = frozenset(c.name for c in CI_MATRIX[:12])
"""The 12 main configurations: prefix caching x blocks_per_chunk x sync/async loads."""


def _over_scheduler(result: RunResult) -> float:
    return result.kvlog_s / max(result.sched_s, 1e-9)


def _modes(results: Iterable[RunResult]) -> str:
    return "/".join(sorted({repr(r.cfg.log_sync) for r in results}))


def cost_summary(results: Iterable[RunResult]) -> str:
    """kvlog's per-step cost over vLLM's scheduler step: median and max over the main
    configurations run with the log at the default durability (issue 19's measure; those
    at another, such as an fsync a step on the serving thread, are given apart), and the
    share of kvlog's time in tensor copies; where the plugin's defragmenter ran beside
    kvlog's, their ratio, and the plugin's alone over the scheduler (what the same job
    costs without kvlog, connector calls not counted)."""
    results = list(results)
    main = [r for r in results if r.cfg.name in MAIN_CONFIGS and r.steps]
    if not main:
        return "\n".join(baseline_summary(results))
    at_default = [r for r in main if r.cfg.log_sync == DEFAULT_LOG_SYNC]
    default = at_default or main  # a --log-sync run: every configuration at that mode
    others = [r for r in main if r.cfg.log_sync != DEFAULT_LOG_SYNC] if at_default else []
    ratios = sorted(map(_over_scheduler, default))
    copies = sum(r.copy_s for r in main) / max(sum(r.kvlog_s for r in main), 1e-9)
    where = f"the default {DEFAULT_LOG_SYNC!r}" if at_default else _modes(main)
    line = (
        f"kvlog/scheduler per step over the {len(default)} main configurations with the log "
        f"at {where}: median {statistics.median(ratios):.2f}, max {ratios[-1]:.2f}"
    )
    if others:
        worst = max(map(_over_scheduler, others))
        line += f" (at {_modes(others)}, {len(others)}: max {worst:.2f})"
    line += f"; {100 * copies:.0f}% of kvlog's time in tensor copies"
    shadowed = [r for r in default if r.seed_s]
    if shadowed:
        seed = sorted(r.defrag_s / r.seed_s for r in shadowed)
        alone = sorted(r.seed_s / max(r.sched_s, 1e-9) for r in shadowed)
        line += (
            f"; kvlog's defragmenter calls over the plugin's algorithm in the same loop: "
            f"median {statistics.median(seed):.2f}, max {seed[-1]:.2f}; the plugin's "
            f"defragmenter alone over the scheduler: median {statistics.median(alone):.2f}, "
            f"max {alone[-1]:.2f}"
        )
    return "\n".join((line, *baseline_summary(results)))


def baseline_summary(results: Iterable[RunResult]) -> list[str]:
    """kvlog's calls over the same calls without kvlog in the same loop (the plugin's
    defragmenter plus vLLM's plain connector worker): each configuration's ratio, then the
    median and max over the main configurations at the default durability (those at
    another given apart, as in :func:`cost_summary`)."""
    rated = [(r, r.over_baseline) for r in results if r.steps]
    each = [f"{r.cfg.name} {ratio:.2f}" for r, ratio in rated if ratio is not None]
    if not each:
        return []
    lines = ["kvlog's calls / (seed's defragmenter + plain vLLM worker): " + ", ".join(each)]
    main = [(r, x) for r, x in rated if r.cfg.name in MAIN_CONFIGS and x is not None]
    if not main:
        return lines
    at_default = [x for r, x in main if r.cfg.log_sync == DEFAULT_LOG_SYNC]
    default = sorted(at_default or [x for _, x in main])
    others = [x for r, x in main if r.cfg.log_sync != DEFAULT_LOG_SYNC] if at_default else []
    where = f"the default {DEFAULT_LOG_SYNC!r}" if at_default else _modes(r for r, _ in main)
    line = (
        f"kvlog's calls / (seed + plain worker) over the {len(default)} main configurations "
        f"with the log at {where}: median {statistics.median(default):.2f}, "
        f"max {default[-1]:.2f}"
    )
    if others:
        line += f" (at {_modes(r for r, x in main if r.cfg.log_sync != DEFAULT_LOG_SYNC)}, "
        line += f"{len(others)}: max {max(others):.2f})"
    lines.append(line)
    return lines


def format_table(results: Iterable[RunResult]) -> str:
    rows = [[str(f(r)) for _, f in COLUMNS] for r in results]
    heads = [h for h, _ in COLUMNS]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(heads)]
    line = "  ".join(h.rjust(w) for h, w in zip(heads, widths, strict=True))
    out = [line, "-" * len(line)]
    out += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(out)

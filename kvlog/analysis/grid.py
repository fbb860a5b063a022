"""What-if sweeps: every log under every policy, in parallel on Ray; segment-parallel replay.

``policy_grid(...)`` names the variants (:class:`PolicySpec`: a label and the
``CacheConfigured`` fields it overrides): ``seed`` at each threshold and ``max_swaps``,
``tail`` (vllm-gaudi PR #376) at each ratio and minimum, ``budget`` (the seed's rule at the
lowest threshold under each per-step byte budget), ``off`` (no defrag) and ``recorded`` (the
log's own policy). ``whatif(path, spec, cost)`` replays one log's events under one variant
(the geometry stays the recorded one) and sums up what it did into a :class:`SweepRow`:
highest used block id (mean and peak), blocks and bytes moved by defrag, stores, loads and
the :mod:`kvlog.analysis.cost` model's time. ``run_sweep`` runs every (log, variant) pair as a Ray
task (a local Ray by default, an existing cluster with ``address``; logs are shipped as bytes
to a remote cluster) or in this process, with a progress bar; ``write_sweep_csv`` writes
the rows (the table and the picture are :mod:`kvlog.present`'s).

``replay_segments(path)`` replays a long log in parallel segments cut at its snapshot
checkpoints: each segment restores its snapshot (checking it against the checkpoint's
digest), replays its events verifying every checkpoint up to and including the one that
starts the next segment, so the segments chain into exactly the sequential replay: the same
events, the same verified checkpoints, the same final digest.

Ray is an optional extra (``pip install 'kvlog[sweep]'``); without it a Ray run raises
:class:`kvlog.errors.MissingExtra`. Nothing here changes a log.
"""

from __future__ import annotations

import csv
import json
import os
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

from kvlog import reducers
from kvlog.analysis.cost import CostModel
from kvlog.analysis.pool import Progress, read_bytes, run_all
from kvlog.analysis.tally import RunTally
from kvlog.errors import ConfigError
from kvlog.events import CONFIG_DEFAULTS
from kvlog.log import LogReader
from kvlog.runtime.fold import Fold, Lane
from kvlog.runtime.machine import Machine
from kvlog.util.units import printable, size_label

__all__ = [
    "DEFAULT_BUDGETS",
    "DEFAULT_MIN_SWAPS",
    "DEFAULT_POLICIES",
    "DEFAULT_RATIOS_PCT",
    "DEFAULT_THRESHOLDS",
    "POLICY_NAMES",
    "PolicySpec",
    "SweepRow",
    "policy_grid",
    "run_sweep",
    "whatif",
    "write_sweep_csv",
]

POLICY_NAMES: tuple[str, ...] = ("seed", "tail", "budget", "off", "recorded")
DEFAULT_POLICIES: tuple[str, ...] = ("seed", "tail", "budget")
DEFAULT_THRESHOLDS: tuple[int, ...] = (8, 16, 32)
DEFAULT_RATIOS_PCT: tuple[int, ...] = (CONFIG_DEFAULTS["policy_ratio_pct"],)
DEFAULT_MIN_SWAPS: tuple[int, ...] = (CONFIG_DEFAULTS["policy_min_swaps"],)
DEFAULT_BUDGETS: tuple[int, ...] = (64 << 20,)
"""The grid ``policy_grid()`` and ``kvlog sweep`` try when not told otherwise."""


@dataclass(frozen=True)
class PolicySpec:
    """One what-if variant: a label and the ``CacheConfigured`` fields it sets."""

    label: str
    overrides: tuple[tuple[str, Any], ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return dict(self.overrides)


def policy_grid(
    names: Sequence[str] = DEFAULT_POLICIES,
    thresholds: Sequence[int] = DEFAULT_THRESHOLDS,
    max_swaps: Sequence[int | None] = (None,),
    ratios_pct: Sequence[int] = DEFAULT_RATIOS_PCT,
    min_swaps: Sequence[int] = DEFAULT_MIN_SWAPS,
    budgets: Sequence[int] = DEFAULT_BUDGETS,
) -> list[PolicySpec]:
    """The variants of the module docstring, in the order given (``None``: the log's own
    ``max_swaps``)."""
    out: list[PolicySpec] = []
    for name in names:
        if name not in POLICY_NAMES:
            raise ConfigError("policy", name, f"one of {list(POLICY_NAMES)}")
        if name == "seed":
            for t in thresholds:
                for m in max_swaps:
                    cap = () if m is None else (("max_swaps", m),)
                    label = f"seed t={t}" + ("" if m is None else f" m={m}")
                    out.append(PolicySpec(label, (("defrag", True), ("threshold", t), *cap)))
        elif name == "tail":
            for r in ratios_pct:
                for n in min_swaps:
                    fields_ = (("policy_ratio_pct", r), ("policy_min_swaps", n))
                    out.append(
                        PolicySpec(
                            f"tail r={r / 100:g} min={n}",
                            (("defrag", True), ("policy", "tail"), *fields_),
                        )
                    )
        elif name == "budget":
            t = min(thresholds)
            for b in budgets:
                label = f"budget {size_label(b)} t={t}"
                spec = (("defrag", True), ("threshold", t), ("max_bytes_per_step", b))
                out.append(PolicySpec(label, spec))
        elif name == "off":
            out.append(PolicySpec("off", (("defrag", False),)))
        else:
            out.append(PolicySpec("recorded"))
    return out


@dataclass
class SweepRow:
    """What one policy did over one log (bytes are bytes, times seconds)."""

    log: str
    policy: str
    steps: int = 0
    mean_max_used: float = 0.0
    peak_max_used: int = -1
    mean_used: float = 0.0
    swap_plans: int = 0
    blocks_moved: int = 0
    swap_bytes: int = 0
    stores: int = 0
    loads: int = 0
    store_bytes: int = 0
    load_bytes: int = 0
    bytes_moved: int = 0
    decode_s: float = 0.0
    defrag_s: float = 0.0
    transfer_s: float = 0.0
    modeled_s: float = 0.0
    modeled_ms_per_step: float = 0.0
    p99_step_ms: float = 0.0
    peak_step_swap_bytes: int = 0
    final_digest: str = ""
    overrides: str = ""
    rejected: str = ""

    @classmethod
    def of(cls, log: str, spec: PolicySpec, summary: RunTally, state: reducers.State) -> SweepRow:
        """The row of a what-if run: its summary's figures and final digest (none for a
        run that never took its configuration)."""
        overrides = json.dumps(spec.as_dict(), sort_keys=True)
        if summary.config is None:
            return cls(log, spec.label, overrides=overrides)
        t = summary.plans
        return cls(
            log,
            spec.label,
            steps=summary.num_steps,
            mean_max_used=summary.mean_max_used,
            peak_max_used=summary.peak_max_used,
            mean_used=summary.mean_used,
            swap_plans=t.swap_plans,
            blocks_moved=t.blocks_moved,
            swap_bytes=t.swap_bytes,
            stores=t.stores,
            loads=t.loads,
            store_bytes=t.store_bytes,
            load_bytes=t.load_bytes,
            bytes_moved=t.bytes_moved,
            decode_s=summary.decode_s,
            defrag_s=summary.defrag_s,
            transfer_s=summary.transfer_s,
            modeled_s=summary.modeled_s,
            modeled_ms_per_step=summary.modeled_ms_per_step,
            p99_step_ms=summary.p99_step_ms,
            peak_step_swap_bytes=summary.peak_step_swap_bytes,
            final_digest=str(reducers.digest(state)),
            overrides=overrides,
        )


def whatif(
    path: str | os.PathLike[str], spec: PolicySpec, cost: CostModel, log: str | None = None
) -> SweepRow:
    """Replay the events of the log at ``path`` under ``spec`` (checkpoints are skipped: a
    what-if state is not the recorded one) and sum up what it did."""
    name = log or _log_name(os.fspath(path))
    summary = RunTally(cost=cost)
    lane = Lane(Machine(observers=[summary]), spec.as_dict())
    lane.machine.counted_swaps = True  # its plans are only tallied
    fold = Fold(path, [lane], verify=False)
    if fold.reader.first_seq > 0:  # a log directory without its oldest segments: from its
        fold.start_from_snapshot(first=True)  # first snapshot on, under the spec's policy
        if lane.state.config is not None:
            summary.configured(lane.state.config)
    fold.run()
    row = SweepRow.of(name, spec, summary, lane.state)
    if fold.divergence is not None:
        row.rejected = fold.divergence.message
    return row


def _log_name(path: str) -> str:
    """The log's label in tables, CSVs and figures: its file name as text."""
    return printable(os.path.splitext(os.path.basename(path.rstrip("/")))[0])


def _whatif_task(source: str | bytes, log: str, spec: PolicySpec, cost: CostModel) -> SweepRow:
    """A Ray task: ``source`` is a path this machine reads, or the log's bytes."""
    if isinstance(source, str):
        return whatif(source, spec, cost, log)
    with tempfile.TemporaryDirectory(prefix="kvlog-sweep-") as tmp:
        path = os.path.join(tmp, "log.kvlog")
        with open(path, "wb") as f:
            f.write(source)
        return whatif(path, spec, cost, log)


def run_sweep(
    logs: Sequence[str | os.PathLike[str]],
    specs: Sequence[PolicySpec],
    cost: CostModel | None = None,
    *,
    use_ray: bool = True,
    address: str | None = None,
    num_cpus: int | None = None,
    progress: Progress | None = None,
) -> list[SweepRow]:
    """One :class:`SweepRow` per (log, variant), logs outer, on Ray or (``use_ray=False``)
    in this process."""
    cost = cost or CostModel()
    paths = [os.fspath(p) for p in logs]
    for path in paths:
        LogReader(path)  # a missing or foreign file fails here, not in a worker
    names = _unique_names(paths)
    sources: list[str | bytes] = list(paths)
    if use_ray and address is not None:
        sources = [p if os.path.isdir(p) else read_bytes(p) for p in paths]  # dirs: shared
    calls = [
        (src, name, spec, cost) for src, name in zip(sources, names, strict=True) for spec in specs
    ]
    return list(run_all(_whatif_task, calls, use_ray, address, num_cpus, progress))


def _unique_names(paths: Sequence[str]) -> list[str]:
    names = [_log_name(p) for p in paths]
    return [printable(p) if names.count(n) > 1 else n for n, p in zip(names, paths, strict=True)]


# -- presenting rows -----------------------------------------------------------------------
def write_sweep_csv(path: str, rows: Iterable[SweepRow]) -> None:
    """One row per (log, policy), every :class:`SweepRow` field."""
    names = [f.name for f in fields(SweepRow)]
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=names)
        w.writeheader()
        for row in rows:
            w.writerow(asdict(row))

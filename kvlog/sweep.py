"""What-if sweeps: every log under every policy, in parallel on Ray; segment-parallel replay.

``policy_grid(...)`` names the variants (:class:`PolicySpec`: a label and the
``CacheConfigured`` fields it overrides): ``seed`` at each threshold and ``max_swaps``,
``tail`` (vllm-gaudi PR #376) at each ratio and minimum, ``budget`` (the seed's rule at the
lowest threshold under each per-step byte budget), ``off`` (no defrag) and ``recorded`` (the
log's own policy). ``whatif(path, spec, cost)`` replays one log's events under one variant
(the geometry stays the recorded one) and sums up what it did into a :class:`SweepRow`:
highest used block id (mean and peak), blocks and bytes moved by defrag, stores, loads and
the :mod:`kvlog.cost` model's time. ``run_sweep`` runs every (log, variant) pair as a Ray
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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from kvlog import reducers
from kvlog.cost import CostModel
from kvlog.errors import ConfigError, MissingExtra
from kvlog.events import CONFIG_DEFAULTS, Checkpoint
from kvlog.fold import Fold, Lane, restore_snapshot
from kvlog.log import LogReader, list_segments
from kvlog.machine import Machine
from kvlog.present.units import printable, size_label
from kvlog.tally import RunSummary

__all__ = [
    "DEFAULT_BUDGETS",
    "DEFAULT_MIN_SWAPS",
    "DEFAULT_POLICIES",
    "DEFAULT_RATIOS_PCT",
    "DEFAULT_THRESHOLDS",
    "POLICY_NAMES",
    "PolicySpec",
    "SegmentResult",
    "SegmentedReplay",
    "SweepRow",
    "policy_grid",
    "replay_segments",
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
Progress = Callable[[int, int], None]
"""Called as ``progress(done, total)`` after each finished task."""


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
    def of(cls, log: str, spec: PolicySpec, summary: RunSummary, state: reducers.State) -> SweepRow:
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
    summary = RunSummary(cost=cost)
    lane = Lane(Machine(observers=[summary]), spec.as_dict())
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


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise MissingExtra("ray", "sweep", "running on Ray") from exc
    return ray


class _RayPool:
    """A Ray runtime for one call: started locally (``num_cpus``, no dashboard) unless one
    is running or ``address`` names a cluster; shut down after if this call started it."""

    def __init__(self, address: str | None, num_cpus: int | None) -> None:
        if num_cpus is not None and (type(num_cpus) is not int or num_cpus < 1):
            raise ConfigError("num_cpus", num_cpus, "an int >= 1 (Ray waits forever for 0)")
        self.ray = _ray()
        self.address = address
        self.started = False
        if not self.ray.is_initialized():
            options: dict[str, Any] = {"log_to_driver": False, "configure_logging": False}
            if address is None:
                options.update(num_cpus=num_cpus, include_dashboard=False)
            self.ray.init(address=address, **options)
            self.started = True

    def map(
        self, fn: Callable[..., Any], calls: Sequence[tuple[Any, ...]], progress: Progress | None
    ) -> list[Any]:
        """``[fn(*args) for args in calls]`` as Ray tasks, in order."""
        remote = self.ray.remote(num_cpus=1)(fn)
        pending = {remote.remote(*args): i for i, args in enumerate(calls)}
        out: list[Any] = [None] * len(calls)
        while pending:
            done, _ = self.ray.wait(list(pending), num_returns=1)
            for ref in done:
                out[pending.pop(ref)] = self.ray.get(ref)
            if progress is not None:
                progress(len(calls) - len(pending), len(calls))
        return out

    def close(self) -> None:
        if self.started:
            self.ray.shutdown()


def _run_all(
    fn: Callable[..., Any],
    calls: Sequence[tuple[Any, ...]],
    use_ray: bool,
    address: str | None,
    num_cpus: int | None,
    progress: Progress | None,
) -> list[Any]:
    if not use_ray:
        out = []
        for i, args in enumerate(calls):
            out.append(fn(*args))
            if progress is not None:
                progress(i + 1, len(calls))
        return out
    pool = _RayPool(address, num_cpus)
    try:
        return pool.map(fn, calls, progress)
    finally:
        pool.close()


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
        sources = [p if os.path.isdir(p) else _read_bytes(p) for p in paths]  # dirs: shared
    calls = [
        (src, name, spec, cost) for src, name in zip(sources, names, strict=True) for spec in specs
    ]
    return list(_run_all(_whatif_task, calls, use_ray, address, num_cpus, progress))


def _unique_names(paths: Sequence[str]) -> list[str]:
    names = [_log_name(p) for p in paths]
    return [printable(p) if names.count(n) > 1 else n for n, p in zip(names, paths, strict=True)]


def _read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


# -- presenting rows -----------------------------------------------------------------------
def write_sweep_csv(path: str, rows: Iterable[SweepRow]) -> None:
    """One row per (log, policy), every :class:`SweepRow` field."""
    names = [f.name for f in fields(SweepRow)]
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=names)
        w.writeheader()
        for row in rows:
            w.writerow(asdict(row))


# -- segment-parallel replay ---------------------------------------------------------------
@dataclass(frozen=True)
class _Segment:
    index: int
    start_seq: int  # first record to replay
    stop_seq: int  # the snapshot checkpoint that ends it (-1: the end of the log)
    start_event_seq: int = -1  # the last event the starting snapshot covers
    start_digest: str = ""
    snapshot: bytes = b""
    opens_with_snapshot: bool = False  # its first record is the snapshot it starts from


@dataclass
class SegmentResult:
    """What one segment found."""

    index: int
    start_seq: int
    stop_seq: int
    num_events: int = 0
    num_checkpoints: int = 0
    num_verified: int = 0
    last_event_seq: int = -1
    final_digest: str = ""
    divergence: str = ""


@dataclass
class SegmentedReplay:
    """The chained segments: the sequential replay's figures, and each segment's."""

    path: str
    segments: list[SegmentResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(not s.divergence for s in self.segments)

    @property
    def num_events(self) -> int:
        return sum(s.num_events for s in self.segments)

    @property
    def num_verified(self) -> int:
        return sum(s.num_verified for s in self.segments)

    @property
    def final_digest(self) -> str:
        return self.segments[-1].final_digest if self.segments else ""

    @property
    def divergence(self) -> str:
        return next((s.divergence for s in self.segments if s.divergence), "")


def _plan_segments(path: str, max_segments: int) -> list[_Segment]:
    """Cut at snapshot checkpoints, at most ``max_segments`` pieces of similar length; a
    log directory: one piece per segment file, planned from the manifest without reading."""
    if os.path.isdir(path):
        return _directory_segments(path)
    snaps: list[tuple[int, Checkpoint]] = []
    last = -1
    for seq, record in LogReader(path).records():
        last = seq
        if type(record) is Checkpoint and record.snapshot:
            snaps.append((seq, record))
    snaps = [s for s in snaps if s[0] < last]  # a snapshot at the very end starts nothing
    if max_segments > 1 and len(snaps) >= max_segments:
        every = len(snaps) / max_segments
        snaps = [snaps[int(every * (i + 1)) - 1] for i in range(max_segments - 1)]
    cuts: list[_Segment] = []
    start, covered, digest, blob = 0, -1, "", b""
    for i, (seq, checkpoint) in enumerate(snaps):
        cuts.append(_Segment(i, start, seq, covered, digest, blob))
        start, covered = seq + 1, checkpoint.seq
        digest, blob = checkpoint.digest, checkpoint.snapshot
    cuts.append(_Segment(len(snaps), start, -1, covered, digest, blob))
    return cuts


def _directory_segments(path: str) -> list[_Segment]:
    """One piece per segment of a log directory: each starts from its own opening snapshot
    (read by its task) and verifies the next one's opening checkpoint too."""
    infos = list_segments(path)
    cuts = []
    for i, info in enumerate(infos):
        stop = infos[i + 1].first_seq if i + 1 < len(infos) else -1
        cuts.append(_Segment(i, info.first_seq, stop, opens_with_snapshot=info.first_seq > 0))
    return cuts


def _start_at_opening_snapshot(fold: Fold, path: str, out: SegmentResult) -> bool:
    """Start ``fold`` from the snapshot checkpoint that opens its segment (at
    ``out.start_seq``), checked against its digest; False (``out.divergence`` set) when
    there is none or it does not check out."""
    seq, checkpoint = next(iter(LogReader(path).records(out.start_seq)), (-1, None))
    if not isinstance(checkpoint, Checkpoint) or not checkpoint.snapshot:
        out.divergence = f"the segment at seq {out.start_seq} does not open with a snapshot"
        return False
    state = restore_snapshot(checkpoint.snapshot, checkpoint.digest, path, seq)
    if isinstance(state, str):
        out.divergence = f"the snapshot at seq {seq}: {state}"
        return False
    fold.start_at(state, checkpoint.seq, seq + 1)
    fold.num_checkpoints = fold.num_verified = 1
    return True


def _replay_segment(source: str | bytes, seg: _Segment) -> SegmentResult:
    """A Ray task: replay one segment of the log (a path here, or its bytes), verifying
    every checkpoint in it, the one that starts the next segment included."""
    if isinstance(source, bytes):
        with tempfile.TemporaryDirectory(prefix="kvlog-segment-") as tmp:
            path = os.path.join(tmp, "log.kvlog")
            with open(path, "wb") as f:
                f.write(source)
            return _replay_segment(path, seg)
    out = SegmentResult(seg.index, seg.start_seq, seg.stop_seq, last_event_seq=seg.start_event_seq)
    fold = Fold(
        source, verify=True, stop_seq=seg.stop_seq, skip_snapshots=frozenset([seg.stop_seq])
    )
    if seg.opens_with_snapshot and not _start_at_opening_snapshot(fold, source, out):
        return out
    if seg.snapshot:  # the next segment checks the snapshot that ends this one
        state = restore_snapshot(seg.snapshot, seg.start_digest, source, seg.start_seq - 1)
        if isinstance(state, str):
            out.divergence = f"the snapshot before seq {seg.start_seq} does not match its digest"
            return out
        fold.start_at(state, seg.start_event_seq, seg.start_seq)
    fold.run()
    out.num_events, out.last_event_seq = fold.num_events, fold.last_event_seq
    out.num_checkpoints, out.num_verified = fold.num_checkpoints, fold.num_verified
    d = fold.divergence
    if d is not None:
        out.divergence = (
            d.message if d.kind == "rejected" else f"a checkpoint does not verify: {d.message}"
        )
    out.final_digest = str(reducers.digest(fold.state))
    return out


def replay_segments(
    path: str | os.PathLike[str],
    *,
    use_ray: bool = True,
    address: str | None = None,
    num_cpus: int | None = None,
    max_segments: int | None = None,
    progress: Progress | None = None,
) -> SegmentedReplay:
    """The log at ``path`` replayed in segments (module docstring), on Ray or here."""
    p = os.fspath(path)
    pieces = max_segments or max(2, 2 * (num_cpus or os.cpu_count() or 2))
    segments = _plan_segments(p, pieces)
    remote = use_ray and address is not None and not os.path.isdir(p)  # a directory: shared
    source: str | bytes = _read_bytes(p) if remote else p
    calls = [(source, seg) for seg in segments]
    results = _run_all(_replay_segment, calls, use_ray, address, num_cpus, progress)
    return SegmentedReplay(p, list(results))

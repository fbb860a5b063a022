"""What a run did, in one vocabulary for every reader of a log.

A run's machine is fed by the fold through a :class:`~kvlog.runtime.fold.Lane`; what the
run does is tallied as it goes by a :class:`RunTally` (an observer of the machine: steps,
the highest used block, the cost model's time), whose plan counts and bytes are its
:class:`PlanTally`; step by step, for a picture, it is a :class:`Series`; reported, it is a
:class:`RunResult` (a replay's per policy: ``PolicyResult``; a synthetic run's:
``SynthResult``; a sweep's row is built from a RunTally too)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvlog.analysis.cost import CostModel
from kvlog.events import (
    WHOLE_STEPS,
    CacheConfigured,
    Event,
    Plan,
    StepEnded,
    StepPacked,
    StepScheduled,
    SwapPlan,
    TransferPlan,
    pair_bytes,
    swap_mode,
)
from kvlog.reducers import State
from kvlog.reducers.defrag import pad_bucket
from kvlog.runtime.machine import Observer
from kvlog.util.units import p99

__all__ = ["PlanTally", "RunResult", "RunTally", "Series", "StepHook"]


class PlanTally:
    """Running totals of plans (whole run) and of the current step (``end_step`` resets).

    A ``SwapPlan`` moves ``pair_bytes`` per pair; a ``TransferPlan`` its ``num_bytes``."""

    __slots__ = (
        "blocks_moved",
        "load_bytes",
        "loads",
        "page_size_bytes",
        "step_blocks_moved",
        "step_load_bytes",
        "step_padded_pairs",
        "step_store_bytes",
        "step_swap_bytes",
        "store_bytes",
        "stores",
        "swap_bytes",
        "swap_plans",
    )

    def __init__(self, page_size_bytes: int) -> None:
        self.page_size_bytes = page_size_bytes
        self.swap_plans = self.blocks_moved = self.swap_bytes = 0
        self.stores = self.store_bytes = self.loads = self.load_bytes = 0
        self.step_blocks_moved = self.step_swap_bytes = self.step_padded_pairs = 0
        self.step_store_bytes = self.step_load_bytes = 0

    def add(self, plans: list[Plan]) -> None:
        """Count one event's plans."""
        for plan in plans:
            if type(plan) is SwapPlan:
                self.add_swap(len(plan.pairs), plan.padded_to, plan.mode)
            elif type(plan) is TransferPlan:
                if plan.kind == "store":
                    self.stores += 1
                    self.store_bytes += plan.num_bytes
                    self.step_store_bytes += plan.num_bytes
                else:
                    self.loads += 1
                    self.load_bytes += plan.num_bytes
                    self.step_load_bytes += plan.num_bytes

    def add_swap(self, moved: int, padded_to: int, mode: str) -> None:
        """Count one ``SwapPlan`` of ``moved`` pairs (or a counted step's moves)."""
        num_bytes = moved * pair_bytes(self.page_size_bytes, mode)
        self.swap_plans += 1
        self.blocks_moved += moved
        self.swap_bytes += num_bytes
        self.step_blocks_moved += moved
        self.step_swap_bytes += num_bytes
        self.step_padded_pairs += padded_to

    @property
    def bytes_moved(self) -> int:
        """Defrag, store and load bytes together."""
        return self.swap_bytes + self.store_bytes + self.load_bytes

    def end_step(self) -> None:
        """Start the next step's totals at zero."""
        self.step_blocks_moved = self.step_swap_bytes = self.step_padded_pairs = 0
        self.step_store_bytes = self.step_load_bytes = 0


StepHook = Callable[["RunTally", State, int], None]
"""Called as ``hook(summary, state, step)`` at every step's end, before the step's plan
totals restart (a replay's time series reads them there)."""


class RunTally(Observer):
    """What one run did, step by step: an observer of its machine.

    The configuration (page bytes) is the ``CacheConfigured`` the machine takes, or
    ``config`` for a run that starts from a snapshot. With a ``cost`` model every step is
    also timed (``kvlog.analysis.cost``: decode, defrag, transfers)."""

    def __init__(
        self,
        config: CacheConfigured | None = None,
        cost: CostModel | None = None,
        on_step: StepHook | None = None,
    ) -> None:
        self.config = config
        self.cost = cost
        self.on_step = on_step
        self.plans = PlanTally(0 if config is None else config.page_size_bytes)
        self.num_events = self.num_steps = 0
        self.peak_max_used = -1
        self.sum_max_used = self.sum_used = 0
        self.peak_step_swap_bytes = 0
        self.decode_s = self.defrag_s = self.transfer_s = 0.0
        self.step_ms: list[float] = []
        """Modeled milliseconds of each step (with a cost model)."""
        self._step_defrag_s = 0.0

    def configured(self, config: CacheConfigured) -> None:
        """The run's configuration: its ``CacheConfigured``, or a snapshot's (the run
        starts there)."""
        self.config = config
        self.plans.page_size_bytes = config.page_size_bytes

    def after(self, state: State, event: Event, plans: list[Plan]) -> None:
        self.num_events += 1
        if type(event) is CacheConfigured:
            self.configured(event)
        if plans:
            self.plans.add(plans)
            if self.cost is not None:
                self._time_defrag(plans)
        if type(event) in WHOLE_STEPS and state.counted_pairs:
            self._counted_swap(state)
        if isinstance(event, (StepEnded, StepScheduled, StepPacked)):
            self._end_step(state, event.step)

    def _counted_swap(self, state: State) -> None:
        """A counted machine's step moved ``state.counted_pairs`` pairs without a plan:
        the ``SwapPlan`` it stands for (as ``defrag.end_step_moved`` makes it: padded to
        its bucket, in the state's configured mode), counted and timed."""
        config, moved = state.config, state.counted_pairs
        assert config is not None, "a configured state moves blocks"
        padded_to, mode = pad_bucket(moved, config.pad_sizes), swap_mode(config)
        self.plans.add_swap(moved, padded_to, mode)
        if self.cost is not None:
            self._time_swap(padded_to, mode)

    def _time_defrag(self, plans: list[Plan]) -> None:
        for plan in plans:
            if type(plan) is SwapPlan:
                self._time_swap(plan.padded_to, plan.mode)

    def _time_swap(self, padded_to: int, mode: str) -> None:
        assert self.cost is not None and self.config is not None, "a configured, costed run"
        page = self.config.page_size_bytes
        self._step_defrag_s += self.cost.defrag_s(padded_to, page, mode == "swap")

    def _end_step(self, state: State, step: int) -> None:
        top, tally = int(state.max_used), self.plans
        self.num_steps += 1
        self.peak_max_used = max(self.peak_max_used, top)
        self.sum_max_used += top
        self.sum_used += int(state.num_used)
        self.peak_step_swap_bytes = max(self.peak_step_swap_bytes, tally.step_swap_bytes)
        if self.cost is not None and self.config is not None:
            decode = self.cost.decode_s(top, self.config.page_size_bytes)
            transfer = self.cost.transfer_s(tally.step_store_bytes, tally.step_load_bytes)
            self.decode_s += decode
            self.transfer_s += transfer
            self.defrag_s += self._step_defrag_s
            self.step_ms.append(1e3 * (decode + transfer + self._step_defrag_s))
        if self.on_step is not None:
            self.on_step(self, state, step)
        tally.end_step()
        self._step_defrag_s = 0.0

    # -- the figures ---------------------------------------------------------------------
    @property
    def mean_max_used(self) -> float:
        return self.sum_max_used / self.num_steps if self.num_steps else 0.0

    @property
    def mean_used(self) -> float:
        return self.sum_used / self.num_steps if self.num_steps else 0.0

    @property
    def modeled_s(self) -> float:
        return self.decode_s + self.defrag_s + self.transfer_s

    @property
    def modeled_ms_per_step(self) -> float:
        return 1e3 * self.modeled_s / self.num_steps if self.num_steps else 0.0

    @property
    def p99_step_ms(self) -> float:
        """The 99th percentile of the modeled step times (0 without any; numpy's)."""
        return p99(self.step_ms)


class RunResult:
    """A result's figures of one run under the names results report (``num_swap_plans``,
    ``store_bytes``...), read from the run's :class:`RunTally`: a base of the result
    types (replay's ``PolicyResult``, ``SynthResult``), which hold it as ``tally``."""

    tally: RunTally

    @property
    def num_events(self) -> int:
        return self.tally.num_events

    @property
    def num_steps(self) -> int:
        return self.tally.num_steps

    @property
    def num_swap_plans(self) -> int:
        return self.tally.plans.swap_plans

    @property
    def num_swapped_blocks(self) -> int:
        return self.tally.plans.blocks_moved

    @property
    def swap_bytes(self) -> int:
        return self.tally.plans.swap_bytes

    @property
    def num_stores(self) -> int:
        return self.tally.plans.stores

    @property
    def num_loads(self) -> int:
        return self.tally.plans.loads

    @property
    def store_bytes(self) -> int:
        return self.tally.plans.store_bytes

    @property
    def load_bytes(self) -> int:
        return self.tally.plans.load_bytes

    @property
    def bytes_moved(self) -> int:
        return self.tally.plans.bytes_moved

    @property
    def peak_max_used(self) -> int:
        return self.tally.peak_max_used

    @property
    def sum_max_used(self) -> int:
        return self.tally.sum_max_used

    @property
    def mean_max_used(self) -> float:
        return self.tally.mean_max_used


@dataclass
class Series:
    """What one run of the reducers did, step by step (one entry per ``StepEnded``)."""

    label: str = "recorded"
    step: list[int] = field(default_factory=list)
    num_used: list[int] = field(default_factory=list)
    max_used: list[int] = field(default_factory=list)
    num_swapped: list[int] = field(default_factory=list)
    store_bytes: list[int] = field(default_factory=list)
    load_bytes: list[int] = field(default_factory=list)
    num_padded: list[int] = field(default_factory=list)
    """Pairs each step's swap plans copy with their pad buckets (``SwapPlan.padded_to``):
    what the cost model charges, as the sweep's figures do."""

    def add(
        self,
        step: int,
        num_used: int,
        max_used: int,
        swapped: int,
        store: int,
        load: int,
        padded: int | None = None,
    ) -> None:
        self.step.append(step)
        self.num_used.append(num_used)
        self.max_used.append(max_used)
        self.num_swapped.append(swapped)
        self.store_bytes.append(store)
        self.load_bytes.append(load)
        self.num_padded.append(swapped if padded is None else padded)

    @property
    def fragmentation(self) -> list[float]:
        """Share of the ids up to the highest used one that are holes (0 = compact)."""
        return [
            1.0 - used / (top + 1) if top >= 0 else 0.0
            for used, top in zip(self.num_used, self.max_used, strict=True)
        ]

    @property
    def transfer_bytes(self) -> list[int]:
        return [a + b for a, b in zip(self.store_bytes, self.load_bytes, strict=True)]

    def swap_bytes(self, config: CacheConfigured) -> list[int]:
        """Bytes defrag moved per step (``events.pair_bytes`` per pair)."""
        per_pair = pair_bytes(config.page_size_bytes, swap_mode(config))
        return [n * per_pair for n in self.num_swapped]

    def modeled_ms(self, config: CacheConfigured, cost: CostModel) -> list[float]:
        """The cost model's step time in ms, defrag charged for its padded pairs (as the
        sweep and replay's summary charge it)."""
        page, swap = config.page_size_bytes, swap_mode(config) == "swap"
        return [
            1e3
            * (
                cost.decode_s(top, page)
                + cost.defrag_s(n, page, swap)
                + cost.transfer_s(store, load)
            )
            for top, n, store, load in zip(
                self.max_used, self.num_padded, self.store_bytes, self.load_bytes, strict=True
            )
        ]

    def __len__(self) -> int:
        return len(self.step)

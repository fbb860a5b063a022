"""What a run's plans did: counts and bytes of defrag moves, stores and loads, over the
whole run and within the current step. One definition, used by every observer that sums a
run up (replay's ``RunStats``, the sweep's rows)."""

from __future__ import annotations

from kvlog.events import Plan, SwapPlan, TransferPlan

__all__ = ["PlanTally"]


class PlanTally:
    """Running totals of plans (whole run) and of the current step (``end_step`` resets).

    A ``SwapPlan`` of ``n`` pairs moves ``n`` pages in move mode and ``2 n`` in swap mode
    (both blocks are copied); a ``TransferPlan`` moves its ``num_bytes``."""

    __slots__ = (
        "blocks_moved",
        "load_bytes",
        "loads",
        "page_size_bytes",
        "step_blocks_moved",
        "step_load_bytes",
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
        self.step_blocks_moved = self.step_swap_bytes = 0
        self.step_store_bytes = self.step_load_bytes = 0

    def add(self, plans: list[Plan]) -> None:
        """Count one event's plans."""
        for plan in plans:
            if type(plan) is SwapPlan:
                moved = len(plan.pairs)
                num_bytes = moved * self.page_size_bytes * (2 if plan.mode == "swap" else 1)
                self.swap_plans += 1
                self.blocks_moved += moved
                self.swap_bytes += num_bytes
                self.step_blocks_moved += moved
                self.step_swap_bytes += num_bytes
            elif type(plan) is TransferPlan:
                if plan.kind == "store":
                    self.stores += 1
                    self.store_bytes += plan.num_bytes
                    self.step_store_bytes += plan.num_bytes
                else:
                    self.loads += 1
                    self.load_bytes += plan.num_bytes
                    self.step_load_bytes += plan.num_bytes

    def end_step(self) -> None:
        """Start the next step's totals at zero."""
        self.step_blocks_moved = self.step_swap_bytes = 0
        self.step_store_bytes = self.step_load_bytes = 0

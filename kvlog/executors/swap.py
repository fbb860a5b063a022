"""The swap executor: a defrag ``SwapPlan`` applied to every canonical view, right now.

``"move"`` copies each ``src`` block onto its ``dst``; ``"swap"`` exchanges them (prefix
caching: a free block may hold cached data). The sources and destinations of one plan are
disjoint sets, so the pairs are independent and may run in any order.

- On the host (``cpu`` backend) pairs become run-coalesced slice copies (see
  :mod:`kvlog.executors.copies`); pad entries are skipped, since copying a block onto
  itself changes nothing. Swaps exchange through a bounded scratch buffer.
- On accelerators (and the fake device, which models one) the plan is padded to
  ``padded_to`` entries for graph capture, with the pad block copied onto itself (the HPU
  layout's pad block ``num_gpu_blocks``, else block 0, which defrag never moves), the two
  index tensors are built and moved to the device once per plan, and each canonical tensor
  gets one ``index_select`` and one ``index_copy_`` (two of each for ``"swap"``), queued on
  the current (compute) stream. No negative indices are used.
"""

from __future__ import annotations

import numpy as np
import torch

from kvlog.events import SwapPlan
from kvlog.executors.copies import build_host_program
from kvlog.executors.devices import Device
from kvlog.executors.layouts import CacheLayout

__all__ = ["SCRATCH_BYTES", "SwapExecutor"]

SCRATCH_BYTES = 16 << 20
"""Bound of the host scratch buffer used to exchange rows in ``"swap"`` mode."""


class SwapExecutor:
    """Applies swap plans to the canonical views of one :class:`CacheLayout`."""

    def __init__(self, layout: CacheLayout, device: Device) -> None:
        self._layout = layout
        self._device = device
        self._views = [t.view for t in layout.tensors]
        max_page = max(t.page_bytes for t in layout.tensors)
        self._chunk_rows = max(1, SCRATCH_BYTES // max_page)
        self._scratch: torch.Tensor | None = None

    def apply(self, plan: SwapPlan) -> None:
        """Move or swap the plan's pairs in every canonical tensor."""
        pairs = np.asarray(plan.pairs, dtype=np.int64).reshape(-1, 2)
        self._check(plan, pairs)
        if len(pairs) == 0:
            return
        if self._device.host_like:
            self._apply_host(plan, pairs[:, 0], pairs[:, 1])
        else:
            self._apply_device(plan, pairs)

    def _check(self, plan: SwapPlan, pairs: np.ndarray) -> None:
        num_blocks = self._layout.num_gpu_blocks
        assert plan.mode in ("move", "swap"), f"SwapPlan mode {plan.mode!r} is not move/swap"
        assert plan.padded_to >= len(pairs), (
            f"SwapPlan step {plan.step}: padded_to={plan.padded_to} < {len(pairs)} pairs"
        )
        if len(pairs) == 0:
            return
        assert pairs.min() >= 0 and pairs.max() < num_blocks, (
            f"SwapPlan step {plan.step}: block id outside [0, {num_blocks})"
        )
        src, dst = pairs[:, 0], pairs[:, 1]
        assert len(np.unique(src)) == len(src) and len(np.unique(dst)) == len(dst), (
            f"SwapPlan step {plan.step}: a block appears twice among sources or destinations"
        )
        assert not np.intersect1d(src, dst).size, (
            f"SwapPlan step {plan.step}: sources and destinations overlap"
        )
        pad = self._layout.pad_block_id
        assert plan.padded_to == len(pairs) or not (pairs == pad).any(), (
            f"SwapPlan step {plan.step}: pad block {pad} used by a pair of a padded plan"
        )

    def _apply_host(self, plan: SwapPlan, src: np.ndarray, dst: np.ndarray) -> None:
        if plan.mode == "move":
            program = build_host_program(src, dst)
            for view in self._views:
                program.copy(view, view)
            return
        program = build_host_program(src, dst, max_rows=self._chunk_rows)
        scratch = self._host_scratch()
        for view in self._views:
            rows = scratch[: self._chunk_rows * view.shape[1]].view(-1, view.shape[1])
            program.exchange(view, rows)

    def _host_scratch(self) -> torch.Tensor:
        if self._scratch is None:
            max_page = max(int(v.shape[1]) for v in self._views)
            self._scratch = torch.empty(self._chunk_rows * max_page, dtype=torch.int8)
        return self._scratch

    def _apply_device(self, plan: SwapPlan, pairs: np.ndarray) -> None:
        padded = np.full((2, plan.padded_to), self._layout.pad_block_id, dtype=np.int64)
        padded[:, : len(pairs)] = pairs.T
        index = torch.from_numpy(padded).to(self._layout.device, non_blocking=True)
        src, dst = index[0], index[1]
        for view in self._views:
            from_src = view.index_select(0, src)
            if plan.mode == "swap":
                view.index_copy_(0, src, view.index_select(0, dst))
            view.index_copy_(0, dst, from_src)

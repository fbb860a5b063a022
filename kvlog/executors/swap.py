"""The swap executor: a defrag ``SwapPlan`` applied to every canonical view, right now.

``"move"`` copies each ``src`` block onto its ``dst``; ``"swap"`` exchanges them (prefix
caching: a free block may hold cached data). The sources and destinations of one plan are
disjoint sets, so the pairs are independent and may run in any order.

- On the host (``cpu`` backend) each canonical tensor gets one numpy gather and scatter
  per chunk of pairs (``copies.indexed_copy`` / ``indexed_exchange_all``: a ``"swap"`` that
  fits one chunk is one gather of ``[dst, src]`` and one scatter to ``[src, dst]``), as the
  plugin's ``CacheSwapUtils`` does with ``index_select``/``index_copy_``: a defrag plan's pairs are
  scattered (highest used into lowest free), and one gather/scatter call per tensor beats
  a slice copy per run of blocks (bench_facade: 220 pairs of 128-byte pages, 4 tensors:
  ~180 us against ~570 us for run-coalesced slice copies); numpy's call costs a third of
  torch's on small plans. The gathered rows of one chunk are bounded by
  ``SCRATCH_BYTES``; pad entries are skipped.
- On accelerators (and the fake device, which models one) the plan is padded to
  ``padded_to`` entries for graph capture, with the pad block copied onto itself (the HPU
  layout's pad block ``num_gpu_blocks``, else block 0, which defrag never moves), the two
  index tensors are built and moved to the device once per plan, and each canonical tensor
  gets one ``index_select`` and one ``index_copy_`` (for ``"swap"`` over both sides at
  once), queued on the current (compute) stream. No negative indices are used.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from kvlog.events import SwapPlan
from kvlog.executors.copies import host_rows, indexed_copy, indexed_exchange_all
from kvlog.executors.devices import Device
from kvlog.executors.layouts import CacheLayout

__all__ = ["SCRATCH_BYTES", "SwapExecutor"]

SCRATCH_BYTES = 16 << 20
"""Bound of the rows one host gather holds (per canonical tensor and chunk of pairs)."""


class SwapExecutor:
    """Applies swap plans to the canonical views of one :class:`CacheLayout`."""

    def __init__(self, layout: CacheLayout, device: Device) -> None:
        self._layout = layout
        self._device = device
        self._views = [t.view for t in layout.tensors]
        max_page = max(t.page_bytes for t in layout.tensors)
        self._chunk_rows = max(1, SCRATCH_BYTES // max_page)
        self._rows: list[np.ndarray] | None = None  # host views as numpy, built on first use

    def apply(self, plan: SwapPlan) -> None:
        """Move or swap the plan's pairs in every canonical tensor."""
        flat = list(itertools.chain.from_iterable(plan.pairs))
        self._check(plan, flat)
        if not flat:
            return
        pairs = np.array(flat, dtype=np.int64).reshape(-1, 2)
        if self._device.host_like:
            self._apply_host(plan, pairs[:, 0], pairs[:, 1])
        else:
            self._apply_device(plan, pairs)

    def _check(self, plan: SwapPlan, flat: list[int]) -> None:
        """The plan's invariants (the reducer's contract), on its ids as one flat list."""
        count = len(flat) // 2
        assert plan.mode in ("move", "swap"), f"SwapPlan mode {plan.mode!r} is not move/swap"
        assert plan.padded_to >= count, (
            f"SwapPlan step {plan.step}: padded_to={plan.padded_to} < {count} pairs"
        )
        if not flat:
            return
        num_blocks = self._layout.num_gpu_blocks
        assert min(flat) >= 0 and max(flat) < num_blocks, (
            f"SwapPlan step {plan.step}: block id outside [0, {num_blocks})"
        )
        assert len(set(flat)) == len(flat), (
            f"SwapPlan step {plan.step}: a block appears twice among sources and destinations"
        )
        pad = self._layout.pad_block_id
        assert plan.padded_to == count or pad not in flat, (
            f"SwapPlan step {plan.step}: pad block {pad} used by a pair of a padded plan"
        )

    def _apply_host(self, plan: SwapPlan, src: np.ndarray, dst: np.ndarray) -> None:
        """Gather and scatter, a chunk of at most ``_chunk_rows`` pairs at a time (the
        pairs are independent: sources and destinations are disjoint)."""
        if self._rows is None:
            self._rows = [host_rows(view) for view in self._views]
        if plan.mode == "swap":
            indexed_exchange_all(self._rows, src, dst, self._chunk_rows)
            return
        for rows in self._rows:
            indexed_copy(rows, rows, dst, src, self._chunk_rows)

    def _apply_device(self, plan: SwapPlan, pairs: np.ndarray) -> None:
        """One gather and one scatter per canonical tensor: ``"move"`` reads the sources
        and writes the destinations; ``"swap"`` reads ``[dst, src]`` and writes ``[src,
        dst]`` (disjoint sets, so the gathered rows are all read before any is written).
        Pad entries copy the pad block onto itself."""
        width = plan.padded_to
        if plan.mode == "swap":
            index = np.full((2, 2 * width), self._layout.pad_block_id, dtype=np.int64)
            count = len(pairs)
            index[0, :count], index[0, width : width + count] = pairs[:, 1], pairs[:, 0]
            index[1, :count], index[1, width : width + count] = pairs[:, 0], pairs[:, 1]
        else:
            index = np.full((2, width), self._layout.pad_block_id, dtype=np.int64)
            index[:, : len(pairs)] = pairs.T
        on_device = torch.from_numpy(index).to(self._layout.device, non_blocking=True)
        read, written = on_device[0], on_device[1]
        for view in self._views:
            view.index_copy_(0, written, view.index_select(0, read))

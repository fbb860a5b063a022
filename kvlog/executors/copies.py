"""Copy programs: a plan's ``(src, dst)`` rows compiled once, applied to every canonical view.

A program is built once per plan from numpy arrays and then applied to each canonical tensor
with a handful of copy calls, so the per-tensor cost is one call per run of consecutive
blocks.

- :class:`HostProgram` (host memory on both sides): pairs sorted by destination and cut
  into runs of consecutive ids; each run is one slice copy, forward or reversed (defrag
  moves the highest used block into the lowest free one, so its runs go backwards).
- :class:`DeviceTransferProgram` (accelerator <-> pinned host): host rows are always
  addressed as contiguous slices (what DMA needs); the device side is a slice where it is
  contiguous, otherwise one device index tensor per job, sliced per host run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "INDEXED_MAX_PAIRS",
    "TORCH_COPY_BYTES",
    "DeviceTransferProgram",
    "HostProgram",
    "Segment",
    "build_device_transfer_program",
    "build_host_program",
    "find_runs",
    "host_rows",
    "indexed_copy",
    "indexed_exchange",
    "indexed_exchange_all",
]

TORCH_COPY_BYTES = 32 << 20
"""Forward runs of at least this many bytes use torch's (multi-threaded) ``copy_``.

Measured on a shared 2-core machine (bench/bench_transfer.py), numpy's single-threaded
``memcpy`` beat torch's threaded ``copy_`` on 4 MiB runs (about 0.9x against 0.4x of a
plain ``copy_``), so only very long runs go to torch."""

INDEXED_MAX_PAIRS = 64
"""Host transfers of at most this many pairs copy with one numpy gather/scatter per tensor
(``indexed_copy``); longer ones compile a run-coalesced ``HostProgram``, whose slice
copies move long runs without a temporary. A small job's cost is per call, not per byte:
6 pairs on 4 tensors took ~140 us through a program (its numpy set-up), ~10 us indexed.
Device transfer programs of at most this many pairs are built on Python ints (~8 us for 6
pairs, against ~26 us through numpy)."""

Segment = tuple[int, int, int, int, int]
"""``(dst_start, dst_stop, src_start, src_stop, step)``: ``dst[dst_start:dst_stop]`` gets
``src[src_start:src_stop]`` (``step`` 1) or the same rows in reverse order (``step`` -1)."""


def find_runs(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Cut pairs (already sorted by ``dst``) into runs; return run starts and directions.

    A run is a maximal stretch where ``dst`` rises by one and ``src`` moves by the same
    step, +1 (forward, direction 1) or -1 (reversed, direction -1). Single pairs are forward.
    """
    count = len(dst)
    if count == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    link = np.zeros(count, dtype=np.int64)
    if count > 1:
        step = np.diff(src)
        rises = np.diff(dst) == 1
        link[1:] = np.where(rises & (step == 1), 1, np.where(rises & (step == -1), -1, 0))
    previous = np.concatenate(([0], link[:-1]))
    is_start = (link == 0) | ((previous != 0) & (link != previous))
    starts = np.flatnonzero(is_start)
    stops = np.append(starts[1:], count)
    second = np.minimum(starts + 1, count - 1)
    directions = np.where(stops - starts > 1, link[second], 1)
    return starts, directions


@dataclass(frozen=True)
class HostProgram:
    """Segments of a host copy, shared by every canonical tensor of a plan.

    Every segment is one slice copy: numpy slice assignment (a ``memcpy`` per row run; a
    reversed run reads a negative-stride view, which torch cannot express) with no thread
    pool to wake for each small copy, or torch's threaded ``copy_`` for long forward runs
    (``TORCH_COPY_BYTES``). No temporaries, no index tensors.
    """

    segments: tuple[Segment, ...]

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Apply the program: rows of ``src`` into rows of ``dst`` (may be the same tensor)."""
        dst_rows, src_rows = _numpy(dst), _numpy(src)
        threaded_rows = max(1, TORCH_COPY_BYTES // max(1, int(dst.shape[1])))
        for d0, d1, s0, s1, step in self.segments:
            if step == 1 and d1 - d0 >= threaded_rows:
                dst[d0:d1].copy_(src[s0:s1])  # long runs: torch's threaded copy
            else:
                dst_rows[d0:d1] = src_rows[s0:s1] if step == 1 else src_rows[s0:s1][::-1]

    def exchange(self, tensor: torch.Tensor, scratch: torch.Tensor) -> None:
        """Swap the rows of each segment pairwise within ``tensor`` (segments <= scratch)."""
        rows, spare = _numpy(tensor), _numpy(scratch)
        for d0, d1, s0, s1, step in self.segments:
            held = spare[: d1 - d0]
            held[:] = rows[d0:d1]
            if step == 1:
                rows[d0:d1] = rows[s0:s1]
                rows[s0:s1] = held
            else:
                rows[d0:d1] = rows[s0:s1][::-1]
                rows[s0:s1] = held[::-1]


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    assert tensor.device.type == "cpu", "host programs run on CPU tensors only"
    return tensor.numpy()  # type: ignore[no-any-return]


def host_rows(tensor: torch.Tensor) -> np.ndarray:
    """A host tensor's rows as a numpy array sharing its memory (build once, reuse)."""
    return _numpy(tensor)


def indexed_copy(
    dst_rows: np.ndarray,
    src_rows: np.ndarray,
    dst_ids: np.ndarray,
    src_ids: np.ndarray,
    max_rows: int,
) -> None:
    """Rows ``src_rows[src_ids[i]]`` into ``dst_rows[dst_ids[i]]`` (``host_rows`` arrays,
    possibly the same one when the id sets are disjoint): numpy fancy indexing, ``max_rows``
    rows at a time, so a gather's temporary stays bounded."""
    if len(dst_ids) <= max_rows:  # the usual job: one gather, one scatter, no slices
        dst_rows[dst_ids] = src_rows[src_ids]
        return
    for a in range(0, len(dst_ids), max_rows):
        dst_rows[dst_ids[a : a + max_rows]] = src_rows[src_ids[a : a + max_rows]]


def indexed_exchange(rows: np.ndarray, a_ids: np.ndarray, b_ids: np.ndarray, max_rows: int) -> None:
    """Swap rows ``a_ids[i]`` and ``b_ids[i]`` of a ``host_rows`` array (disjoint id sets),
    gathering at most ``max_rows`` rows at a time."""
    indexed_exchange_all([rows], a_ids, b_ids, max_rows)


def indexed_exchange_all(
    tensors: Sequence[np.ndarray], a_ids: np.ndarray, b_ids: np.ndarray, max_rows: int
) -> None:
    """:func:`indexed_exchange` on each of ``tensors`` (a plan swaps the same rows of every
    view), its index arrays built once for all of them: a model's hundreds of views then
    cost one gather and one scatter each."""
    if 2 * len(a_ids) <= max_rows:  # one gather of [b, a], one scatter to [a, b]: numpy
        # gathers the whole right-hand side before it writes, and the sets are disjoint
        written, read = np.concatenate((a_ids, b_ids)), np.concatenate((b_ids, a_ids))
        for rows in tensors:
            rows[written] = rows[read]
        return
    for rows in tensors:
        for a in range(0, len(a_ids), max_rows):
            first, second = a_ids[a : a + max_rows], b_ids[a : a + max_rows]
            held = rows[first]
            rows[first] = rows[second]
            rows[second] = held


def build_host_program(src: np.ndarray, dst: np.ndarray, max_rows: int = 1 << 30) -> HostProgram:
    """Compile pairs (distinct destinations) into runs, at most ``max_rows`` rows each.

    ``max_rows`` lets swaps exchange through a bounded scratch buffer.
    """
    if len(dst) == 0:
        return HostProgram(())
    order = np.argsort(dst, kind="stable")
    src, dst = src[order], dst[order]
    starts, directions = find_runs(src, dst)
    stops = np.append(starts[1:], len(dst))
    segments: list[Segment] = []
    for start, stop, direction in zip(
        starts.tolist(), stops.tolist(), directions.tolist(), strict=True
    ):
        for a in range(start, stop, max_rows):
            length = min(stop, a + max_rows) - a
            first, dst_start = int(src[a]), int(dst[a])
            low = first if direction == 1 else first - length + 1
            segments.append((dst_start, dst_start + length, low, low + length, direction))
    return HostProgram(tuple(segments))


@dataclass(frozen=True)
class DeviceTransferProgram:
    """Host runs of one transfer job and the device rows they pair with.

    ``runs`` are ``(host_start, host_stop, device_start, index_offset)``: the device rows are
    ``device_start ...`` when ``index_offset < 0``, else ``device_index[offset:offset+len]``.
    """

    runs: tuple[tuple[int, int, int, int], ...]
    device_index: torch.Tensor | None

    def store(self, host: torch.Tensor, device: torch.Tensor) -> None:
        """Device rows into host rows, queued on the current stream."""
        for h0, h1, d0, offset in self.runs:
            if offset < 0:
                host[h0:h1].copy_(device[d0 : d0 + h1 - h0], non_blocking=True)
            else:
                assert self.device_index is not None, "gather run without a device index"
                rows = self.device_index[offset : offset + h1 - h0]
                host[h0:h1].copy_(device.index_select(0, rows), non_blocking=True)

    def load(self, host: torch.Tensor, device: torch.Tensor) -> None:
        """Host rows into device rows, queued on the current stream."""
        for h0, h1, d0, offset in self.runs:
            if offset < 0:
                device[d0 : d0 + h1 - h0].copy_(host[h0:h1], non_blocking=True)
            else:
                assert self.device_index is not None, "scatter run without a device index"
                rows = self.device_index[offset : offset + h1 - h0]
                staged = host[h0:h1].to(device.device, non_blocking=True)
                device.index_copy_(0, rows, staged)


def build_device_transfer_program(
    host_ids: np.ndarray, device_ids: np.ndarray, device: torch.device
) -> DeviceTransferProgram:
    """Group pairs by contiguous host rows; move the device index to ``device`` once."""
    count = len(host_ids)
    if count == 0:
        return DeviceTransferProgram((), None)
    if count <= INDEXED_MAX_PAIRS:
        return _small_device_program(host_ids.tolist(), device_ids.tolist(), device)
    order = np.argsort(host_ids, kind="stable")
    host_ids, device_ids = host_ids[order], device_ids[order]
    breaks = np.flatnonzero(np.diff(host_ids) != 1) + 1
    starts = np.concatenate(([0], breaks)).astype(np.int64)
    stops = np.append(starts[1:], count)
    runs: list[tuple[int, int, int, int]] = []
    gathered: list[np.ndarray] = []
    offset = 0
    for a, b in zip(starts.tolist(), stops.tolist(), strict=True):
        rows = device_ids[a:b]
        first = int(rows[0])
        if b - a == 1 or bool(np.all(np.diff(rows) == 1)):
            runs.append((int(host_ids[a]), int(host_ids[a]) + b - a, first, -1))
        else:
            runs.append((int(host_ids[a]), int(host_ids[a]) + b - a, first, offset))
            gathered.append(rows)
            offset += b - a
    index = None
    if gathered:
        index = torch.from_numpy(np.concatenate(gathered)).to(device, non_blocking=True)
    return DeviceTransferProgram(tuple(runs), index)


def _small_device_program(
    host_ids: list[int], device_ids: list[int], device: torch.device
) -> DeviceTransferProgram:
    """``build_device_transfer_program`` for a small job, on Python ints: numpy's per-call
    set-up costs more than the whole job at a few dozen pairs."""
    pairs = sorted(zip(host_ids, device_ids, strict=True), key=lambda pair: pair[0])
    runs: list[tuple[int, int, int, int]] = []
    gathered: list[int] = []
    start = 0
    for i in range(1, len(pairs) + 1):
        if i < len(pairs) and pairs[i][0] == pairs[i - 1][0] + 1:
            continue
        rows = [device for _, device in pairs[start:i]]
        first, host_start = rows[0], pairs[start][0]
        if rows == list(range(first, first + len(rows))):
            runs.append((host_start, host_start + len(rows), first, -1))
        else:
            runs.append((host_start, host_start + len(rows), first, len(gathered)))
            gathered.extend(rows)
        start = i
    if not gathered:
        return DeviceTransferProgram(tuple(runs), None)
    index = torch.tensor(gathered, dtype=torch.int64).to(device, non_blocking=True)
    return DeviceTransferProgram(tuple(runs), index)

"""Per-step series of a replay, written as a picture (PNG or SVG) or as numbers (CSV).

``write_report(path, series, title, config=..., cost=...)`` writes what the file name asks
for: ``.csv`` the raw numbers, ``.png`` or ``.svg`` the report picture drawn by
:mod:`kvlog.present.pictures` (summary figures per policy, then panels sharing the step
axis; the modeled step time with a ``config`` that has a page size, :mod:`kvlog.cost`).
matplotlib is an optional extra (``kvlog[plot]``); without it a picture raises
:class:`kvlog.errors.MissingExtra` naming the extra.
"""

from __future__ import annotations

import csv
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvlog.cost import CostModel
from kvlog.errors import ConfigError
from kvlog.events import CacheConfigured, pair_bytes, swap_mode

__all__ = [
    "PICTURE_FORMATS",
    "Series",
    "report_path",
    "write_csv",
    "write_report",
]

PICTURE_FORMATS = (".png", ".svg")


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


def write_csv(path: str, series: Sequence[Series]) -> None:
    """One row per (series, step)."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(
            [
                "series",
                "step",
                "num_used",
                "max_used",
                "fragmentation",
                "num_swapped",
                "store_bytes",
                "load_bytes",
            ]
        )
        for s in series:
            frag = s.fragmentation
            for i in range(len(s)):
                w.writerow(
                    [
                        s.label,
                        s.step[i],
                        s.num_used[i],
                        s.max_used[i],
                        f"{frag[i]:.6f}",
                        s.num_swapped[i],
                        s.store_bytes[i],
                        s.load_bytes[i],
                    ]
                )


def report_path(path: str, *, flag: str = "--report", log: str | None = None) -> str:
    """The file :func:`write_report` would write for ``path``, checked before any work:
    ``.csv``, ``.png`` or ``.svg`` (no extension: ``.png`` appended), matplotlib present for
    a picture, a directory that exists and is writable, not a directory itself, and not
    the ``log`` being read. Raises :class:`~kvlog.errors.ConfigError` naming ``flag``, or
    :class:`~kvlog.errors.MissingExtra`."""
    if os.path.isdir(path) or path.endswith(os.sep):
        raise ConfigError(flag, path, "a file name, not a directory")
    ext = os.path.splitext(path)[1].lower()
    if ext == "":
        path += ".png"
    elif ext not in (".csv", *PICTURE_FORMATS):
        raise ConfigError(flag, path, "a .csv, .png or .svg file name")
    if not path.lower().endswith(".csv"):
        from kvlog.present.pictures import plt_module

        plt_module("a report picture")
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not os.path.isdir(directory):
        raise ConfigError(flag, path, "a file in an existing directory")
    if not _writable(path, directory):
        raise ConfigError(flag, path, "a file this user may write (on a writable filesystem)")
    if log is not None and os.path.exists(path) and os.path.samefile(path, log):
        raise ConfigError(flag, path, f"a file other than the log {log} it reports on")
    return path


def _writable(path: str, directory: str) -> bool:
    """Whether ``path`` can be written: opened for update if it exists (nothing changes),
    else a temporary file created and removed beside it (read-only filesystems, /proc,
    permissions: what ``os.access`` misses for root)."""
    try:
        if os.path.exists(path):
            with open(path, "r+b"):
                return True
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".kvlog-probe-"):
            return True
    except OSError:
        return False


def write_report(
    path: str,
    series: Sequence[Series],
    title: str = "kvlog replay",
    *,
    config: CacheConfigured | None = None,
    cost: CostModel | None = None,
) -> str:
    """Write the report in the format the file name asks for; returns what was written.

    ``.csv``: numbers; ``.png`` / ``.svg``: the figure (needs ``kvlog[plot]``); a name
    without an extension gets ``.png`` appended; any other extension is refused
    (:func:`report_path`).
    """
    path = report_path(path)
    if path.lower().endswith(".csv"):
        write_csv(path, series)
        return f"wrote CSV {path}"
    from kvlog.present.pictures import write_report_figure

    write_report_figure(path, series, title, config, cost)
    return f"wrote {os.path.splitext(path)[1][1:].upper()} {path}"

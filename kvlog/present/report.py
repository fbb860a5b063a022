"""Per-step series of a replay, written as a picture (PNG or SVG) or as numbers (CSV).

``write_report(path, series, title, config=..., cost=...)`` writes what the file name asks
for: ``.csv`` the raw numbers, ``.png`` or ``.svg`` the report picture drawn by
:mod:`kvlog.present.pictures` (summary figures per policy, then panels sharing the step
axis; the modeled step time with a ``config`` that has a page size, :mod:`kvlog.analysis.cost`).
matplotlib is an optional extra (``kvlog[plot]``); without it a picture raises
:class:`kvlog.errors.MissingExtra` naming the extra.
"""

from __future__ import annotations

import csv
import os
import tempfile
from collections.abc import Sequence

from kvlog.analysis.cost import CostModel
from kvlog.analysis.tally import Series
from kvlog.errors import ConfigError
from kvlog.events import CacheConfigured

__all__ = [
    "PICTURE_FORMATS",
    "report_path",
    "write_csv",
    "write_report",
]

PICTURE_FORMATS = (".png", ".svg")


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

"""Helpers for the log-directory tests (issue 34): small Engine-recorded
directories of many segments, steps that always apply, and damage done to copies."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from kvlog import Engine
from kvlog.events import CacheConfigured, StepScheduled
from kvlog.synth import SynthConfig

__all__ = [
    "CONFIG",
    "copy_dir",
    "edit_manifest",
    "record_dir",
    "segment_files",
    "steps",
    "stored_bytes",
]

CONFIG: CacheConfigured = SynthConfig(num_gpu_blocks=64, num_cpu_blocks=16).cache_config()
"""A small pool: its snapshots are small, so 4 KiB segments hold many records."""


def steps(engine: Engine, count: int) -> None:
    """``count`` scheduler steps that every state of ``CONFIG`` takes: each finishes the
    request of the step before and allocates one block to a new one."""
    start = int(engine.state.step)
    for step in range(start + 1, start + 1 + count):
        finished = [f"r{step - 1}"] if f"r{step - 1}" in engine.state.tables else []
        allocated = {f"r{step}": [step % 60]}
        engine.apply(StepScheduled(step=step, allocated=allocated, finished=finished))


def record_dir(path: Path, count: int = 600, *, close: bool = True, **options: Any) -> Engine:
    """A log directory of ``count`` steps (4 KiB segments unless told), closed cleanly or
    left as a crash would (``close=False``)."""
    options.setdefault("segment_bytes", 4096)
    engine = Engine(CONFIG, path, sync="none", checkpoint_every=16, **options)
    steps(engine, count)
    if close:
        engine.close()
    else:
        engine._log.abandon()  # type: ignore[union-attr]
    return engine


def segment_files(path: Path) -> list[str]:
    """The segment files of a directory, oldest first."""
    return sorted(n for n in os.listdir(path) if n[:1].isdigit())


def stored_bytes(path: Path) -> int:
    return sum((path / n).stat().st_size for n in segment_files(path))


def copy_dir(source: Path, target: Path) -> Path:
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("LOCK"))
    return target


def edit_manifest(path: Path, edit: Any) -> None:
    """Rewrite ``MANIFEST.json`` through ``edit(dict)`` (in place)."""
    manifest = json.loads((path / "MANIFEST.json").read_text())
    edit(manifest)
    (path / "MANIFEST.json").write_text(json.dumps(manifest))

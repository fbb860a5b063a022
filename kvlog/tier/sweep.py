"""``kvlog sweep LOG... --cpu-bytes 4GiB,16GiB --eviction lru,arc,opt``: the CPU tier's
what-ifs over logs (or public traces), on Ray as the defrag policy sweep.

One task per (log, variant): the log's accesses (``trace.py``) run under the variant
(``whatif.py``). Per log, one more task draws its curves: LRU's and the optimum's (store
threshold 0) hit rate at every capacity, each from one stack pass (``optimum.py``).
``sweep.csv`` has one row per (log, variant); ``sweep.png`` one panel per log: hit rate
against host memory, the two curves and the variants as points.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Sequence
from dataclasses import dataclass

from kvlog.analysis.cost import CostModel
from kvlog.errors import ConfigError
from kvlog.synth.traces import TRACE_FORMATS, read_trace
from kvlog.tier.optimum import lru_curve, opt_curve
from kvlog.tier.trace import TierAccess, accesses_from_log, accesses_from_trace
from kvlog.tier.variants import TierVariant
from kvlog.tier.whatif import run_variant
from kvlog.util.units import printable

__all__ = ["TierCurve", "load_accesses", "run_tier_sweep", "tier_grid", "write_tier_csv"]


def tier_grid(
    cpu_bytes: Sequence[int],
    evictions: Sequence[str],
    thresholds: Sequence[int] = (0,),
    tokens_per_chunk: int = 512,
    bytes_per_token: int = 131072,
    keys_per_step: int = 16,
) -> list[TierVariant]:
    """Every (capacity, eviction, threshold); a capacity below one chunk is refused."""
    chunk_bytes = tokens_per_chunk * bytes_per_token
    out = []
    for size in cpu_bytes:
        if size < chunk_bytes:
            raise ConfigError("--cpu-bytes", size, f"at least one chunk ({chunk_bytes} bytes)")
        for eviction in evictions:
            for threshold in thresholds:
                out.append(
                    TierVariant(
                        eviction,
                        size // chunk_bytes,
                        threshold,
                        tokens_per_chunk,
                        chunk_bytes,
                        keys_per_step,
                    )
                )
    return out


def load_accesses(
    source: str, tokens_per_chunk: int = 512, gpu_tokens: int = 0
) -> list[TierAccess]:
    """A public trace (``.jsonl`` Mooncake, ``.csv`` Azure; ``gpu_tokens``: its preemption
    model) or a kvlog log's accesses."""
    ext = os.path.splitext(source)[1].lower()
    if ext in (".jsonl", ".json", ".csv"):
        fmt = "mooncake" if ext != ".csv" else "azure"
        assert fmt in TRACE_FORMATS
        return accesses_from_trace(read_trace(source, fmt), tokens_per_chunk, gpu_tokens)
    return accesses_from_log(source)


def _variant_task(
    source: str, variant: TierVariant, prefill_s_per_token: float, cost: CostModel, gpu_tokens: int
) -> dict[str, object]:
    accesses = load_accesses(source, variant.tokens_per_chunk, gpu_tokens)
    result = run_variant(accesses, variant, prefill_s_per_token, cost)
    return {"log": source, **result.row()}


@dataclass(frozen=True)
class TierCurve:
    """One log's hit rates at every capacity in chunks (index ``c``: ``c`` chunks)."""

    log: str
    chunk_bytes: int
    lru_hit_rate: list[float]
    opt_hit_rate: list[float]
    largest_request: int = 0
    """Chunks of the largest request: below it a request's store may be refused (all or
    none, as vLLM does), LRU's curve is not its replays' and the optimum's bound need not
    hold."""
    largest_batch: int = 0
    """Chunks of the largest store batch (``keys_per_step`` or the largest request, the
    smaller): from it up the optimum's curve equals ``belady`` at every capacity; below it
    ``belady`` refuses whole batches and the curve is not drawn."""


def _curve_task(source: str, variant: TierVariant, max_chunks: int, gpu_tokens: int) -> TierCurve:
    accesses = load_accesses(source, variant.tokens_per_chunk, gpu_tokens)
    asked = max(1, sum(len(a.keys) for a in accesses))
    lru = (lru_curve(accesses, max_chunks) / asked).tolist()
    opt = (opt_curve(accesses, max_chunks, variant.keys_per_step) / asked).tolist()
    largest = max((len(a.keys) for a in accesses), default=0)
    batch = min(variant.keys_per_step, largest)
    return TierCurve(source, variant.chunk_bytes, lru, opt, largest, batch)


def run_tier_sweep(
    logs: Sequence[str],
    variants: Sequence[TierVariant],
    prefill_s_per_token: float,
    cost: CostModel,
    use_ray: bool = True,
    address: str | None = None,
    num_cpus: int | None = None,
    progress: object = None,
    gpu_tokens: int = 0,
) -> tuple[list[dict[str, object]], list[TierCurve]]:
    """Rows (logs outer, variants inner) and one curve per log."""
    from kvlog.analysis.pool import run_all as _run_all

    calls: list[tuple[object, ...]] = [
        (log, v, prefill_s_per_token, cost, gpu_tokens) for log in logs for v in variants
    ]
    max_chunks = max(v.num_chunks for v in variants)
    curve_calls: list[tuple[object, ...]] = [
        (log, variants[0], max_chunks, gpu_tokens) for log in logs
    ]
    rows = _run_all(_variant_task, calls, use_ray, address, num_cpus, progress)  # type: ignore[arg-type]
    curves = _run_all(_curve_task, curve_calls, use_ray, address, num_cpus, None)
    return rows, curves


def write_tier_csv(path: str, rows: Sequence[dict[str, object]]) -> None:
    """One row per (log, variant); the log named as text (:func:`printable`)."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows({**row, "log": printable(str(row["log"]))} for row in rows)

"""Public LLM serving traces as request lists: Mooncake (JSON lines) and Azure (CSV).

``read_trace(path, "mooncake" | "azure", limit=N)`` returns :class:`TraceRequest` s with the
arrival time in seconds from the trace's first request, the input and output lengths in
tokens and, for Mooncake, the ``hash_ids`` of its 512-token blocks:

- Mooncake (kvcache-ai/Mooncake ``FAST25-release/traces``): one JSON object per line with
  ``timestamp`` (ms from the start), ``input_length``, ``output_length`` and ``hash_ids``,
  chained prefix hashes of 512-token blocks (``len(hash_ids) == ceil(input_length / 512)``;
  equal ids mean equal token prefixes up to and including that block).
- Azure (Azure/AzurePublicDataset ``AzureLLMInferenceTrace_*.csv``): a header line
  ``TIMESTAMP,ContextTokens,GeneratedTokens`` and one row per request, the timestamp as
  absolute wall time (``2023-11-16 18:15:46.6805900``); no prefix information.

A row that does not parse raises :class:`kvlog.errors.TraceError` naming the file and line
(as does a Mooncake timestamp that is not a JSON number, or a ``hash_id`` repeated within
one request). Requests come back sorted by arrival, times counted from the earliest.
:func:`block_keys` turns a request into the content keys of its full blocks for a block
size that divides 512 (vLLM caches full blocks only).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import reprlib
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from datetime import datetime

from kvlog.errors import TraceError

__all__ = [
    "HASH_BLOCK_TOKENS",
    "MAX_SECONDS",
    "TRACE_FORMATS",
    "TraceRequest",
    "block_keys",
    "guess_format",
    "read_trace",
]

TRACE_FORMATS: tuple[str, ...] = ("mooncake", "azure")
HASH_BLOCK_TOKENS = 512
"""Tokens per Mooncake ``hash_ids`` entry."""
MAX_SECONDS = 1e12
"""The largest timestamp read, in seconds (31,700 years: past it a number is not a time)."""


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace (``hash_ids`` empty when the trace has no prefix data)."""

    arrival_s: float
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...] = ()


def guess_format(path: str | os.PathLike[str]) -> str:
    """``"mooncake"`` for ``.jsonl``/``.json`` files, ``"azure"`` for ``.csv``."""
    ext = os.path.splitext(os.fspath(path))[1].lower()
    if ext in (".jsonl", ".json"):
        return "mooncake"
    if ext == ".csv":
        return "azure"
    raise TraceError(f"{path}: cannot tell the trace format from {ext!r}; pass --trace-format")


def read_trace(
    path: str | os.PathLike[str], fmt: str | None = None, *, limit: int | None = None
) -> list[TraceRequest]:
    """The first ``limit`` requests (all when None) of the trace at ``path``, in arrival
    order (a stable sort: traces are not always sorted) with times from the earliest."""
    fmt = fmt or guess_format(path)
    if fmt not in TRACE_FORMATS:
        raise TraceError(f"trace format must be one of {list(TRACE_FORMATS)}, got {fmt!r}")
    if limit is not None and limit < 0:
        raise TraceError(f"limit must be >= 0, got {limit}")
    rows = _mooncake(os.fspath(path)) if fmt == "mooncake" else _azure(os.fspath(path))
    out: list[TraceRequest] = []
    for request in rows:
        if limit is not None and len(out) >= limit:
            break
        out.append(request)
    start = min((r.arrival_s for r in out), default=0.0)
    out.sort(key=lambda r: r.arrival_s)
    return [dataclasses.replace(r, arrival_s=r.arrival_s - start) for r in out]


def _open(path: str) -> Iterator[tuple[int, str]]:
    """Numbered lines; a UTF-8 byte order mark is dropped (``utf-8-sig``)."""
    try:
        with open(path, encoding="utf-8-sig") as f:
            yield from enumerate(f, start=1)
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise TraceError(f"{path}: not a text trace: {exc}") from exc


_ROW_ERRORS = (ValueError, KeyError, TypeError, OverflowError, RecursionError)
"""What a malformed row raises while parsed: a 309-digit number overflows a float, deeply
nested JSON recurses too deep."""


def _mooncake(path: str) -> Iterator[TraceRequest]:
    for number, line in _open(path):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            stamp = row["timestamp"]
            if type(stamp) not in (int, float):
                raise TypeError(f"timestamp {stamp!r} is not a number of milliseconds")
            ts = float(stamp) / 1000.0
            request = _checked(ts, row["input_length"], row["output_length"], row["hash_ids"])
        except _ROW_ERRORS as exc:
            raise TraceError(f"{path}:{number}: not a Mooncake trace row: {exc}") from None
        if len(request.hash_ids) != math.ceil(request.input_len / HASH_BLOCK_TOKENS):
            raise TraceError(
                f"{path}:{number}: {len(request.hash_ids)} hash_ids for "
                f"{request.input_len} input tokens (want one per {HASH_BLOCK_TOKENS})"
            )
        if len(set(request.hash_ids)) != len(request.hash_ids):
            raise TraceError(
                f"{path}:{number}: a hash_id repeats within one request: hash_ids are "
                "chained prefix hashes, one per 512-token block, so they never repeat"
            )
        yield request


def _azure(path: str) -> Iterator[TraceRequest]:
    reader = csv.reader(line for _, line in _open(path))
    number = 0
    while True:
        number += 1
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            raise TraceError(f"{path}:{number}: not an Azure trace row: {exc}") from None
        if number == 1 and row and not row[0].strip()[:1].isdigit():
            continue  # the header
        if not row:
            continue
        try:
            stamp, context, generated = row
            ts = _wall_seconds(stamp)
            request = _checked(ts, int(context), int(generated), [])
        except _ROW_ERRORS as exc:
            shown = reprlib.repr(row)  # a 128 KiB field is not repeated whole
            raise TraceError(f"{path}:{number}: not an Azure trace row {shown}: {exc}") from None
        yield request


def _wall_seconds(stamp: str) -> float:
    """Seconds since the epoch (UTC) of ``YYYY-MM-DD HH:MM:SS[.fraction]`` (any digits)."""
    whole, _, fraction = stamp.strip().partition(".")
    moment = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S")
    epoch = (moment - datetime(1970, 1, 1)).total_seconds()
    if fraction and not fraction.isdigit():
        raise ValueError(f"bad fraction of a second {fraction!r}")
    return epoch + (float("0." + fraction) if fraction else 0.0)


def _checked(ts: float, input_len: object, output_len: object, hashes: object) -> TraceRequest:
    if not math.isfinite(ts) or not 0 <= ts <= MAX_SECONDS:
        raise ValueError(f"timestamp {ts} s is not a time in [0, {MAX_SECONDS:g}] s")
    if type(input_len) is not int or type(output_len) is not int:
        raise ValueError("input and output lengths must be integers")
    if input_len < 1 or output_len < 1:
        raise ValueError(f"lengths must be >= 1, got {input_len} and {output_len}")
    if not isinstance(hashes, list) or any(type(h) is not int for h in hashes):
        raise ValueError("hash_ids must be a list of integers")
    return TraceRequest(ts, input_len, output_len, tuple(hashes))


def block_keys(
    request: TraceRequest, serial: int, block_size: int, num_tokens: int
) -> list[Hashable]:
    """Content keys of the full blocks of the first ``num_tokens`` tokens of a request.

    A prompt block covered by ``hash_ids`` is ``(hash_id, k)``: 512-token block ``hash_id``
    holds ``512 // block_size`` blocks ``k = 0, 1, ...``; equal keys mean equal prefixes.
    Every other full block (no prefix data, or holding generated tokens) is
    ``("u", serial, index)``: unique to the request.
    """
    per_hash = HASH_BLOCK_TOKENS // block_size
    keys: list[Hashable] = []
    for i in range(num_tokens // block_size):
        if request.hash_ids and (i + 1) * block_size <= request.input_len:
            keys.append((request.hash_ids[i // per_hash], i % per_hash))
        else:
            keys.append(("u", serial, i))
    return keys

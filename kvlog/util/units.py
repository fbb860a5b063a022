"""Numbers as people read them: byte sizes (one formatter, one parser), counts with their
noun, the p99 of a series, and file names as text. Pure functions with no kvlog imports,
so every layer may use them."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = [
    "MAX_SIZE_BYTES",
    "byte_unit",
    "format_bytes",
    "format_value",
    "p99",
    "parse_size",
    "plural",
    "printable",
    "size_label",
]

_UNITS = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))
_PARSE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
MAX_SIZE_BYTES = 1 << 50
"""The largest size :func:`parse_size` accepts (``CacheConfigured``'s bound on
``max_bytes_per_step``)."""


def byte_unit(largest: float) -> tuple[str, int]:
    """The unit (name, bytes) that keeps ``largest`` readable: MiB up to GiB, and so on."""
    for name, size in _UNITS:
        if largest >= size:
            return name, size
    return "B", 1


def format_bytes(num_bytes: float) -> str:
    """``1.2 GiB``-style, in the unit that keeps the number readable."""
    unit, size = byte_unit(num_bytes)
    return f"{num_bytes / size:,.1f} {unit}" if size > 1 else f"{num_bytes:,.0f} B"


def size_label(num_bytes: int) -> str:
    """An exact compact label: ``512MiB``, ``4GiB``, ``1000B`` (for names, not figures)."""
    for unit, size in _UNITS:
        if num_bytes >= size and num_bytes % size == 0:
            return f"{num_bytes // size}{unit}"
    return f"{num_bytes}B"


def parse_size(text: str) -> int:
    """Bytes from ``4096``, ``64MiB``, ``1G``, ``512k`` (binary units, at most 1 PiB);
    ``ValueError`` naming the text otherwise."""
    raw = text.strip().lower().removesuffix("b").removesuffix("i")
    digits = raw.rstrip("kmgt")
    unit = raw[len(digits) :]
    try:
        value = float(digits)
    except ValueError as exc:
        raise ValueError(f"not a size: {text!r} (e.g. 64MiB)") from exc
    if unit not in _PARSE_UNITS or not 0 <= value * _PARSE_UNITS[unit] <= MAX_SIZE_BYTES:
        raise ValueError(f"not a size: {text!r} (e.g. 64MiB, at most 1PiB)")
    return int(value * _PARSE_UNITS[unit])


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """``1 log``, ``2 logs``, ``1,024 blocks`` (``nouns``: an irregular plural)."""
    return f"{count:,} {noun if count == 1 else nouns or noun + 's'}"


def printable(text: str) -> str:
    """``text`` that encodes as UTF-8: a file name's undecodable bytes (which Python hands
    over as lone surrogates) written as ``\\xff`` escapes, so a figure's title or a CSV cell
    can name any log, two names stay two, and nothing raises UnicodeEncodeError."""
    try:
        raw = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a surrogate no file name decodes to
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return raw.decode("utf-8", "backslashreplace")


def format_value(value: object) -> str:
    """A figure for a table: ints with thousands separators, floats to one decimal."""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        return f"{value:,.1f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def p99(values: Sequence[float]) -> float:
    """The 99th percentile (numpy's ``higher`` method: a value of the series, never an
    interpolation below it); 0.0 for no values."""
    if len(values) == 0:
        return 0.0
    return float(np.percentile(np.asarray(values, dtype=np.float64), 99, method="higher"))

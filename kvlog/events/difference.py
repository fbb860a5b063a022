"""Where two events differ: the fields to name, instead of both events whole."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["differing_fields", "narrowed"]


def differing_fields(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    """The fields (of two events as dicts, ``to_dict``) whose values differ, in ``a``'s
    order then ``b``'s; empty where the types differ (then every field does)."""
    if a.get("type") != b.get("type"):
        return []
    names = [*a, *(n for n in b if n not in a)]
    return [n for n in names if a.get(n) != b.get(n)]


def narrowed(event: Mapping[str, Any], fields: list[str]) -> dict[str, Any]:
    """The event's type and the given fields only (all of it where ``fields`` is empty)."""
    if not fields:
        return dict(event)
    return {"type": event.get("type"), **{n: event.get(n) for n in fields}}

"""One session per KV-cache storage, shared by every facade of a process.

``shared_session`` finds the session of a KV cache by its storage, so an
``OnlineDefragmenter`` and a ``KvlogOffloadingConnector`` worker built over the same tensors
in one process share one Engine (and one log), whichever is built first, with no wiring."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Generic, TypeVar, cast

import torch

from kvlog.errors import LayoutError
from kvlog.executors.layouts import KVCaches

__all__ = ["cache_tensors", "shared_session"]

Session = TypeVar("Session")


def cache_tensors(kv_caches: KVCaches) -> Iterator[torch.Tensor]:
    """Every tensor of a runner's KV caches (a layer's tensor, or each of its tuple)."""
    layers = list(kv_caches.values()) if isinstance(kv_caches, Mapping) else list(kv_caches)
    for layer in layers:
        if isinstance(layer, torch.Tensor):
            yield layer
        elif isinstance(layer, (list, tuple)):
            yield from (t for t in layer if isinstance(t, torch.Tensor))


# -- one session per KV-cache storage, shared by every facade of a process ---------------
class _Entry(Generic[Session]):
    """A live session and the storages of the tensors it was found by. The session keeps
    its executor's views of those storages alive, so a storage pointer cannot be reused
    by another allocation while the session lives."""

    def __init__(self, session: Session, tensors: list[torch.Tensor]) -> None:
        self.session_ref = weakref.ref(session)
        self.pointers = {_storage(t) for t in tensors}


_SESSIONS: list[_Entry[object]] = []


def _storage(tensor: torch.Tensor) -> tuple[str, int]:
    return (str(tensor.device), tensor.untyped_storage().data_ptr())


def shared_session(kv_caches: KVCaches, factory: Callable[[], Session]) -> tuple[Session, bool]:
    """The live session over any of these tensors' storage, or a new one from ``factory``;
    and whether it is new. Sessions no facade holds any more are forgotten."""
    tensors = list(cache_tensors(kv_caches))
    if not tensors:
        raise LayoutError("kv_caches holds no tensor: give at least one layer")
    _SESSIONS[:] = [e for e in _SESSIONS if e.session_ref() is not None]
    pointers = {_storage(t) for t in tensors}
    for entry in _SESSIONS:
        session = entry.session_ref()
        if session is not None and entry.pointers & pointers:
            entry.pointers |= pointers
            return cast(Session, session), False
    session = factory()
    _SESSIONS.append(_Entry(session, tensors))
    return session, True

"""Placeholders that keep a load's destination blocks used until a request claims them.

vLLM allocates a request's blocks, loads into them, and reports the request to the runner
only when it is scheduled, possibly steps after the load ended. Until then the blocks must
count as used, or defrag would move other blocks into them: a placeholder request holds
them (:class:`LoadHolds`). The session decides which blocks need holding (it knows the
books and the state) and applies the events this class returns."""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import NamedTuple

from kvlog.events import HOLD_PREFIX, BlocksAllocated, Event, RequestFinished

__all__ = ["Claims", "LoadHolds"]


class Claims(NamedTuple):
    """What giving blocks to requests does to the placeholders, as one step states it:
    the placeholders that let go (``released``: the step finishes them) and the new ones
    that hold on to the rest of their blocks (``held``: name -> blocks, allocated by the
    step before the requests' blocks); ``renamed``: the rename counter after them."""

    released: list[str]
    held: dict[str, list[int]]
    renamed: int


class LoadHolds:
    """The blocks held for loads, by logical block id, and the events that change them."""

    def __init__(self) -> None:
        self._by_block: dict[int, str] = {}
        self._blocks_of: dict[str, list[int]] = {}
        """Placeholder -> the blocks it holds, in the order it took them (``_by_block``
        inverted, so that a placeholder's blocks cost O(its blocks), not O(all held))."""
        self._renamed = 0
        self.prefix = f"{HOLD_PREFIX}{secrets.token_hex(8)}-"
        """The placeholders' request ids of this session (no client can guess them)."""
        self.by_block: Mapping[int, str] = MappingProxyType(self._by_block)
        """Logical block -> the placeholder request that holds it (read only, live)."""

    def is_placeholder(self, req_id: str) -> bool:
        return req_id.startswith(self.prefix)

    def not_held(self, block_ids: Iterable[int]) -> list[int]:
        return [b for b in block_ids if b not in self._by_block]

    def hold(self, job_id: int, block_ids: list[int]) -> BlocksAllocated:
        """The event that makes the placeholder of load ``job_id`` hold ``block_ids``;
        apply it, then call :meth:`held`."""
        return BlocksAllocated(req_id=f"{self.prefix}{job_id}", block_ids=block_ids)

    def held(self, event: BlocksAllocated) -> None:
        """``event`` (from :meth:`hold` or :meth:`claim`) was applied."""
        self._take(event.req_id, event.block_ids)

    def _take(self, hold_id: str, block_ids: list[int]) -> None:
        """``hold_id`` (a new placeholder) holds ``block_ids`` (none held before)."""
        by_block = self._by_block
        assert hold_id not in self._blocks_of and by_block.keys().isdisjoint(block_ids), (
            "a placeholder or a held block taken twice: holds bug"
        )
        by_block.update(dict.fromkeys(block_ids, hold_id))
        self._blocks_of[hold_id] = list(block_ids)

    def _let_go(self, hold_id: str) -> None:
        """``hold_id`` holds nothing any more."""
        by_block = self._by_block
        for b in self._blocks_of.pop(hold_id):
            del by_block[b]

    def plan(self, given: Iterable[list[int]]) -> Claims:
        """The placeholders the blocks ``given`` now (one list per request) take over,
        all at once, changing nothing: O(blocks given) when no placeholder holds any of
        them; :meth:`claimed` keeps it once the step that states it is accepted."""
        by_block = self._by_block
        if not by_block or all(by_block.keys().isdisjoint(ids) for ids in given):
            return Claims([], {}, self._renamed)
        wanted = {b for ids in given for b in ids if b in by_block}
        released = sorted({by_block[b] for b in wanted})
        held: dict[str, list[int]] = {}
        renamed = self._renamed
        for hold_id in released:
            rest = self._rest(hold_id, wanted)
            if rest:
                renamed += 1
                held[f"{hold_id}.{renamed}"] = rest
        return Claims(released, held, renamed)

    def claimed(self, claims: Claims) -> None:
        """The step stating ``claims`` (from :meth:`plan`, nothing held or claimed since)
        was accepted: the placeholders are as it leaves them."""
        if not claims.released:
            return
        for hold_id in claims.released:
            self._let_go(hold_id)
        for hold_id, block_ids in claims.held.items():
            self._take(hold_id, block_ids)
        self._renamed = claims.renamed

    def _rest(self, hold_id: str, wanted: set[int]) -> list[int]:
        return [b for b in self._blocks_of[hold_id] if b not in wanted]

    def claim(self, block_ids: Iterable[int]) -> list[Event]:
        """A request is being given these blocks: the events that make the placeholders
        holding any of them let go, and hold on to the rest of their blocks under a new
        name. Apply them in order, calling :meth:`held` after each ``BlocksAllocated``."""
        if not self._by_block:
            return []
        wanted = set(block_ids)
        events: list[Event] = []
        for hold_id in sorted({self._by_block[b] for b in wanted if b in self._by_block}):
            rest = self._rest(hold_id, wanted)
            events.append(RequestFinished(req_id=hold_id))
            self._let_go(hold_id)
            if rest:
                self._renamed += 1
                events.append(BlocksAllocated(req_id=f"{hold_id}.{self._renamed}", block_ids=rest))
        return events

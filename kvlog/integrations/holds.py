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

from kvlog.events import HOLD_PREFIX, BlocksAllocated, Event, RequestFinished

__all__ = ["LoadHolds"]


class LoadHolds:
    """The blocks held for loads, by logical block id, and the events that change them."""

    def __init__(self) -> None:
        self._by_block: dict[int, str] = {}
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
        self._by_block.update(dict.fromkeys(event.block_ids, event.req_id))

    def claim(self, block_ids: Iterable[int]) -> list[Event]:
        """A request is being given these blocks: the events that make the placeholders
        holding any of them let go, and hold on to the rest of their blocks under a new
        name. Apply them in order, calling :meth:`held` after each ``BlocksAllocated``."""
        if not self._by_block:
            return []
        wanted = set(block_ids)
        events: list[Event] = []
        for hold_id in sorted({self._by_block[b] for b in wanted if b in self._by_block}):
            rest = [b for b, h in self._by_block.items() if h == hold_id and b not in wanted]
            events.append(RequestFinished(req_id=hold_id))
            for b in [b for b, h in self._by_block.items() if h == hold_id]:
                del self._by_block[b]
            if rest:
                self._renamed += 1
                events.append(BlocksAllocated(req_id=f"{hold_id}.{self._renamed}", block_ids=rest))
        return events

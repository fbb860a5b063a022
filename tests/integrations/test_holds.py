"""``LoadHolds`` against a plain model: the blocks held for loads, by placeholder.

The model keeps one dict (block -> placeholder, in the order the blocks were taken) and
finds a placeholder's blocks by scanning all of it, as the first version of ``LoadHolds``
did. ``LoadHolds`` keeps each placeholder's blocks too, so that a step's claims cost the
placeholders' blocks, not every held block. A hypothesis state machine holds loads' blocks,
plans and accepts whole steps' claims (``plan`` + ``claimed``), and claims blocks one
request at a time (``claim``): the claims, the events and the held blocks (their order
included) must be the model's.
"""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvlog.events import BlocksAllocated, Event, RequestFinished
from kvlog.integrations.holds import Claims, LoadHolds

BLOCKS = 40


class PlainHolds:
    """The model: one dict, scanned whole for each placeholder's blocks."""

    def __init__(self, prefix: str) -> None:
        self.by_block: dict[int, str] = {}
        self.renamed = 0
        self.prefix = prefix

    def rest(self, hold_id: str, wanted: set[int]) -> list[int]:
        return [b for b, h in self.by_block.items() if h == hold_id and b not in wanted]

    def plan(self, given: list[list[int]]) -> Claims:
        wanted = {b for ids in given for b in ids if b in self.by_block}
        released = sorted({self.by_block[b] for b in wanted})
        held, renamed = {}, self.renamed
        for hold_id in released:
            rest = self.rest(hold_id, wanted)
            if rest:
                renamed += 1
                held[f"{hold_id}.{renamed}"] = rest
        return Claims(released, held, renamed)

    def claimed(self, claims: Claims) -> None:
        gone = set(claims.released)
        for b in [b for b, h in self.by_block.items() if h in gone]:
            del self.by_block[b]
        for hold_id, block_ids in claims.held.items():
            self.by_block.update(dict.fromkeys(block_ids, hold_id))
        self.renamed = claims.renamed

    def claim(self, block_ids: list[int]) -> list[Event]:
        wanted = set(block_ids)
        events: list[Event] = []
        for hold_id in sorted({self.by_block[b] for b in wanted if b in self.by_block}):
            rest = self.rest(hold_id, wanted)
            events.append(RequestFinished(req_id=hold_id))
            for b in [b for b, h in self.by_block.items() if h == hold_id]:
                del self.by_block[b]
            if rest:
                self.renamed += 1
                name = f"{hold_id}.{self.renamed}"
                events.append(BlocksAllocated(req_id=name, block_ids=rest))
                self.by_block.update(dict.fromkeys(rest, name))
        return events


class HoldsMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.holds = LoadHolds()
        self.model = PlainHolds(self.holds.prefix)
        self.job = 0

    @rule(data=st.data())
    def hold_a_load(self, data: st.DataObject) -> None:
        free = [b for b in range(BLOCKS) if b not in self.model.by_block]
        if not free:
            return
        blocks = data.draw(st.lists(st.sampled_from(free), min_size=1, max_size=6, unique=True))
        assert self.holds.not_held(blocks) == blocks
        self.job += 1
        event = self.holds.hold(self.job, blocks)
        self.holds.held(event)
        self.model.by_block.update(dict.fromkeys(blocks, event.req_id))

    @precondition(lambda self: self.model.by_block)
    @rule(data=st.data())
    def a_step_claims(self, data: st.DataObject) -> None:
        ids = st.integers(0, BLOCKS - 1)
        given = data.draw(st.lists(st.lists(ids, max_size=5, unique=True), max_size=3))
        claims = self.holds.plan(given)
        assert claims == self.model.plan(given)
        if data.draw(st.booleans()):  # the step was accepted
            self.holds.claimed(claims)
            self.model.claimed(claims)

    @precondition(lambda self: self.model.by_block)
    @rule(blocks=st.lists(st.integers(0, BLOCKS - 1), max_size=6, unique=True))
    def a_request_claims(self, blocks: list[int]) -> None:
        events = self.holds.claim(blocks)
        assert events == self.model.claim(blocks)
        for event in events:
            if isinstance(event, BlocksAllocated):
                self.holds.held(event)

    @invariant()
    def the_same_blocks_are_held(self) -> None:
        assert list(self.holds.by_block.items()) == list(self.model.by_block.items())


TestHolds = HoldsMachine.TestCase


def test_a_claim_reads_only_the_placeholders_it_names() -> None:
    """With a thousand placeholders holding blocks, a step that takes one placeholder's
    block reads that placeholder's blocks: its rest is held again under a new name."""
    holds = LoadHolds()
    for job in range(1000):
        holds.held(holds.hold(job, [2 * job, 2 * job + 1]))
    claims = holds.plan([[1500]])
    assert claims.released == [f"{holds.prefix}750"]
    assert claims.held == {f"{holds.prefix}750.1": [1501]}
    holds.claimed(claims)
    assert holds.by_block[1501] == f"{holds.prefix}750.1" and 1500 not in holds.by_block
    assert len(holds.by_block) == 1999

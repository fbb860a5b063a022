"""The request tables' arena (``reducers/arena.py``): regions that move, garbage that is
packed away, and a whole step's commit that must make room first, against plain lists."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvlog import reducers
from kvlog.events import CacheConfigured, StepScheduled
from kvlog.reducers.arena import TableArena
from kvlog.reducers.checkpoint import recompute

_OPS = st.lists(
    st.tuples(
        st.sampled_from(["append", "close", "reserve"]),
        st.integers(0, 7),
        st.lists(st.integers(0, 2**31 - 1), max_size=40),
    ),
    max_size=120,
)


@settings(max_examples=150, deadline=None)
@given(_OPS)
def test_the_arena_holds_what_plain_lists_hold(ops: list[tuple[str, int, list[int]]]) -> None:
    arena, model = TableArena(8), {row: [] for row in range(8)}
    for op, row, ids in ops:
        if op == "append":
            arena.append(row, ids)
            model[row] += ids
        elif op == "close":
            arena.close(row)
            model[row] = []
        else:
            arena.reserve(len(ids) * 300)  # may pack the live regions into a new arena
        assert all(arena.table(r) == model[r] for r in model)
        live = sum(int(arena.capacities[r]) for r in model)
        assert arena.top - arena.garbage == live, "garbage drifted from the live regions"
        assert arena.top <= arena.ids.size


def test_a_step_larger_than_the_arena_makes_room_first() -> None:
    """A step whose new tables need more than the arena has left: the commit packs and
    grows the arena, then applies (the kernel refuses to start without room)."""
    state = reducers.initial_state()
    reducers.reduce(state, CacheConfigured(num_gpu_blocks=1 << 15, block_size=16))
    first = {f"r{i}": list(range(i * 700, (i + 1) * 700)) for i in range(10)}  # 7,000 ids
    reducers.reduce(state, StepScheduled(step=0, allocated=first, finished=[]))
    second = {f"s{i}": list(range(7000 + i * 900, 7000 + (i + 1) * 900)) for i in range(12)}
    second["r3"] = [20000, 20001]
    reducers.reduce(state, StepScheduled(step=1, allocated=second, finished=["r1", "r2"]))
    expected = {r: t for r, t in first.items() if r not in ("r1", "r2")}
    expected["r3"] = first["r3"] + [20000, 20001]
    expected.update({r: t for r, t in second.items() if r != "r3"})
    assert dict(state.tables) == expected
    _, tables_sum, _, _ = recompute(state)
    assert state.running.tables == tables_sum

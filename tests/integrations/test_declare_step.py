"""``OffloadingWorker.declare_step``: a step's load holds applied before its declarations
end where the calls one by one end (the same state, digest included), and refuse what
they refuse."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from kvlog.errors import KvlogError
from kvlog.integrations import OffloadingWorker, OnlineDefragmenter
from kvlog.integrations.offload import DeclaredJob
from tests.support.seed_reference import make_hpu_caches

BS = 4
LIVE = {"a": [1, 2, 3, 4, 5, 6], "b": [7, 8, 9, 10]}


@st.composite
def steps(draw: st.DrawFn) -> list[DeclaredJob]:
    """A step's jobs in job-id order: stores reading any blocks (live, free, a load's),
    loads into free blocks or a live request's (a stale holder to release), CPU blocks
    disjoint across jobs, now and then a load into a block another load of the step writes
    or a block id outside the pool (refused either way)."""
    jobs: list[DeclaredJob] = []
    cpu = 0
    for job_id in range(draw(st.integers(1, 5))):
        n = draw(st.integers(1, 3))
        gpu = draw(st.lists(st.integers(1, 30), min_size=n, max_size=n, unique=True))
        if draw(st.integers(0, 19)) == 0:
            gpu[0] = 99  # outside the 64-block pool
        cpus = list(range(cpu, cpu + n))
        cpu += n
        if draw(st.booleans()):
            req = draw(st.sampled_from(["a", "b"]))
            jobs.append(("store", job_id, gpu, cpus, req, None))
        else:
            req = draw(st.sampled_from(["a", "b", "n1", "n2"]))
            sync = draw(st.sampled_from([None, True, False]))
            jobs.append(("load", job_id, cpus, gpu, req, sync))
    return jobs


def _run(jobs: list[DeclaredJob], first: bool, prefix_caching: bool) -> tuple[Any, ...]:
    defrag = OnlineDefragmenter(
        environ={"VLLM_DEFRAG_THRESHOLD": "4"}, backend="fake", prefix_caching=prefix_caching
    )
    defrag.initialize(make_hpu_caches(64, BS), BS)
    worker = OffloadingWorker(defrag, num_cpu_blocks=32, quarantine=True)
    defrag.session.holds.prefix = "hold-test-"  # both runs name their placeholders alike
    defrag.update_state({r: list(b) for r, b in LIVE.items()}, [])
    defrag.defragment()
    refused: type[BaseException] | None = None
    try:
        with worker.batched():
            if first:
                worker.declare_step(jobs)
            else:  # the calls one by one, each load's hold right before its declaration
                for job in jobs:
                    worker.declare(*job)
    except KvlogError as exc:
        refused = type(exc)
    if refused is not None:
        return (refused,)
    engine = defrag.session.engine
    return engine.digest(), defrag.session.held_blocks, defrag.req_blocks, refused


@given(steps(), st.booleans())
def test_holding_a_steps_loads_first_ends_where_the_calls_one_by_one_end(
    jobs: list[DeclaredJob], prefix_caching: bool
) -> None:
    assert _run(jobs, True, prefix_caching) == _run(jobs, False, prefix_caching)

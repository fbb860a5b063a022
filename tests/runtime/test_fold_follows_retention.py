"""A fold seated on a state and read on later (a live view polling a log directory) follows
retention: where the writer's retention removed the records it would read next, it goes on
from the snapshot opening the oldest segment left, never applies later events to its stale
state, and ends in the writer's own state."""

from __future__ import annotations

import random
from pathlib import Path

from kvlog import Engine, events
from kvlog.present.top import LogWatch
from kvlog.reducers import checkpoint

CONFIG = events.CacheConfigured(
    num_gpu_blocks=512, block_size=16, page_size_bytes=4096, threshold=4
)


def _steps(engine: Engine, rng: random.Random, live: dict[str, list[int]], first: int) -> int:
    """200 scheduler steps of random arrivals and finishes; the next step number."""
    step = first
    for step in range(first, first + 200):
        if live and rng.random() < 0.3:
            req = rng.choice(sorted(live))
            engine.apply(events.RequestFinished(req))
            del live[req]
        free = sorted(set(range(1, 512)) - {b for v in live.values() for b in v})
        if len(free) > 8:
            req = f"r{step}"
            live[req] = rng.sample(free, 4)
            engine.apply(events.BlocksAllocated(req, live[req]))
        engine.apply(events.StepEnded(step))
    return step + 1


def test_a_polling_view_goes_on_past_what_retention_removed(tmp_path: Path) -> None:
    rng, live = random.Random(0), {}
    path = str(tmp_path / "live") + "/"
    with Engine(CONFIG, path, sync="none", segment_bytes=8192, retain_bytes=40_000) as engine:
        step = _steps(engine, rng, live, 0)
        watch = LogWatch(path)
        watch.poll()
        for _ in range(12):  # between two polls retention removes what the view had not read
            step = _steps(engine, rng, live, step)
            watch.poll()
        assert watch.recorder.resyncs == 0  # no event was refused by the view's state
        assert watch.recorder.retired > 0  # the case this test is about did happen
        expected = engine.running_digest()
    watch.poll()  # the writer closed: everything it wrote is there to read
    assert checkpoint.checkpoint_digest(watch.lane.machine.state) == expected

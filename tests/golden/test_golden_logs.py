"""Golden logs: the recorded logs in replays/ replay to their recorded digests and plans."""

from __future__ import annotations

import json
import os
import sys

import pytest

from kvlog import replay

HERE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "replays"
)
with open(os.path.join(HERE, "digests.json"), encoding="utf-8") as _f:
    EXPECTED: dict[str, dict[str, object]] = json.load(_f)
sys.path.insert(0, HERE)
from regenerate import plans_sha256  # noqa: E402


def test_every_golden_log_has_expectations() -> None:
    logs = sorted(f for f in os.listdir(HERE) if f.endswith(".kvlog"))
    assert logs == sorted(EXPECTED)
    assert sum(os.path.getsize(os.path.join(HERE, f)) for f in logs) < 400_000


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_golden_log_replays_to_its_digest(name: str) -> None:
    path = os.path.join(HERE, name)
    expected = EXPECTED[name]
    result = replay(path)
    assert result.divergence is None, result.divergence
    assert result.num_verified == result.num_checkpoints == expected["num_checkpoints"]
    assert result.final_digest == expected["final_digest"]
    assert result.num_records == expected["num_records"]
    assert result.num_events == expected["num_events"]
    assert result.counts == expected["counts"]
    assert plans_sha256(path) == expected["plans_sha256"]
    assert replay(path, from_snapshot=True).final_digest == expected["final_digest"]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_golden_log_plans_keep_every_block_its_bytes(name: str) -> None:
    result = replay(os.path.join(HERE, name), execute=True, series=False)
    assert result.canary is not None and result.canary.num_checked > 50
    assert result.canary.ok, result.canary.failures

"""The fault campaigns of ``fuzz/campaign.py`` at CI size (flips, overwrites, truncation,
zeroed ranges, SIGKILL, two writers, a large pool); the full size runs as
``python fuzz/campaign.py all``.

Each campaign asserts what it must hold itself; here we also check that it looked at
what it should: both logs, every outcome it is meant to meet.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.campaign import campaign


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, object]:
    tmp = tmp_path_factory.mktemp("campaign-logs")
    return {
        closed: campaign.build_log(tmp / f"{closed}.kvlog", steps=30, closed=closed)
        for closed in (True, False)
    }


@pytest.mark.parametrize("closed", [True, False], ids=["closed", "crashed"])
def test_flips_and_overwrites(tmp_path: Path, logs: dict[bool, object], closed: bool) -> None:
    counts = campaign.flip_campaign(tmp_path, logs[closed], stride=11, writer_every=20)
    assert counts.get("accepted", 0) == 0 and counts.get("misread", 0) == 0
    assert counts["refused-at-frame"] > 100 and counts["refused-header"] > 10
    assert counts.get("refused-before-frame", 0) == 0  # a flip is named at its own frame
    assert ("torn" in counts) != closed  # only a crashed log may end torn, in its last record


@pytest.mark.parametrize("closed", [True, False], ids=["closed", "crashed"])
def test_truncation(tmp_path: Path, logs: dict[bool, object], closed: bool) -> None:
    counts = campaign.truncate_campaign(tmp_path, logs[closed], stride=23, writer_every=5)
    if closed:
        assert set(counts) == {"refused"}
    else:
        assert counts["recovered"] > 100


@pytest.mark.parametrize("closed", [True, False], ids=["closed", "crashed"])
def test_zeroed_ranges(tmp_path: Path, logs: dict[bool, object], closed: bool) -> None:
    counts = campaign.zero_campaign(tmp_path, logs[closed], lengths=(1, 16, 4096), min_step=29)
    assert counts["refused-at-frame"] > 50 and counts.get("accepted", 0) == 0


def test_sigkill_loses_no_synced_record(tmp_path: Path) -> None:
    figures = campaign.kill_campaign(tmp_path, kills=15)
    assert sum(v["kills"] for v in figures.values()) == 15
    assert all(v["durable_reported"] > 0 for v in figures.values())


def test_two_writers_exactly_one_wins(tmp_path: Path) -> None:
    """Old code let both win (on different inodes) in 8 of 30 trials on a touched file."""
    figures = campaign.writers_campaign(tmp_path, trials=25)
    assert figures["touched_empty"]["one_winner"] == 25


def test_a_large_pool_round_trip(tmp_path: Path) -> None:
    figures = campaign.pool_one(300_000, tmp_path)
    assert figures["log_bytes"] > 0 and figures["replay_from_snapshot"]["s"] >= 0

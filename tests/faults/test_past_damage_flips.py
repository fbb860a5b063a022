"""A byte flipped anywhere in a log's records: salvage past damage yields only the log's own
records (a checkpoint at most without its snapshot, never with a wrong one), at least the
prefix plain salvage gives, and its replay never diverges."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvlog.log.writer as writer_module
from kvlog import Engine, replay
from kvlog.events import Checkpoint, Record
from kvlog.log import LogReader
from kvlog.log.format import read_header_info
from kvlog.synth import SynthConfig, SynthRun


@pytest.fixture(scope="module")
def original(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, int, dict[int, Record]]:
    """A small log whose snapshots are written in parts: (its bytes, where its records
    start, its records by seq)."""
    path = tmp_path_factory.mktemp("flips") / "parts.kvlog"
    config = SynthConfig(steps=150, seed=3)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(writer_module, "SNAPSHOT_PART_BYTES", 700)
        with Engine(config.cache_config(), path, checkpoint_every=16, snapshot_every=2) as run:
            SynthRun(config, run, None).run()
    with open(path, "rb") as file:
        start = read_header_info(file, str(path)).data_offset
    records = dict(LogReader(path).records())
    assert sum(1 for r in records.values() if isinstance(r, Checkpoint) and r.snapshot) >= 3
    return path.read_bytes(), start, records


def same_or_without_snapshot(got: Record, want: Record) -> bool:
    if got == want:
        return True
    return (
        isinstance(got, Checkpoint)
        and isinstance(want, Checkpoint)
        and got.snapshot == b""
        and msgspec.structs.replace(want, snapshot=b"") == got
    )


@given(st.data())
def test_a_flip_anywhere_yields_only_the_logs_own_records(
    original: tuple[bytes, int, dict[int, Record]],
    tmp_path_factory: pytest.TempPathFactory,
    data: st.DataObject,
) -> None:
    blob, start, records = original
    where = data.draw(st.integers(start, len(blob) - 1), label="offset")
    bit = data.draw(st.integers(0, 7), label="bit")
    damaged = bytearray(blob)
    damaged[where] ^= 1 << bit
    path = tmp_path_factory.mktemp("flip") / "flipped.kvlog"
    path.write_bytes(bytes(damaged))
    prefix = [seq for seq, _ in LogReader(path, salvage=True).records()]
    reader = LogReader(path, salvage=True, past_damage=True)
    got = list(reader.records())
    assert [seq for seq, _ in got][: len(prefix)] == prefix
    for seq, record in got:
        assert same_or_without_snapshot(record, records[seq]), seq
    not_read = {s for d in reader.damaged for s in range(d.first_seq, d.resume_seq)}
    assert not not_read & {seq for seq, _ in got}
    result = replay(path, salvage=True, past_damage=True)
    assert result.divergence is None, result.divergence

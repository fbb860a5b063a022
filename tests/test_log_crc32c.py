"""CRC-32C: the check value, the package against the fallback, continuation."""

from __future__ import annotations

import importlib
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path

import crc32c as crc32c_package
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvlog.crc32c
from kvlog.crc32c import crc32c, crc32c_fallback
from kvlog.events import BlocksAllocated, StepEnded
from kvlog.log import LogReader, LogWriter

CHECK_INPUT = b"123456789"
CHECK_VALUE = 0xE3069283  # the standard CRC-32C check value


def test_check_value() -> None:
    assert crc32c(CHECK_INPUT) == CHECK_VALUE
    assert crc32c_fallback(CHECK_INPUT) == CHECK_VALUE
    assert crc32c_package.crc32c(CHECK_INPUT) == CHECK_VALUE
    assert zlib.crc32(CHECK_INPUT) != CHECK_VALUE  # a different polynomial: never use it


def test_known_vectors() -> None:
    # RFC 3720 (iSCSI) B.4 test patterns.
    assert crc32c_fallback(bytes(32)) == 0x8A9136AA
    assert crc32c_fallback(b"\xff" * 32) == 0x62A8AB43
    assert crc32c_fallback(bytes(range(32))) == 0x46DD794E
    assert crc32c_fallback(bytes(range(31, -1, -1))) == 0x113FDB5C
    assert crc32c_fallback(b"") == 0


@pytest.mark.parametrize("size", [0, 1, 7, 255, 511, 512, 513, 1023, 4096, 65537, 300_001])
def test_fallback_matches_package_at_lane_edges(size: int) -> None:
    data = bytes((i * 131 + size) % 251 for i in range(size))
    for value in (0, 1, 0xFFFFFFFF, 0x12345678):
        assert crc32c_fallback(data, value) == crc32c_package.crc32c(data, value)


@given(st.binary(max_size=3000), st.integers(0, 0xFFFFFFFF))
def test_fallback_matches_package(data: bytes, value: int) -> None:
    assert crc32c_fallback(data, value) == crc32c_package.crc32c(data, value)
    assert crc32c_fallback(memoryview(data), value) == crc32c(bytearray(data), value)


@given(st.binary(max_size=2000), st.binary(max_size=2000))
def test_continuation(first: bytes, second: bytes) -> None:
    assert crc32c(second, crc32c(first)) == crc32c(first + second)
    assert crc32c_fallback(second, crc32c_fallback(first)) == crc32c_fallback(first + second)


@pytest.fixture()
def without_package(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Reload kvlog.crc32c as if the crc32c package were not installed."""
    monkeypatch.setitem(sys.modules, "crc32c", None)  # makes `import crc32c` fail
    importlib.reload(kvlog.crc32c)
    try:
        yield
    finally:
        monkeypatch.undo()
        importlib.reload(kvlog.crc32c)
        assert kvlog.crc32c.NATIVE


def test_without_package_logs_stay_compatible(
    without_package: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert not kvlog.crc32c.NATIVE
    assert kvlog.crc32c.crc32c(CHECK_INPUT) == CHECK_VALUE
    path = tmp_path / "fallback.kvlog"
    records = [BlocksAllocated("r", list(range(400))), StepEnded(0)]
    calls: list[int] = []
    fallback = kvlog.crc32c.crc32c
    assert fallback is kvlog.crc32c.crc32c_fallback

    def counting_fallback(data: bytes, value: int = 0) -> int:
        calls.append(len(data))
        return fallback(data, value)

    monkeypatch.setattr(kvlog.crc32c, "crc32c", counting_fallback)
    with LogWriter(path) as writer:  # framed with the fallback
        for record in records:
            writer.append(record)
    assert len(calls) >= 2 * len(records)  # frame head and payload of each record
    monkeypatch.undo()
    importlib.reload(kvlog.crc32c)  # back to the package: the same checksums
    assert kvlog.crc32c.NATIVE
    assert [record for _, record in LogReader(path)] == records

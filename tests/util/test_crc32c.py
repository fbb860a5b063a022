"""CRC-32C: the check value, known vectors, continuation, and the log's use of it."""

from __future__ import annotations

import zlib

import crc32c as crc32c_package
from hypothesis import given
from hypothesis import strategies as st

from kvlog.util.crc32c import crc32c

CHECK_INPUT = b"123456789"
CHECK_VALUE = 0xE3069283  # the standard CRC-32C check value


def test_is_the_package() -> None:
    assert crc32c is crc32c_package.crc32c  # no wrapper on the hot path


def test_check_value() -> None:
    assert crc32c(CHECK_INPUT) == CHECK_VALUE
    assert zlib.crc32(CHECK_INPUT) != CHECK_VALUE  # a different polynomial: never use it


def test_known_vectors() -> None:
    # RFC 3720 (iSCSI) B.4 test patterns.
    assert crc32c(bytes(32)) == 0x8A9136AA
    assert crc32c(b"\xff" * 32) == 0x62A8AB43
    assert crc32c(bytes(range(32))) == 0x46DD794E
    assert crc32c(bytes(range(31, -1, -1))) == 0x113FDB5C
    assert crc32c(b"") == 0
    assert crc32c(b"The quick brown fox jumps over the lazy dog") == 0x22620404


def test_known_vectors_in_pieces() -> None:
    # The same vectors through the running-checksum argument, split at every offset.
    for data, expected in ((CHECK_INPUT, CHECK_VALUE), (bytes(range(32)), 0x46DD794E)):
        for cut in range(len(data) + 1):
            assert crc32c(data[cut:], crc32c(data[:cut])) == expected


@given(st.binary(max_size=3000), st.integers(0, 0xFFFFFFFF))
def test_buffer_types_agree(data: bytes, value: int) -> None:
    expected = crc32c(data, value)
    assert crc32c(memoryview(data), value) == expected
    assert crc32c(bytearray(data), value) == expected


@given(st.binary(max_size=2000), st.binary(max_size=2000))
def test_continuation(first: bytes, second: bytes) -> None:
    assert crc32c(second, crc32c(first)) == crc32c(first + second)

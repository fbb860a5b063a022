"""Atheris fuzz target for the log reader and the event decoder (not run in CI).

    pip install atheris
    python fuzz/fuzz_log_reader.py -max_total_time=600 [corpus_dir]

Each input is written as a log file and read back with ``kvlog.log.LogReader`` and
``kvlog.analysis.replay``; half the inputs are put behind a valid header, so the fuzzer reaches the
record frames quickly. Arbitrary bytes must never raise anything but kvlog's own errors
(``KvlogError``); the event decoder alone may raise ``msgspec.DecodeError``, which the log
layer wraps into ``CorruptLogError``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile

import atheris

with atheris.instrument_imports():
    import msgspec

    from kvlog import replay
    from kvlog.errors import KvlogError
    from kvlog.events import decode
    from kvlog.log import LogReader, LogWriter

_TMP = tempfile.mkdtemp(prefix="kvlog-atheris-")
_PATH = os.path.join(_TMP, "input.kvlog")


def _valid_header() -> bytes:
    path = os.path.join(_TMP, "header.kvlog")
    LogWriter(path, sync="none").abandon()  # the header alone: close() adds a LogEnd
    with open(path, "rb") as file:
        return file.read()


_HEADER = _valid_header()


def one_input(data: bytes) -> None:
    with contextlib.suppress(msgspec.DecodeError):
        decode(data)
    body = data[1:] if data[:1] == b"\x00" else data
    with open(_PATH, "wb") as file:
        file.write(_HEADER + body if data[:1] == b"\x00" else body)
    try:
        for _ in LogReader(_PATH).records():
            pass
        replay(_PATH)
    except KvlogError:
        pass


def main() -> None:
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()

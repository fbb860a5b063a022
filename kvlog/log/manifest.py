"""The manifest of a segmented log: which segments a log directory holds, and what each is.

A segmented log is a directory of segment files, each a whole kvlog log file (header,
CRC-framed records) whose header ``meta`` holds ``SEQ_BASE_KEY``, the sequence number of its
first record in the whole log. A segment file is named after that number,
``{first_seq:016d}.kvlog``, and ``.kvlog.zst`` once sealed and compressed (zstd, through the
``zstandard`` package). ``MANIFEST.json`` lists them in order::

    {"version": 1, "segments": [{"name": ..., "first_seq": ..., "last_seq": ...,
      "num_bytes": ..., "sha256": ..., "compressed": ..., "snapshot_seq": ...,
      "snapshot_offset": ..., "sealed_at_s": ...}, ...]}

A sealed segment (``last_seq >= 0``) is immutable: its ``sha256`` covers the file as stored.
``snapshot_seq`` / ``snapshot_offset`` locate the latest checkpoint with a snapshot in the
segment (its first frame's byte offset in the uncompressed file), so the latest snapshot of
a whole log is found from the manifest in O(segments). The manifest is replaced atomically
(a temporary file, fsynced, renamed over it, the directory fsynced). It is an index, never
the only copy of anything: without it (or with a damaged one) the segments are found by
their names, and every hint it gives is checked against the segment's own records.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import tempfile
from collections.abc import Iterator
from typing import Any

import msgspec

from kvlog.errors import CorruptLogError, MissingExtra
from kvlog.events.codec import DECODE_ERRORS

__all__ = [
    "MANIFEST_NAME",
    "Manifest",
    "SegmentInfo",
    "compress_file",
    "file_sha256",
    "fsync_directory",
    "is_log_directory",
    "list_segments",
    "log_num_bytes",
    "open_segment",
    "read_manifest",
    "remove_file",
    "segment_name",
    "write_manifest",
    "zstandard",
]

MANIFEST_NAME = "MANIFEST.json"
MANIFEST_VERSION = 1
_SEGMENT_RE = re.compile(r"^(\d{16})\.kvlog(\.zst)?$")
_HASH_CHUNK_BYTES = 1 << 20


class SegmentInfo(msgspec.Struct, frozen=True):
    """One segment as the manifest knows it (see the module docstring)."""

    name: str
    first_seq: int
    last_seq: int = -1
    """The last record's sequence number once sealed; -1 while the segment is open."""
    num_bytes: int = 0
    sha256: str = ""
    compressed: bool = False
    snapshot_seq: int = -1
    snapshot_offset: int = -1
    sealed_at_s: float = 0.0

    @property
    def sealed(self) -> bool:
        return self.last_seq >= 0


class Manifest(msgspec.Struct):
    """The segments of a log directory, oldest first."""

    segments: list[SegmentInfo] = msgspec.field(default_factory=list)
    version: int = MANIFEST_VERSION


_decoder = msgspec.json.Decoder(Manifest)


def segment_name(first_seq: int, compressed: bool = False) -> str:
    """The file name of the segment whose first record is ``first_seq``."""
    return f"{first_seq:016d}.kvlog" + (".zst" if compressed else "")


def is_log_directory(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` names a segmented log (an existing directory, or a path ending in
    a separator: ``KVLOG_PATH=/var/log/kvlog/``)."""
    text = os.fspath(path)
    return os.path.isdir(text) or text.endswith(os.sep) or text.endswith("/")


_UNREADABLE: tuple[type[Exception], ...] = (OSError, *DECODE_ERRORS)


def read_manifest(directory: str) -> Manifest | None:
    """The manifest of ``directory``, or None when it has none or an unreadable one."""
    try:
        with open(os.path.join(directory, MANIFEST_NAME), "rb") as file:
            manifest = _decoder.decode(file.read())
    except _UNREADABLE:
        return None
    return manifest if manifest.version == MANIFEST_VERSION else None


def write_manifest(directory: str, manifest: Manifest, *, durable: bool = True) -> None:
    """Replace the manifest atomically; with ``durable`` the data and the rename are
    fsynced (a hint update may skip it: readers check every hint)."""
    fd, tmp = tempfile.mkstemp(prefix=".MANIFEST.", suffix=".tmp", dir=directory)
    try:
        try:
            os.write(fd, msgspec.json.encode(manifest))
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, os.path.join(directory, MANIFEST_NAME))
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_directory(directory)


def fsync_directory(directory: str) -> None:
    """Make a directory's entries durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_segments(directory: str) -> list[SegmentInfo]:
    """The segments of a log directory, oldest first: the manifest's, checked against the
    files there (a segment whose file is gone is left out, a file the manifest does not
    know yet is added as open), or the files alone when there is no manifest."""
    try:
        names = os.listdir(directory)
    except OSError as exc:
        raise CorruptLogError(f"cannot list the log directory: {exc}", path=directory) from exc
    files: dict[int, str] = {}
    for name in names:
        match = _SEGMENT_RE.match(name)
        if match:
            first = int(match.group(1))
            if first not in files or name.endswith(".zst"):  # compressed wins (complete)
                files[first] = name
    manifest = read_manifest(directory)
    known = {} if manifest is None else {s.first_seq: s for s in manifest.segments}
    out = []
    for first in sorted(files):
        name, info = files[first], known.get(first)
        compressed = name.endswith(".zst")
        if info is None:  # not in the manifest (yet): an open segment, or no manifest
            info = SegmentInfo(name, first, compressed=compressed)
        elif info.name != name:  # compressed since the manifest was written
            info = msgspec.structs.replace(info, name=name, compressed=compressed, sha256="")
        out.append(info)
    return out


def log_num_bytes(path: str | os.PathLike[str]) -> int:
    """The bytes a log takes: its file's size, or the sum of its segments' (stored) files."""
    text = os.fspath(path)
    if not os.path.isdir(text):
        return os.path.getsize(text)
    return sum(os.path.getsize(os.path.join(text, s.name)) for s in list_segments(text))


def file_sha256(path: str) -> str:
    """The SHA-256 of a file's bytes, as hex."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def zstandard() -> Any:
    """The ``zstandard`` module (``MissingExtra`` when it is not installed)."""
    try:
        import zstandard as module
    except ImportError as exc:
        raise MissingExtra("zstandard", "zstd", "compressed log segments") from exc
    return module


@contextlib.contextmanager
def open_segment(directory: str, info: SegmentInfo) -> Iterator[str]:
    """A path to read the segment from: the file itself, or a decompressed temporary copy
    of a compressed one (removed on exit)."""
    path = os.path.join(directory, info.name)
    if not info.compressed:
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="kvlog-segment-") as tmp:
        plain = os.path.join(tmp, info.name[: -len(".zst")])
        with open(path, "rb") as source, open(plain, "wb") as target:
            zstandard().ZstdDecompressor().copy_stream(source, target)
        yield plain


def compress_file(path: str, level: int = 3) -> str:
    """Compress ``path`` to ``path + ".zst"`` (written to a temporary name, fsynced, then
    renamed); returns the new path. The original is left for the caller to remove."""
    target = path + ".zst"
    tmp = target + ".tmp"
    with open(path, "rb") as source, open(tmp, "wb") as out:
        zstandard().ZstdCompressor(level=level).copy_stream(source, out)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, target)
    return target


def remove_file(path: str) -> None:
    """Remove one file, ignoring one that is already gone."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)

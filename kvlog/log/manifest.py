"""The manifest of a segmented log: which segments a log directory holds, and what each is.

A segmented log is a directory of segment files, each a whole kvlog log file (header,
CRC-framed records) whose header ``meta`` holds ``SEQ_BASE_KEY``, the sequence number of its
first record in the whole log. A segment file is named after that number,
``{first_seq:016d}.kvlog``, and ``.kvlog.zst`` once sealed and compressed (zstd, through the
``zstandard`` package). ``MANIFEST.json`` lists them in order::

    {"version": 1, "segments": [{"name": ..., "first_seq": ..., "last_seq": ...,
      "num_bytes": ..., "sha256": ..., "compressed": ..., "snapshot_seq": ...,
      "snapshot_offset": ..., "sealed_at_s": ...}, ...], "start_seq": ...,
      "segment_bytes": ..., "retain_bytes": ..., "retain_seconds": ..., "compress": ...}

``start_seq`` is where the log starts: retention removes the oldest segments by rewriting
the manifest first (``start_seq`` moved past them), then the files, so a segment file named
before ``start_seq`` is one retention owns (a crash came between): never read, removed by
the next writer. The settings (``segment_bytes``, ``retain_*``, ``compress``) are the
directory's own: a writer that reopens it keeps them unless told otherwise. The format only
grows: a manifest written before these fields reads with their defaults (``start_seq`` -1:
the first segment it lists; ``segment_bytes`` 0: not recorded).

A sealed segment (``last_seq >= 0``) is immutable: its ``sha256`` covers the file as stored.
``snapshot_seq`` / ``snapshot_offset`` locate the latest checkpoint with a snapshot in the
segment (its first frame's byte offset in the uncompressed file), so the latest snapshot of
a whole log is found from the manifest in O(segments). The manifest is replaced atomically
(a temporary file, fsynced, renamed over it, the directory fsynced). It is an index, never
the only copy of anything: without it (or with a damaged one) the segments are found by
their names, and every hint it gives is checked against the segment's own records.

``read_listing`` tells a directory's files apart by the manifest: the log's segments (a
segment the manifest lists whose file is gone is *missing*: damage, not retention), files
the manifest does not list (read without a SHA-256 check, and said), files named like
segments that hold no log (*strays*: skipped), and retention's leftovers. The name of a file
says how it is stored (``.zst``: compressed), whatever the manifest's flag says; where both
names are there, the manifest's is read.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvlog.errors import CorruptLogError, MissingExtra
from kvlog.events.codec import DECODE_ERRORS
from kvlog.log.format import MAGIC

__all__ = [
    "MANIFEST_NAME",
    "Listing",
    "Manifest",
    "SegmentInfo",
    "compress_file",
    "file_sha256",
    "fsync_directory",
    "is_log_directory",
    "list_segments",
    "log_num_bytes",
    "open_segment",
    "read_listing",
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
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_LISTING_TRIES = 3


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
    """The segments of a log directory, oldest first, where the log starts and the
    directory's settings (see the module docstring)."""

    segments: list[SegmentInfo] = msgspec.field(default_factory=list)
    version: int = MANIFEST_VERSION
    start_seq: int = -1
    """The log's first sequence number (-1: not recorded, the first segment listed)."""
    segment_bytes: int = 0
    """The size at which the writer seals a segment (0: not recorded)."""
    retain_bytes: int | None = None
    retain_seconds: float | None = None
    compress: bool = False


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
    """The segments of a log directory whose files are there, oldest first: the
    manifest's, checked against the files (``read_listing``; missing ones and strays left
    out, a file the manifest does not know yet added as open), or the files alone when
    there is no manifest."""
    listing = read_listing(directory)
    return [s for s in listing.segments if s.first_seq not in listing.missing]


@dataclass
class Listing:
    """A log directory's files as its manifest tells them apart (``read_listing``)."""

    segments: list[SegmentInfo]
    """The log's segments, oldest first, the missing ones included."""
    manifest: Manifest | None
    missing: frozenset[int] = frozenset()
    """The ``first_seq`` of segments the manifest lists whose file is gone."""
    unlisted: list[str] = field(default_factory=list)
    """Segment files the manifest does not list (read without a SHA-256 check), but the
    newest one: an open segment the manifest does not know yet."""
    strays: list[str] = field(default_factory=list)
    """Files named like segments, in no manifest, that hold no log (empty, or no header)."""
    leftovers: list[str] = field(default_factory=list)
    """Segment files before the log's start: retention removed them from the manifest and
    a crash came before the files went."""


def read_listing(directory: str) -> Listing:
    """The files of a log directory told apart by its manifest (``Listing``). A segment
    that a writer creates or removes while this runs is not taken for a missing one: the
    directory is listed again after the manifest is read, and the whole is tried again
    while a listed segment seems gone."""
    listing = _listing(directory)
    for _ in range(_LISTING_TRIES - 1):
        if not listing.missing:
            break
        listing = _listing(directory)
    return listing


def _listing(directory: str) -> Listing:
    files = _segment_files(directory)
    manifest = read_manifest(directory)
    entries = [] if manifest is None else manifest.segments
    if any(e.first_seq not in files for e in entries):  # created since the listing?
        files = _segment_files(directory)
    known = {e.first_seq: e for e in entries}
    start = _log_start(manifest, files)
    newest = max(files, default=-1)
    last_known = entries[-1].first_seq if entries else -1
    out = Listing([], manifest)
    missing = set()
    for first in sorted(set(files) | set(known)):
        names, info = files.get(first, []), known.get(first)
        if info is None and first < start:
            out.leftovers += names
        elif info is None:
            name = _pick(names, "")
            if first == newest and first > last_known:  # open, not in the manifest yet
                out.segments.append(SegmentInfo(name, first, compressed=_zst(name)))
            elif not _holds_log(os.path.join(directory, name)):
                out.strays.append(name)
            else:
                out.unlisted.append(name)
                out.segments.append(SegmentInfo(name, first, compressed=_zst(name)))
        elif not names:
            missing.add(first)
            out.segments.append(info)
        else:
            out.segments.append(_as_stored(info, _pick(names, info.name)))
    out.missing = frozenset(missing)
    return out


def _segment_files(directory: str) -> dict[int, list[str]]:
    """Segment file names by their first sequence number."""
    try:
        names = os.listdir(directory)
    except OSError as exc:
        raise CorruptLogError(f"cannot list the log directory: {exc}", path=directory) from exc
    files: dict[int, list[str]] = {}
    for name in names:
        match = _SEGMENT_RE.match(name)
        if match:
            files.setdefault(int(match.group(1)), []).append(name)
    return files


def _log_start(manifest: Manifest | None, files: dict[int, list[str]]) -> int:
    """Where the log starts: the manifest's ``start_seq``, else (an older manifest) its
    first segment; without a manifest, its first file."""
    if manifest is not None and manifest.start_seq >= 0:
        return manifest.start_seq
    if manifest is not None and manifest.segments:
        return manifest.segments[0].first_seq
    return min(files, default=0)


def _pick(names: list[str], preferred: str) -> str:
    """The file to read of one segment: the manifest's name, else the compressed one (it
    is only ever renamed into place whole), else the plain one."""
    if preferred in names:
        return preferred
    return max(names, key=_zst)


def _zst(name: str) -> bool:
    return name.endswith(".zst")


def _as_stored(info: SegmentInfo, name: str) -> SegmentInfo:
    """``info`` for the file ``name``: the name says whether it is compressed; another name
    than the manifest's (compressed since) has no digest to check."""
    if name == info.name and info.compressed == _zst(name):
        return info
    digest = info.sha256 if name == info.name else ""
    return msgspec.structs.replace(info, name=name, compressed=_zst(name), sha256=digest)


def _holds_log(path: str) -> bool:
    """Whether a file starts like a log (or a compressed one)."""
    try:
        with open(path, "rb") as file:
            head = file.read(len(MAGIC))
    except OSError:
        return False
    magic = _ZSTD_MAGIC if _zst(path) else MAGIC
    return head[: len(magic)] == magic


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
        module = zstandard()
        try:
            with open(path, "rb") as source, open(plain, "wb") as target:
                module.ZstdDecompressor().copy_stream(source, target)
        except module.ZstdError as exc:
            raise CorruptLogError(
                f"compressed segment does not decompress ({exc})", path=path, offset=0
            ) from exc
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

"""Fixed-size numpy arrays that share their memory with an ``array.array``.

The reducers keep per-block state in numpy (vectorized updates, snapshots, digests) but
read and write single entries in per-block loops, where a numpy scalar access costs several
times a plain Python one. Each array here is a numpy view of an ``array.array`` buffer: the
loops index the ``array.array`` (Python ints in and out), the vectorized code indexes the
numpy view, and both always see the same bytes, so nothing is mirrored or copied. The
buffer can never be resized while the view exists (``array.array`` refuses), which suits
arrays sized once at configuration.
"""

from __future__ import annotations

from array import array

import numpy as np
import numpy.typing as npt

__all__ = ["Int32Array", "Int64Array", "WordArray", "int32_buffer", "int64_buffer", "uint64_buffer"]

Int32Array = npt.NDArray[np.int32]
Int64Array = npt.NDArray[np.int64]
WordArray = npt.NDArray[np.uint64]

assert array("i").itemsize == 4, "array typecode 'i' must be 4 bytes (int32)"
assert array("Q").itemsize == 8, "array typecode 'Q' must be 8 bytes (uint64)"
assert array("q").itemsize == 8, "array typecode 'q' must be 8 bytes (int64)"


def int32_buffer(values: npt.ArrayLike) -> tuple[array[int], Int32Array]:
    """An ``array('i')`` holding ``values`` (cast to int32) and its int32 numpy view."""
    data = np.ascontiguousarray(values, dtype=np.int32)
    buffer = array("i", data.tobytes())
    return buffer, np.frombuffer(buffer, dtype=np.int32)


def uint64_buffer(size: int) -> tuple[array[int], WordArray]:
    """A zeroed ``array('Q')`` of ``size`` words and its uint64 numpy view."""
    buffer = array("Q", bytes(8 * size))
    return buffer, np.frombuffer(buffer, dtype=np.uint64)


def int64_buffer(size: int) -> tuple[array[int], Int64Array]:
    """A zeroed ``array('q')`` of ``size`` entries and its int64 numpy view."""
    buffer = array("q", bytes(8 * size))
    return buffer, np.frombuffer(buffer, dtype=np.int64)

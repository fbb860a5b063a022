"""numba compilation with one caching rule for every compiled loop in kvlog."""

from __future__ import annotations

from typing import Any, Literal

import numba

__all__ = ["inline", "jit"]


def _compiled(function: Any, *, inline: bool, allocates: bool = True) -> Any:
    """``function`` compiled by numba, cached on disk where numba finds a writable place
    (``NUMBA_CACHE_DIR`` if set, else next to the function's file, else the user's cache
    directory); where it finds none, compiled in each process instead of refusing to import.
    ``inline``: a helper, inlined into the kernels that call it. The GIL is kept (no
    ``nogil``): a kernel runs for microseconds, and a released GIL could hand the serving
    loop's thread over to another for a whole switch interval. ``allocates=False``: compiled
    without numba's reference counting (see ``jit``)."""
    mode: Literal["always", "never"] = "always" if inline else "never"
    options: dict[str, Any] = {"inline": mode}
    if not allocates:
        options["_nrt"] = False
    try:
        return numba.njit(cache=True, **options)(function)
    except RuntimeError:  # "cannot cache function ...: no locator available"
        return numba.njit(cache=False, **options)(function)


def jit(function: Any, *, allocates: bool = True) -> Any:
    """``function`` compiled by numba (cached on disk where possible). ``allocates=False``
    for a kernel that creates no array (views and slices of its arguments are fine): it
    then runs without numba's reference counting, which otherwise wraps every array an
    inlined helper is handed in an atomic increment and decrement (about 35 ns a call:
    a helper called per block made a 900-block loop 15x slower). Same results either way;
    a kernel that does allocate fails to compile without it."""
    return _compiled(function, inline=False, allocates=allocates)


def inline(function: Any) -> Any:
    """``function`` compiled as a helper numba inlines into the kernels that call it."""
    return _compiled(function, inline=True)

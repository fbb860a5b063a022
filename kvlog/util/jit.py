"""numba compilation with one caching rule for every compiled loop in kvlog."""

from __future__ import annotations

from typing import Any, Literal

import numba

__all__ = ["inline", "jit"]


def _compiled(function: Any, *, inline: bool) -> Any:
    """``function`` compiled by numba, cached on disk where numba finds a writable place
    (``NUMBA_CACHE_DIR`` if set, else next to the function's file, else the user's cache
    directory); where it finds none, compiled in each process instead of refusing to import.
    ``inline``: a helper, inlined into the kernels that call it. The GIL is kept (no
    ``nogil``): a kernel runs for microseconds, and a released GIL could hand the serving
    loop's thread over to another for a whole switch interval."""
    mode: Literal["always", "never"] = "always" if inline else "never"
    try:
        return numba.njit(cache=True, inline=mode)(function)
    except RuntimeError:  # "cannot cache function ...: no locator available"
        return numba.njit(cache=False, inline=mode)(function)


def jit(function: Any) -> Any:
    """``function`` compiled by numba (cached on disk where possible)."""
    return _compiled(function, inline=False)


def inline(function: Any) -> Any:
    """``function`` compiled as a helper numba inlines into the kernels that call it."""
    return _compiled(function, inline=True)

"""A Ray pool for one call: what-if grids and tier sweeps map their tasks over it.

Ray is an optional extra (``pip install 'kvlog[sweep]'``); without it a Ray run raises
:class:`kvlog.errors.MissingExtra`. ``run_all(..., use_ray=False)`` runs the same calls in
this process."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvlog.errors import ConfigError, MissingExtra

__all__ = ["Progress", "RayPool", "ray_module", "read_bytes", "run_all"]

Progress = Callable[[int, int], None]
"""Called as ``progress(done, total)`` after each finished task."""


def ray_module() -> Any:
    """Ray, imported; :class:`~kvlog.errors.MissingExtra` where it is not installed."""
    try:
        import ray
    except ImportError as exc:
        raise MissingExtra("ray", "sweep", "running on Ray") from exc
    return ray


class RayPool:
    """A Ray runtime for one call: started locally (``num_cpus``, no dashboard) unless one
    is running or ``address`` names a cluster; shut down after if this call started it."""

    def __init__(self, address: str | None, num_cpus: int | None) -> None:
        if num_cpus is not None and (type(num_cpus) is not int or num_cpus < 1):
            raise ConfigError("num_cpus", num_cpus, "an int >= 1 (Ray waits forever for 0)")
        self.ray = ray_module()
        self.address = address
        self.started = False
        if not self.ray.is_initialized():
            options: dict[str, Any] = {"log_to_driver": False, "configure_logging": False}
            if address is None:
                options.update(num_cpus=num_cpus, include_dashboard=False)
            self.ray.init(address=address, **options)
            self.started = True

    def map(
        self, fn: Callable[..., Any], calls: Sequence[tuple[Any, ...]], progress: Progress | None
    ) -> list[Any]:
        """``[fn(*args) for args in calls]`` as Ray tasks, in order."""
        remote = self.ray.remote(num_cpus=1)(fn)
        pending = {remote.remote(*args): i for i, args in enumerate(calls)}
        out: list[Any] = [None] * len(calls)
        while pending:
            done, _ = self.ray.wait(list(pending), num_returns=1)
            for ref in done:
                out[pending.pop(ref)] = self.ray.get(ref)
            if progress is not None:
                progress(len(calls) - len(pending), len(calls))
        return out

    def close(self) -> None:
        if self.started:
            self.ray.shutdown()


def run_all(
    fn: Callable[..., Any],
    calls: Sequence[tuple[Any, ...]],
    use_ray: bool,
    address: str | None,
    num_cpus: int | None,
    progress: Progress | None,
) -> list[Any]:
    """``[fn(*args) for args in calls]``, in order: on a Ray pool (``use_ray``: a local one
    with ``num_cpus``, or the cluster at ``address``) or in this process, reporting
    ``progress(done, total)`` after each."""
    if not use_ray:
        out = []
        for i, args in enumerate(calls):
            out.append(fn(*args))
            if progress is not None:
                progress(i + 1, len(calls))
        return out
    pool = RayPool(address, num_cpus)
    try:
        return pool.map(fn, calls, progress)
    finally:
        pool.close()


def read_bytes(path: str) -> bytes:
    """A log file's bytes, for a task on a remote cluster that cannot read this machine's
    files (a log directory is assumed shared)."""
    with open(path, "rb") as f:
        return f.read()

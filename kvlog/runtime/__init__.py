"""The imperative shell: one :class:`~kvlog.runtime.machine.Machine` step (check, change once,
execute, observe), the :class:`~kvlog.runtime.engine.Engine` around it with its log, the
opening and resuming of logs (``opening``), the fold every reader of a log runs (``fold``),
and the memory check a state's size needs (``memory``)."""

from __future__ import annotations

__all__: list[str] = []

"""One step of the machine, in one place: check an event, change the state once, execute
the plans, notify the observers.

Every way kvlog runs drives this one step: the :class:`~kvlog.runtime.engine.Engine` (whose
``apply``
appends the checked event to its log between ``check`` and ``commit``; it also writes
checkpoints and turns the executor's finished transfers into ``TransferFinished`` events),
replay (which feeds it a log's events and keeps only verification, diffing and what-ifs) and
the synthetic serving loop (through an Engine). Whatever else watches a run (the canary
tracker, run statistics) is an :class:`Observer`, called around every committed event, with
the state before and after the change.

The order inside ``commit`` is the contract: observers' ``before`` (the state before), the
reducers' change (cannot refuse: the event was checked against this very state), the
executor (each plan in order), observers' ``after`` (the state after, and the plans).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Protocol

from kvlog import reducers
from kvlog.events import Event, Plan, StepScheduled, TransferBatch, TransferFinished
from kvlog.reducers import Checked, State

if TYPE_CHECKING:
    from kvlog.executors import Executor

__all__ = ["Machine", "Observer"]


class Observer(Protocol):
    """Watches every committed event (never a refused one); must not change the state.
    A class that subclasses it explicitly inherits both hooks as no-ops."""

    def before(self, state: State, event: Event) -> None:
        """Called before the state changes by ``event``."""
        return None

    def after(self, state: State, event: Event, plans: list[Plan]) -> None:
        """Called after the change and after the executor took the plans."""
        return None


class Machine:
    """The state, the executor that carries out its plans (or None) and the observers."""

    __slots__ = ("_checked", "executor", "observers", "state")

    def __init__(
        self,
        state: State | None = None,
        executor: Executor | None = None,
        observers: Iterable[Observer] = (),
    ) -> None:
        self.state = reducers.initial_state() if state is None else state
        self.executor = executor
        self.observers = list(observers)
        self._checked: Checked | None = None
        """The last event ``check`` accepted, while no commit has changed the state since:
        ``apply`` of that same event object commits it without checking it again (the
        Gaudi facade checks a step when the runner hands it over and applies it at the
        step's end)."""

    def check(self, event: Event) -> Checked:
        """The event checked against the state (nothing changes), or the refusal: an
        ``InvalidEvent`` subclass or ``NotConfigured``."""
        checked = reducers.check(self.state, event)
        self._checked = checked
        return checked

    def prepared(self, event: Event) -> Checked:
        """``check(event)``, or what the last ``check`` found for this same event object
        when no commit has changed the state since (then it is not checked twice)."""
        checked = self._checked
        if checked is None or checked.event is not event:
            checked = reducers.check(self.state, event)
        return checked

    def commit(self, checked: Checked) -> list[Plan]:
        """Change the state by a checked event, execute its plans, notify; the plans."""
        kept = self._checked
        self._checked = kept if kept is not None and _survives(checked, kept) else None
        state, event = self.state, checked.event
        observers = self.observers
        if observers:
            for observer in observers:
                observer.before(state, event)
        plans = reducers.commit(state, checked)
        executor = self.executor
        if executor is not None and plans:
            for plan in plans:
                executor.execute(plan)
        if observers:
            for observer in observers:
                observer.after(state, event, plans)
        return plans

    def apply(self, event: Event, record: Callable[[Event], object] | None = None) -> list[Plan]:
        """``check``, then ``record(event)`` if given (a log's append: it may refuse, and
        then nothing has changed), then ``commit``; the plans."""
        checked = self._checked
        if checked is None or checked.event is not event:
            checked = reducers.check(self.state, event)
        if record is not None:
            record(checked.event)
        return self.commit(checked)


def _survives(committed: Checked, kept: Checked) -> bool:
    """Whether ``kept`` (the last check) still describes the state after ``committed``:
    a whole step checked with every block free, unpinned and given once (its
    ``found.bulk``) stays checked across a finished transfer, which only ends a job and
    unpins its blocks (no table, mapping or reference changes). The facade checks a step
    at ``update_state`` and applies it at ``defragment()``, after that call's poll."""
    return (
        kept is not committed
        and _only_finishes(committed.event)
        and type(kept.event) is StepScheduled
        and kept.found.bulk is not None
    )


def _only_finishes(event: Event) -> bool:
    """A ``TransferFinished``, or a ``TransferBatch`` of them (one poll's finishes)."""
    if type(event) is TransferBatch:
        return all(type(e) is TransferFinished for e in event.events)
    return type(event) is TransferFinished

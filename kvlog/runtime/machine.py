"""One step of the machine, in one place: check an event, change the state once, execute
the plans, notify the observers.

Every way kvlog runs drives this one step: the :class:`~kvlog.runtime.engine.Engine` (whose
``apply`` appends the checked event to its log between ``check`` and ``commit``; it also
writes checkpoints and turns the executor's finished transfers into ``TransferFinished``
events), replay (which feeds it a log's events and keeps only verification, diffing and
what-ifs) and the synthetic serving loop (through an Engine). Whatever else watches a run
(the canary tracker, run statistics) is an :class:`Observer`, called around every committed
event, with the state before and after the change.

The order inside ``commit`` is the contract: observers' ``before`` (the state before), the
reducers' change (cannot refuse: the event was checked against this very state), the
executor (each plan in order), observers' ``after`` (the state after, and the plans).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, NamedTuple, Protocol

from kvlog import reducers
from kvlog.events import WHOLE_STEPS, Event, Plan, TransferBatch, TransferFinished
from kvlog.reducers import Checked, State

if TYPE_CHECKING:
    from kvlog.executors import Executor

__all__ = ["Machine", "Observer", "Ticket"]


class Observer(Protocol):
    """Watches every committed event (never a refused one); must not change the state.
    A class that subclasses it explicitly inherits both hooks as no-ops."""

    def before(self, state: State, event: Event) -> None:
        """Called before the state changes by ``event``."""
        return None

    def after(self, state: State, event: Event, plans: list[Plan]) -> None:
        """Called after the change and after the executor took the plans."""
        return None


class Ticket(NamedTuple):
    """An event :meth:`Machine.check` accepted, and when: the caller hands it back to
    :meth:`Machine.apply` (through ``Engine.check`` / ``Engine.apply``), which commits it
    without checking it again while what it found still describes the state."""

    checked: Checked
    commits: int
    """The machine's commits when it was checked."""
    changes: int
    """Its commits that were more than finished transfers, when it was checked."""


class Machine:
    """The state, the executor that carries out its plans (or None) and the observers."""

    __slots__ = ("changes", "commits", "counted_swaps", "executor", "observers", "state")

    def __init__(
        self,
        state: State | None = None,
        executor: Executor | None = None,
        observers: Iterable[Observer] = (),
    ) -> None:
        self.state = reducers.initial_state() if state is None else state
        self.executor = executor
        self.observers = list(observers)
        self.commits = 0
        """Events committed so far."""
        self.changes = 0
        """Events committed so far that were more than finished transfers."""
        self.counted_swaps = False
        """``apply_decoded`` counts a whole step's defrag moves in the state's
        ``counted_pairs`` instead of returning their ``SwapPlan`` (for a machine without
        an executor whose observers only count plans: replay's tallies)."""

    def check(self, event: Event) -> Ticket:
        """The event checked against the state (nothing changes), or the refusal: an
        ``InvalidEvent`` subclass or ``NotConfigured``."""
        return Ticket(reducers.check(self.state, event), self.commits, self.changes)

    def still_checked(self, ticket: Ticket) -> Checked | None:
        """What ``ticket``'s check found, if it still describes the state: nothing was
        committed since, or only finished transfers since and the ticket is a whole step
        checked in bulk with nothing to flush (its ``found.bulk``, no ``found.flushes``):
        a finished transfer only ends a job and unpins its blocks (no table, mapping or
        reference changes), which keeps that so. The Gaudi facade checks a step at
        ``update_state`` and applies it at ``defragment()``, after that call's poll. None:
        check it again."""
        checked = ticket.checked
        if ticket.commits == self.commits:
            return checked
        if (
            ticket.changes == self.changes
            and type(checked.event) in WHOLE_STEPS
            and checked.found.bulk is not None
            and not checked.found.flushes  # a finished store would have nothing to flush
        ):
            return checked
        return None

    def prepared(self, event: Event, ticket: Ticket | None) -> Checked:
        """``event`` checked: what ``ticket`` found, when it is this event's and still
        holds, else checked now (an ``InvalidEvent`` subclass or ``NotConfigured``)."""
        if ticket is not None and ticket.checked.event is event:
            checked = self.still_checked(ticket)
            if checked is not None:
                return checked
        return reducers.check(self.state, event)

    def commit(self, checked: Checked) -> list[Plan]:
        """Change the state by a checked event, execute its plans, notify; the plans."""
        state, event = self.state, checked.event
        self.commits += 1
        if not _only_finishes(event):
            self.changes += 1
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

    def apply_decoded(self, event: Event) -> list[Plan]:
        """``apply`` for an event the log's typed decoder produced (replay): checked with
        ``reducers.check_decoded`` (the same verdict: the types the decoder made exact are
        not checked again), then committed; see ``counted_swaps``."""
        return self.commit(reducers.check_decoded(self.state, event, self.counted_swaps))

    def apply(
        self,
        event: Event,
        record: Callable[[Event], object] | None = None,
        ticket: Ticket | None = None,
    ) -> list[Plan]:
        """Check (or take ``ticket``'s check, see :meth:`prepared`), then ``record(event)``
        if given (a log's append: it may refuse, and then nothing has changed), then
        ``commit``; the plans."""
        checked = self.prepared(event, ticket)
        if record is not None:
            record(checked.event)
        return self.commit(checked)


def _only_finishes(event: Event) -> bool:
    """A ``TransferFinished``, or a ``TransferBatch`` of them (one poll's finishes)."""
    if type(event) is TransferBatch:
        return all(type(e) is TransferFinished for e in event.events)
    return type(event) is TransferFinished

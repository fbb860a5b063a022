"""Pure bookkeeping: the engine State, the reducers and their composition.

No torch, no I/O, no clock, no randomness: ``reduce(state, event)`` validates the event
against the state, then changes the state in place and returns it with its plans. See
``docs/internals.md`` for the contract and ``defrag.py`` / ``transfers.py`` for the rules.
"""

from kvlog.reducers.compose import reduce, validate
from kvlog.reducers.digest import digest, restore, snapshot
from kvlog.reducers.invariants import check_invariants
from kvlog.reducers.state import MAX_JOBS_IN_FLIGHT, Job, State, initial_state

__all__ = [
    "MAX_JOBS_IN_FLIGHT",
    "Job",
    "State",
    "check_invariants",
    "digest",
    "initial_state",
    "reduce",
    "restore",
    "snapshot",
    "validate",
]

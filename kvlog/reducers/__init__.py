"""Pure bookkeeping: the engine State, the reducers and their composition.

No torch, no I/O, no clock, no randomness: ``check(state, event)`` validates the event
against the state (nothing changes), ``commit(state, checked)`` then changes the state in
place, once, and returns the plans; ``reduce(state, event)`` is both. See
``docs/internals.md`` for the contract and ``defrag.py`` / ``transfers.py`` for the rules.
"""

from kvlog.reducers.compose import Checked, check, check_decoded, commit, recorded, reduce
from kvlog.reducers.digest import digest, restore, snapshot
from kvlog.reducers.invariants import check_invariants
from kvlog.reducers.jobs import Job
from kvlog.reducers.state import MAX_JOBS_IN_FLIGHT, State, initial_state

__all__ = [
    "MAX_JOBS_IN_FLIGHT",
    "Checked",
    "Job",
    "State",
    "check",
    "check_decoded",
    "check_invariants",
    "commit",
    "digest",
    "initial_state",
    "recorded",
    "reduce",
    "restore",
    "snapshot",
]

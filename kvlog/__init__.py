"""kvlog: event-sourced KV-cache bookkeeping for LLM serving (defrag, offload, load)."""

from kvlog import errors, events
from kvlog._version import __version__
from kvlog.analysis.replay import ReplayResult, replay
from kvlog.runtime.engine import Engine

__all__ = ["Engine", "ReplayResult", "__version__", "errors", "events", "replay"]

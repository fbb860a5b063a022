"""kvlog: event-sourced KV-cache bookkeeping for LLM serving (defrag, offload, load)."""

__version__ = "0.1.0"

from kvlog import errors, events
from kvlog.engine import Engine
from kvlog.replay import ReplayResult, replay

__all__ = ["Engine", "ReplayResult", "__version__", "errors", "events", "replay"]

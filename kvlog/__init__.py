"""kvlog: event-sourced KV-cache bookkeeping for LLM serving (defrag, offload, load)."""

from kvlog import errors, events

__version__ = "0.1.0"

__all__ = ["__version__", "errors", "events"]

"""The ``kvlog`` command line, one module per subcommand; ``main`` is the console script."""

from __future__ import annotations

from kvlog.cli.entry import build_parser, main

__all__ = ["build_parser", "main"]

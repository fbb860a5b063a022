"""Presentation: what kvlog shows people, and nothing it decides.

- :mod:`kvlog.util.units`: byte sizes (format and parse), plurals, p99;
- :mod:`kvlog.present.text`: tables, the progress bar, each command's printed result;
- :mod:`kvlog.present.pictures`: the replay report and the sweep picture (matplotlib).

The command line (``kvlog.cli.entry``) parses arguments, calls the domain and prints what this
package renders.
"""

from __future__ import annotations

__all__: list[str] = []

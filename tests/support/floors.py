"""Check that the dependency floors stage imports the versions it installed, not newer ones.

    PYTHONPATH=.floors python tests/support/floors.py numpy==1.24.4 numba==0.59.1 msgspec==0.18.6

Exits non-zero, naming the package, when an installed version differs from the one asked
for (a PYTHONPATH that did not take would otherwise test the first virtualenv's versions
and prove nothing about the floors).
"""

from __future__ import annotations

import importlib
import sys


def main(argv: list[str]) -> int:
    wrong = []
    for pin in argv:
        name, _, wanted = pin.partition("==")
        found = importlib.import_module(name).__version__
        print(f"{name} {found}")
        if found != wanted:
            wrong.append(f"{name} {found} is imported, the floor is {wanted}")
    for line in wrong:
        print(line, file=sys.stderr)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

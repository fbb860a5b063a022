"""``python -m kvlog.cli``: the ``kvlog`` command."""

import sys

from kvlog.cli import main

if __name__ == "__main__":
    sys.exit(main())

"""``python -m kvlog``: the ``kvlog`` command line."""

import sys

from kvlog.cli import main

if __name__ == "__main__":
    sys.exit(main())

"""Write ``digests.json`` for the golden logs in this directory (see README.md).

    python replays/regenerate.py           # print what the logs replay to now
    python replays/regenerate.py --write   # (re)write digests.json: only with a stated reason

The expectations come from a replay of each log as it is (the logs themselves are never
re-recorded by this script): final digest, record counts, and a SHA-256 over every plan the
reducers produce, so a change in any decision shows up even where the digest would not.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

from kvlog import reducers, replay
from kvlog.events import Checkpoint, encode
from kvlog.log import read_log

HERE = os.path.dirname(os.path.abspath(__file__))
LOGS = (
    "plain.kvlog",
    "prefix_caching.kvlog",
    "offload.kvlog",
    "runner_steps.kvlog",
    "runner_packed.kvlog",
)


def plans_sha256(path: str) -> str:
    """SHA-256 over the encoded plans of every event, in order."""
    state = reducers.initial_state()
    sha = hashlib.sha256()
    for _, record in read_log(path):
        if isinstance(record, Checkpoint):
            continue
        state, plans = reducers.reduce(state, record)
        for plan in plans:
            sha.update(encode(plan))
    return sha.hexdigest()


def expectations(path: str) -> dict[str, object]:
    result = replay(path, series=False)
    assert result.ok, f"{path}: {result.divergence}"
    return {
        "final_digest": result.final_digest,
        "plans_sha256": plans_sha256(path),
        "num_records": result.num_records,
        "num_events": result.num_events,
        "num_checkpoints": result.num_checkpoints,
        "counts": dict(sorted(result.counts.items())),
        "schema_version": 1,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    out = {name: expectations(os.path.join(HERE, name)) for name in LOGS}
    text = json.dumps(out, indent=2, sort_keys=True) + "\n"
    if args.write:
        with open(os.path.join(HERE, "digests.json"), "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A SIGKILL during retention (issue 34 item 17): killed after retention rewrote the
manifest and before it removed the files, the directory still replays, and a resume with
retention removes what retention owned instead of leaving a log that no longer reads."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvlog import Engine, replay
from kvlog.log import list_segments
from kvlog.runtime.opening import LogOptions
from tests.support.logdirs import segment_files, steps, stored_bytes

STEP_SLACK = 2048


_KILL_IN_RETENTION = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {root!r})
    from kvlog.log import segments
    from tests.support.logdirs import record_dir

    calls = []
    retention = segments.SegmentedWriter._apply_retention
    remove = segments.remove_file

    def apply_retention(self):
        calls.append(True)
        try:
            retention(self)
        finally:
            calls[-1] = False

    def remove_file(path):
        if len(calls) >= 4 and calls[-1]:  # the 4th retention, after its manifest write
            os.kill(os.getpid(), signal.SIGKILL)
        remove(path)

    segments.SegmentedWriter._apply_retention = apply_retention
    segments.remove_file = remove_file
    record_dir({log!r}, 2000, segment_bytes=4096, retain_bytes=10_000, compress={compress})
    """
)


@pytest.mark.parametrize("compress", [True, False])
def test_a_sigkill_between_retentions_manifest_and_its_removals_leaves_a_readable_log(
    tmp_path: Path, compress: bool
) -> None:
    """Issue 34 item 17: the writer is killed after retention rewrote the manifest and
    before it removed the files; a resume with retention goes on, and the directory
    still replays, with no segment file left that retention owns."""
    if compress:
        pytest.importorskip("zstandard")
    log = tmp_path / "dir"
    script = _KILL_IN_RETENTION.format(
        root=str(Path(__file__).resolve().parents[2]), log=str(log), compress=compress
    )
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
    assert replay(log).ok  # right after the crash
    options = LogOptions(segment_bytes=4096, retain_bytes=10_000, compress=compress)
    with Engine.resume(log, sync="none", checkpoint_every=16, log_options=options) as engine:
        steps(engine, 1500)
    result = replay(log)
    assert result.ok and result.num_verified == result.num_checkpoints > 0
    first = list_segments(str(log))[0].first_seq
    leaked = [n for n in segment_files(log) if int(n[:16]) < first]
    assert not leaked, leaked
    assert stored_bytes(log) <= 10_000 + 4096 + STEP_SLACK

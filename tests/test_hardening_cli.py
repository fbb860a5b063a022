"""Issue 20, the command line and input items (3, 5, 6, 7, 10-13, Ctrl-C): every bad
value is refused with a typed error, exit 2 and nothing written, before any work."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from seed_reference import make_hpu_caches

from kvlog.cli import main
from kvlog.errors import DuplicateJob, TransferSpecError
from kvlog.integrations import OffloadingWorker, OnlineDefragmenter

SMALL = ["--steps", "120", "--num-gpu-blocks", "128", "--sync", "none"]


def kvlog(*argv: str) -> int:
    return main(list(argv))


@pytest.fixture(scope="module")
def log(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("hcli") / "a.kvlog")
    assert kvlog("synth", "--out", path, "--checkpoint-every", "8", *SMALL) == 0
    return path


def refused(capsys: pytest.CaptureFixture[str], argv: list[str], *names: str) -> str:
    """Runs ``kvlog argv``: exit 2, one line on stderr naming each of ``names``."""
    assert main(argv) == 2, argv
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    for name in names:
        assert name in err, (name, err)
    return err


def entries(path: Path) -> list[str]:
    return sorted(os.listdir(path))


# -- item 5: OffloadingWorker job ids ------------------------------------------------------
def _worker() -> tuple[OnlineDefragmenter, OffloadingWorker]:
    defrag = OnlineDefragmenter(environ={"VLLM_DEFRAG_THRESHOLD": "4"}, backend="fake")
    defrag.initialize(make_hpu_caches(64, 4), 4)
    worker = OffloadingWorker(defrag, num_cpu_blocks=8)
    defrag.update_state({"a": [1, 2, 3]}, [])
    return defrag, worker


@pytest.mark.parametrize("bad", [1, 0, -1])
def test_a_reused_or_lower_job_id_is_refused_not_dropped(bad: int) -> None:
    defrag, worker = _worker()
    assert worker.submit_store(1, [1], [0])
    before = defrag.engine.digest()
    with pytest.raises(DuplicateJob, match=f"job id {bad} is not a fresh one"):
        worker.submit_load(bad, [0], [5])
    with pytest.raises(DuplicateJob):
        worker.submit_store(bad, [2], [1])
    assert defrag.engine.digest() == before
    assert worker.submit_store(2, [2], [1])  # the counter goes on
    worker.wait(None)
    assert sorted(r.job_id for r in worker.get_finished()) == [1, 2]


@pytest.mark.parametrize("bad", [6.7, True, "3", None])
def test_a_job_id_that_is_not_an_int_is_refused(bad: object) -> None:
    defrag, worker = _worker()
    before = defrag.engine.digest()
    with pytest.raises(TransferSpecError, match="job id"):
        worker.submit_store(bad, [1], [0])  # type: ignore[arg-type]
    assert defrag.engine.digest() == before


def test_a_declared_job_is_submitted_once() -> None:
    _, worker = _worker()
    worker.declare("store", 3, [1, 2], [0, 1], req_id="a")
    assert worker.submit_store(3, [1, 2], [0, 1])
    with pytest.raises(DuplicateJob):
        worker.submit_store(3, [1, 2], [0, 1])
    worker.wait(None)
    assert [r.job_id for r in worker.get_finished()] == [3]

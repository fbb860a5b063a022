"""kvlog's Gaudi switch against vllm-gaudi's real source (``../shared/vllm_gaudi/``, commit
091bbadd), read as data: every name kvlog patches or calls exists there with the signature
kvlog expects (``gaudi_source.check_source``), the check fails when one is renamed, and the
runner's own ``run_defragmenter``, ``_resolve_block`` and ``_resolve_all_blocks``, taken out
of its file with ``ast``, run against kvlog's defragmenter.

The plugin's files sit outside the repository; without them (a clone elsewhere, no
``KVLOG_VLLM_GAUDI_SOURCE``) these tests say so and skip.
"""

from __future__ import annotations

import itertools
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvlog.integrations import gaudi
from tests.support.gaudi_source import FILES, check_source, extract_methods, source_root
from tests.support.seed_reference import make_hpu_caches, read_tags, write_canary

ROOT = source_root()
pytestmark = pytest.mark.skipif(
    ROOT is None,
    reason="vllm-gaudi's source is not at ../shared/vllm_gaudi (or $KVLOG_VLLM_GAUDI_SOURCE)",
)
BS = 4


def test_the_plugin_source_fits_every_patch_point() -> None:
    assert ROOT is not None
    assert check_source(ROOT) == []


PAD = " " * 34  # the indent of _create_decode_input_data's parameters
# (file, text in it, its replacement, what the check must then say)
RENAMES = [
    (FILES[1], "def run_defragmenter(", "def run_defrag(", "defines run_defragmenter"),
    (
        FILES[1],
        "warmup_mode: bool = False):\n        if not (getattr(self, 'defragmenter'",
        "warmup_mode: bool = False, step: int = 0):\n        if not (getattr(self, 'defragmenter'",
        "run_defragmenter[",
    ),
    (FILES[1], "KVConnectorOutput", "KVConnectorOutputs", "module-level KVConnectorOutput"),
    (FILES[1], "get_finished_kv_transfers", "get_finished_transfers", "get_finished_kv_transfers"),
    (FILES[1], "has_kv_transfer_group", "has_kv_transfer", "module-level has_kv_transfer_group"),
    (
        FILES[1],
        "finished_sending, finished_recving = self.get_finished_kv_transfers(scheduler_output)",
        "finished_sending, finished_recving = set(), set()",
        "no get_finished_kv_transfers before",
    ),
    (
        FILES[1],
        "        if self.use_async_scheduling:\n            model_runner_output",
        "        self.clear_connector_metadata()\n        if self.use_async_scheduling:\n"
        "            model_runner_output",
        "clear_connector_metadata before the output",
    ),
    (
        FILES[1],
        "                kv_connector_output=KVConnectorOutput(\n",
        "                kv_connector_output=isinstance(0, KVConnectorOutput)"
        " or KVConnectorOutput(\n",
        "used, not called",
    ),
    (
        FILES[1],
        "class HPUModelRunner(HpuKVConnectorModelRunnerMixin)",
        "class HPUModelRunner",
        "is not its class's",
    ),
    (
        FILES[1],
        "from vllm_gaudi.extension.defragmentation import OnlineDefragmenter",
        "from vllm_gaudi.extension.defrag import OnlineDefragmenter",
        "does not import OnlineDefragmenter",
    ),
    (FILES[0], "class OnlineDefragmenter:", "class OnlineDefrag:", "defines no OnlineDefragmenter"),
    (
        FILES[2],
        "self.model_runner.block_size)",
        "self.model_runner.block_size, self.model_runner)",
        "OnlineDefragmenter(3 args",
    ),
    (FILES[3], "defragmenter.resolve_all(", "defragmenter.resolve_many(", "has no resolve_many"),
    (
        FILES[1],
        "self.defragmenter.update_state(new | cached,",
        "self.defragmenter.update_state(",
        "defragmenter.update_state(1 args",
    ),
    (
        FILES[4],
        "OffloadingConnectorWorker.register_kv_caches = register_kv_caches",
        "OffloadingConnectorWorker.register_caches = register_kv_caches",
        "does not define register_caches",
    ),
    (
        FILES[4],
        "def worker_wait(self, job_ids: set[int])",
        "def worker_wait(self, a, b, c)",
        "CPUOffloadingWorker.wait: 3 arguments",
    ),
    (
        FILES[1],
        "block_number.apply_(self._resolve_block)",
        "block_number.apply_(self.defragmenter.resolve)",
        "calls self.defragmenter itself",
    ),
    (
        FILES[1],
        f"{PAD}num_scheduled_tokens,\n{PAD}context_lens,\n",
        f"{PAD}context_lens,\n{PAD}num_scheduled_tokens,\n",
        "does not start",
    ),
    (
        FILES[1],
        "context_lens,\n                                              block_table_cpu_tensor)",
        "context_lens,\n                block_table_cpu_tensor=block_table_cpu_tensor)",
        "with 3 positional arguments",
    ),
]


@pytest.mark.parametrize(("rel", "old", "new", "said"), RENAMES, ids=[r[3] for r in RENAMES])
def test_a_renamed_patch_point_fails_the_check(
    tmp_path: Path, rel: str, old: str, new: str, said: str
) -> None:
    assert ROOT is not None
    copy = tmp_path / "vllm_gaudi"
    shutil.copytree(ROOT, copy)
    text = (copy / rel).read_text()
    assert old in text, f"{rel} no longer has {old!r}: the test's edit needs updating"
    (copy / rel).write_text(text.replace(old, new))
    problems = check_source(copy)
    assert problems, f"renaming {old!r} in {rel} went unnoticed"
    assert any(said in p for p in problems), problems


def test_a_missing_file_fails_the_check(tmp_path: Path) -> None:
    assert ROOT is not None
    copy = tmp_path / "vllm_gaudi"
    shutil.copytree(ROOT, copy)
    (copy / FILES[2]).rename(copy / "v1/worker/hpu_worker_v2.py")
    assert any("hpu_worker" in p for p in check_source(copy))


# -- the runner's own methods against kvlog's defragmenter ----------------------------------


class _Runner:
    """The runner's attributes those methods read: ``defragmenter`` and ``kv_caches``."""

    def __init__(self, kv_caches: Any, defragmenter: Any) -> None:
        self.kv_caches = kv_caches
        self.defragmenter = defragmenter


def _runner_class() -> type:
    assert ROOT is not None
    names = ("run_defragmenter", "_resolve_block", "_resolve_all_blocks")
    real = extract_methods(
        ROOT, FILES[1], "HPUModelRunner", names, {"torch": torch, "itertools": itertools}
    )
    return type("ExtractedRunner", (_Runner,), real)


def _output(new: dict[str, list[int]] | None = None, cached: dict[str, list[int]] | None = None,
            finished: tuple[str, ...] = ()) -> SimpleNamespace:  # fmt: skip
    """A SchedulerOutput of vLLM's shape (one KV-cache group)."""
    cached = cached or {}
    return SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(req_id=r, block_ids=(b,)) for r, b in (new or {}).items()
        ],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=list(cached), new_block_ids=[(b,) for b in cached.values()]
        ),
        finished_req_ids=set(finished),
    )


def _tag(req: str, index: int) -> int:
    return (ord(req) << 16) | index


def test_the_runners_own_methods_run_against_kvlogs_defragmenter() -> None:
    caches = make_hpu_caches(32, BS)
    defrag = gaudi.GaudiDefragmenter(caches, BS, environ={}, backend="cpu", threshold=0)
    runner = _runner_class()(caches, defrag)
    tables: dict[str, list[int]] = {"a": [1, 2, 3], "b": [10, 11], "c": [20, 21, 22, 23]}
    runner.run_defragmenter(_output(new=tables))
    for r, table in tables.items():  # the forward writes each block where the runner resolves
        for i, b in enumerate(table):
            write_canary(caches, BS, runner._resolve_block(b), _tag(r, i))
    runner.run_defragmenter(_output(cached={"c": [24]}, finished=("b",)), warmup_mode=True)
    assert defrag.req_blocks == tables  # warm-up steps change nothing
    write_canary(caches, BS, runner._resolve_block(24), _tag("c", 4))
    tables["c"].append(24)
    del tables["b"]
    runner.run_defragmenter(_output(cached={"c": [24]}, finished=("b",)))
    assert defrag.req_blocks == tables
    assert defrag.last_swap is not None and defrag.last_swap.pairs  # holes at 10, 11 filled
    resolved = runner._resolve_all_blocks(list(tables.values()))
    assert resolved == defrag.resolve_all(list(tables.values()))
    assert max(b for t in resolved for b in t) < 10  # compacted below the freed blocks
    for (r, table), physical in zip(tables.items(), resolved, strict=True):
        for i, b in enumerate(physical):
            assert read_tags(caches, BS, b) == {_tag(r, i)}, (r, i, table[i], b)


def test_the_runners_resolve_without_a_defragmenter_is_the_identity() -> None:
    runner = _runner_class()(make_hpu_caches(8, BS), None)
    assert runner._resolve_block(5) == 5
    assert runner._resolve_all_blocks([[1, 2], [3]]) == [[1, 2], [3]]
    runner.run_defragmenter(_output(new={"a": [1]}))  # no defragmenter: nothing to do

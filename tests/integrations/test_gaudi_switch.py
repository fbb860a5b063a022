"""The Gaudi switch: kvlog's general plugin against stand-ins for vllm-gaudi's modules.

The stand-ins have the shape of ``vllm_gaudi.extension.defragmentation`` (a module with an
``OnlineDefragmenter`` class) and of the HPU model runner's call sites as vllm-gaudi has
them (``from ... import OnlineDefragmenter`` at import; ``OnlineDefragmenter(kv_caches,
block_size)`` in warm-up, ``warmup()``, the instance built again after warm-up;
``run_defragmenter`` first in ``execute_model``, calling ``update_state(new | cached,
finished_req_ids)`` then ``defragment()``). habana_frameworks is not importable here, so the
real modules cannot be; their call sites are copied in shape, not in code.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from kvlog.integrations import OnlineDefragmenter, gaudi
from tests.support.seed_reference import make_hpu_caches

BS = 4
RUNNER_SOURCE = """
from vllm_gaudi.extension.defragmentation import OnlineDefragmenter


def flatten(nested):
    return [b for group in nested for b in group]


class HPUModelRunner:
    def __init__(self, kv_caches, block_size):
        self.kv_caches, self.block_size = kv_caches, block_size
        self.defragmenter = None

    def warmup_model(self):
        self.defragmenter = OnlineDefragmenter(self.kv_caches, self.block_size)
        self.defragmenter.warmup()
        self.defragmenter = OnlineDefragmenter(self.kv_caches, self.block_size)

    def run_defragmenter(self, scheduler_output, warmup_mode=False):
        if not (getattr(self, "defragmenter", None) and self.defragmenter.enabled
                and self.kv_caches and not warmup_mode):
            return
        new = {r.req_id: flatten(r.block_ids) for r in scheduler_output.scheduled_new_reqs
               if r.block_ids}
        cached = {req_id: flatten(ids) for req_id, ids in zip(
            scheduler_output.scheduled_cached_reqs.req_ids,
            scheduler_output.scheduled_cached_reqs.new_block_ids) if ids}
        self.defragmenter.update_state(new | cached, scheduler_output.finished_req_ids)
        self.defragmenter.defragment()

    def execute_model(self, scheduler_output, warmup_mode=False):
        self.run_defragmenter(scheduler_output, warmup_mode)
"""


class SeedStandIn:
    """Stands in for the plugin's class; the switch must replace it everywhere."""

    def __init__(self, *args: Any) -> None:
        raise AssertionError("the plugin's own defragmenter was built")


def _module(name: str, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    return module


@pytest.fixture
def plugin(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("VLLM_DEFRAG_THRESHOLD", "2")
    for name in ("vllm_gaudi", "vllm_gaudi.extension", "vllm_gaudi.v1", "vllm_gaudi.v1.worker"):
        monkeypatch.setitem(sys.modules, name, _module(name))
    defrag = _module(gaudi.DEFRAG_MODULE, OnlineDefragmenter=SeedStandIn)
    monkeypatch.setitem(sys.modules, gaudi.DEFRAG_MODULE, defrag)
    yield


def _runner_module() -> types.ModuleType:
    module = _module(gaudi.RUNNER_MODULES[0])
    sys.modules[module.__name__] = module
    exec(compile(RUNNER_SOURCE, "<hpu_model_runner stand-in>", "exec"), module.__dict__)
    return module


def _output(
    new: dict[str, list[int]] | None = None,
    cached: dict[str, list[int]] | None = None,
    finished: tuple[str, ...] = (),
    resumed: tuple[str, ...] = (),
    preempted: tuple[str, ...] = (),
) -> SimpleNamespace:
    """A SchedulerOutput of vLLM 0.33's shape (one KV-cache group)."""
    cached = cached or {}
    return SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(req_id=r, block_ids=(ids,)) for r, ids in (new or {}).items()
        ],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=list(cached),
            new_block_ids=[(ids,) for ids in cached.values()],
            resumed_req_ids=set(resumed),
        ),
        finished_req_ids=set(finished),
        preempted_req_ids=set(preempted),
    )


@pytest.mark.parametrize("installed_first", [True, False], ids=["plugin-first", "runner-first"])
def test_the_switch_puts_kvlog_at_every_call_site(plugin: None, installed_first: bool) -> None:
    if installed_first:
        gaudi.install([gaudi.DEFRAG_MODULE, gaudi.RUNNER_MODULES[0]])
        runner_module = _runner_module()
    else:
        runner_module = _runner_module()  # imported the plugin's class by name already
        patched = gaudi.install([gaudi.DEFRAG_MODULE, gaudi.RUNNER_MODULES[0]])
        assert f"{gaudi.RUNNER_MODULES[0]}.HPUModelRunner.run_defragmenter" in patched
    runner = runner_module.HPUModelRunner(make_hpu_caches(32, BS), BS)
    runner.warmup_model()
    defrag = runner.defragmenter
    assert isinstance(defrag, gaudi.GaudiDefragmenter) and defrag.threshold == 2
    runner.execute_model(_output(new={"a": [1, 2], "b": [3, 4]}))
    # a is preempted; the scheduler says so (V2 output) and hands 1, 2 to c
    runner.execute_model(_output(new={"c": [1, 2]}, preempted=("a",)))
    # a resumes with a whole new table (V1 output: resumed_req_ids)
    runner.execute_model(_output(cached={"a": [5, 6, 7], "b": [8]}, resumed=("a",)))
    assert defrag.req_blocks == {"a": [5, 6, 7], "b": [3, 4, 8], "c": [1, 2]}
    runner.execute_model(_output(finished=("a", "b", "c")))
    assert defrag.req_blocks == {}


def test_register_does_nothing_unless_asked(plugin: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(gaudi.ENV_ENABLE, raising=False)
    gaudi.register()
    assert sys.modules[gaudi.DEFRAG_MODULE].OnlineDefragmenter is SeedStandIn
    monkeypatch.setenv(gaudi.ENV_ENABLE, "1")
    gaudi.register()
    assert sys.modules[gaudi.DEFRAG_MODULE].OnlineDefragmenter is gaudi.GaudiDefragmenter


def test_the_runner_call_without_the_switch_infers_the_same_tables() -> None:
    """The runner's exact call (no preemption ids): kvlog infers only what is provable."""
    defrag = OnlineDefragmenter(make_hpu_caches(32, BS), BS, environ={}, backend="cpu")
    defrag.update_state({"a": [1, 2], "b": [3, 4]}, [])
    defrag.update_state({"c": [1, 2]}, [])  # a silently preempted: 1, 2 go to c
    defrag.update_state({"a": [5, 6, 7], "b": [8]}, [])  # a resumed: looks like an append
    assert defrag.req_blocks == {"a": [5, 6, 7], "b": [3, 4, 8], "c": [1, 2]}
    defrag.update_state({"d": [6]}, [])  # a lost 6: preempted after the batch that had it
    assert defrag.req_blocks == {"b": [3, 4, 8], "c": [1, 2], "d": [6]}


def test_a_stale_table_never_releases_a_resumed_requests_live_blocks() -> None:
    """The failure seen under the real scheduler: a resumed table disjoint from the stale
    one, then one of the stale blocks handed back to the same request."""
    defrag = OnlineDefragmenter(make_hpu_caches(32, BS), BS, environ={}, backend="cpu")
    defrag.update_state({"r": [10, 11, 12]}, [])
    defrag.update_state({"r": [20, 21]}, [])  # preempted and resumed: disjoint new table
    defrag.update_state({"r": [12]}, [])  # a stale block comes back as a new block
    assert defrag.req_blocks == {"r": [20, 21, 12]}
    used = defrag.used_blocks
    assert all(used.get(defrag.resolve(b)) for b in (20, 21, 12))


def test_a_request_cut_earlier_in_the_same_call_can_be_given_its_kept_block() -> None:
    """Seen under the real scheduler (nopc, bpc 4): S takes a stale block of R, which keeps
    its later batch; R then gets a block of that kept batch back in the same call."""
    defrag = OnlineDefragmenter(make_hpu_caches(32, BS), BS, environ={}, backend="cpu")
    defrag.update_state({"r": [1, 2]}, [])
    defrag.update_state({"r": [3]}, [])
    defrag.update_state({"s": [1], "r": [3, 4]}, [])
    assert defrag.req_blocks == {"r": [3, 4], "s": [1]}

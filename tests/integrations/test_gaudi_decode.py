"""The Gaudi switch's decode hook (``kvlog.integrations.gaudi_decode``) and the facade's
``resolve_table`` under it.

Three layers: ``resolve_table`` against ``resolve`` id by id (every dtype, shape, stride and
id outside the pool); the hook on a stand-in runner (what it hands the method, what it
leaves behind, when it steps aside); and vllm-gaudi's real ``_create_decode_input_data``,
taken out of its source (``../shared/vllm_gaudi``), run patched and unpatched on the same
books: every buffer it builds must be the same.
"""

from __future__ import annotations

import itertools
import logging
import math
import types
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.nn.utils.rnn import pad_sequence

from kvlog.errors import BlockOutOfRange
from kvlog.integrations import gaudi
from kvlog.integrations.gaudi_decode import DECODE_HOOK, decode_columns, patch_decode_inputs
from tests.support.gaudi_source import FILES, extract_methods, source_root
from tests.support.seed_reference import make_hpu_caches

BS = 4
NUM_BLOCKS = 64
TABLES = {"a": [1, 2, 3], "b": list(range(10, 20)), "c": [30, 31, 32, 33, 34], "d": [40, 41]}


def _defragmenter(num_blocks: int = NUM_BLOCKS) -> gaudi.GaudiDefragmenter:
    """kvlog's defragmenter as the switch builds it, on CPU caches, firing on any hole."""
    return gaudi.GaudiDefragmenter(
        make_hpu_caches(num_blocks, BS), BS, environ={}, backend="cpu", threshold=0
    )


def _moved() -> gaudi.GaudiDefragmenter:
    """A defragmenter whose books moved blocks: ``b`` finished, ``c`` and ``d`` compacted."""
    defrag = _defragmenter()
    defrag.update_state(TABLES, ())
    defrag.defragment()
    defrag.update_state({}, ("b",))
    defrag.defragment()
    assert defrag.last_swap is not None and defrag.last_swap.pairs
    return defrag


def _by_id(defrag: gaudi.GaudiDefragmenter, ids: np.ndarray) -> np.ndarray:
    out: np.ndarray = np.vectorize(lambda b: defrag.resolve(int(b)), otypes=[np.int64])(ids)
    return out


# -- resolve_table -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.int16])
@pytest.mark.parametrize("kind", ["tensor", "numpy"])
def test_resolve_table_is_resolve_over_every_id(dtype: Any, kind: str) -> None:
    defrag = _moved()
    rng = np.random.default_rng(7)
    whole = rng.integers(-2, NUM_BLOCKS + 3, size=(6, 9)).astype(dtype)
    whole[0, :4] = [-1, NUM_BLOCKS, NUM_BLOCKS + 2, 0]
    for ids in (whole, whole[:4, :5], whole[1:, ::2], whole[2], whole[:, 3], whole[:0, :3]):
        before = ids.copy()
        table = torch.from_numpy(ids) if kind == "tensor" else ids
        out = defrag.resolve_table(table)
        assert type(out) is type(table) and out is not table
        got = out.numpy() if isinstance(out, torch.Tensor) else out
        assert got.dtype == ids.dtype and got.shape == ids.shape
        assert np.array_equal(got, _by_id(defrag, ids).astype(dtype).reshape(ids.shape))
        assert np.array_equal(ids, before)  # the caller's table is never written
    moved = [b for t in ("a", "c", "d") for b in TABLES[t] if defrag.resolve(b) != b]
    assert moved  # the books did move blocks: the comparison above is not the identity


@pytest.mark.parametrize(
    "bad", [torch.zeros((2, 2)), np.zeros((2, 2), bool), np.zeros((1, 2, 2), np.int32)]
)
def test_resolve_table_refuses_what_is_not_an_id_table(bad: Any) -> None:
    with pytest.raises(BlockOutOfRange, match="1-D or 2-D integer array"):
        _moved().resolve_table(bad)


def test_resolve_table_refuses_a_dtype_narrower_than_the_pool() -> None:
    defrag = _defragmenter(300)
    defrag.update_state({"a": [1, 2]}, ())
    defrag.defragment()
    with pytest.raises(BlockOutOfRange, match="int8 cannot hold the ids of a 300-block pool"):
        defrag.resolve_table(np.array([[1, 2]], dtype=np.int8))
    assert defrag.resolve_table(np.array([[1, 2]], dtype=np.uint16)).tolist() == [[1, 2]]


def test_resolve_table_refuses_a_tensor_off_the_cpu() -> None:
    with pytest.raises(BlockOutOfRange, match="on the CPU, not meta"):
        _moved().resolve_table(torch.empty((2, 2), dtype=torch.int32, device="meta"))


@pytest.mark.parametrize(("rows", "columns"), [(2, 3), (None, 4), (5, None), (9, 99), (0, 2)])
def test_resolve_table_bounds_are_the_leading_rows_and_columns(rows: Any, columns: Any) -> None:
    defrag = _moved()
    whole = torch.from_numpy(np.arange(5 * 8, dtype=np.int32).reshape(5, 8) % NUM_BLOCKS)
    out = defrag.resolve_table(whole, rows, columns)
    assert torch.equal(out, defrag.resolve_table(whole[:rows, :columns]))
    assert out.shape == whole[:rows, :columns].shape
    with pytest.raises(BlockOutOfRange, match="bound a 2-D table"):
        defrag.resolve_table(whole[0], 1, 1)


def test_resolve_table_before_the_books_start_copies() -> None:
    defrag = gaudi.GaudiDefragmenter(None, BS, environ={}, backend="cpu")
    table = torch.tensor([[3, 4], [5, -1]], dtype=torch.int32)
    out = defrag.resolve_table(table)
    assert torch.equal(out, table) and out.data_ptr() != table.data_ptr()


def test_decode_columns_cover_each_decodes_last_token() -> None:
    # context 7, 1 token: position 7 -> block 1 (2 columns); context 8, 2 tokens: 8, 9 -> 2
    assert decode_columns(np.array([7, 8]), [1, 2], 4) == 3
    assert decode_columns(np.array([3]), [1], 4) == 1
    assert decode_columns(np.array([4]), [1], 4) == 2
    assert decode_columns(np.array([], np.int64), [], 4) == 0
    assert decode_columns([8, 1], [1, 3], 4) == 3  # 8 + 3 tokens: one column past the need


# -- the hook on a stand-in runner ---------------------------------------------------------


class _StandIn:
    """What the hook needs of vllm-gaudi's runner: the two resolvers and the method."""

    attn_block_size = BS

    def __init__(self, defragmenter: Any) -> None:
        self.defragmenter = defragmenter
        self.seen: list[Any] = []

    def _resolve_block(self, block_id: int) -> int:
        return self.defragmenter.resolve(block_id) if self.defragmenter else block_id

    def _resolve_all_blocks(self, tables: list[list[int]]) -> list[list[int]]:
        return self.defragmenter.resolve_all(tables) if self.defragmenter else tables

    def _create_decode_input_data(
        self, num_decodes: int, num_scheduled_tokens: list[int], context_lens: Any,
        block_table_cpu_tensor: torch.Tensor, scheduler_output: Any = None,
    ) -> tuple[list[int], list[list[int]]]:  # fmt: skip
        """The method's resolves, in its shape: each decode's slot block, then its table."""
        self.seen.append((block_table_cpu_tensor, self._resolve_block))
        if scheduler_output == "raise":
            raise RuntimeError("the runner's own failure")
        table = torch.as_tensor(block_table_cpu_tensor)
        lens = [-(-(int(c) + 1) // BS) for c in context_lens[:num_decodes]]
        slots = torch.tensor([int(c) // BS for c in context_lens[:num_decodes]], dtype=torch.int64)
        blocks = torch.gather(table[:num_decodes], 1, slots.view(-1, 1))
        blocks.apply_(self._resolve_block)
        tables = [table[i, :n].tolist() for i, n in enumerate(lens)]
        return blocks.view(-1).tolist(), self._resolve_all_blocks(tables)


def _patched_class() -> type:
    module = types.ModuleType("stand_in_runner")
    own = {DECODE_HOOK: _StandIn._create_decode_input_data}  # the class defines the hook
    module.HPUModelRunner = type("HPUModelRunner", (_StandIn,), own)  # type: ignore[attr-defined]
    assert patch_decode_inputs(module) == [f"stand_in_runner.HPUModelRunner.{DECODE_HOOK}"]
    assert patch_decode_inputs(module) == []  # once
    return module.HPUModelRunner  # type: ignore[no-any-return]


def _batch() -> tuple[torch.Tensor, np.ndarray]:
    """An input batch's block-table tensor (rows a, c, d, then a stale row) and contexts."""
    table = torch.zeros((5, 12), dtype=torch.int32)
    for i, r in enumerate(("a", "c", "d")):
        table[i, : len(TABLES[r])] = torch.tensor(TABLES[r])
    table[3, :4] = torch.tensor([10, 11, 12, 13])  # a stale row past the decodes
    return table, np.array([9, 17, 5])  # each decode's last token in its last block


def test_the_hook_resolves_the_decode_rows_once_and_restores_the_runner() -> None:
    defrag = _moved()
    table, contexts = _batch()
    before = table.clone()
    plain, patched = _StandIn(defrag), _patched_class()(defrag)
    want = plain._create_decode_input_data(3, [1, 1, 1], contexts, table)
    assert patched._create_decode_input_data(3, [1, 1, 1], contexts, table) == want
    handed, resolver = patched.seen[0]
    assert resolver is int and handed.shape == (3, 5)  # ceil(18 / 4) columns
    assert torch.equal(handed, torch.from_numpy(_by_id(defrag, before[:3, :5].numpy())).int())
    assert torch.equal(table, before)
    assert "_resolve_block" not in vars(patched) and "_resolve_all_blocks" not in vars(patched)
    with pytest.raises(RuntimeError, match="own failure"):
        patched._create_decode_input_data(3, [1, 1, 1], contexts, table, "raise")
    assert "_resolve_block" not in vars(patched) and "_resolve_all_blocks" not in vars(patched)


@pytest.mark.parametrize(
    "case", ["no defragmenter", "another defragmenter", "no decodes", "overridden", "numpy table"]
)
def test_the_hook_steps_aside_where_it_cannot_know(case: str) -> None:
    defrag: Any = _moved()
    table, contexts = _batch()
    num_decodes = 3
    if case == "no defragmenter":
        defrag = None
    elif case == "another defragmenter":
        defrag = SimpleNamespace(resolve=lambda b: b, resolve_all=lambda t: t)
    elif case == "no decodes":
        num_decodes = 0
    if case == "numpy table":
        table = table.numpy()  # type: ignore[assignment]
    runner = _patched_class()(defrag)
    if case == "overridden":
        runner._resolve_block = runner._resolve_block  # someone else's per-instance resolver
    args = (num_decodes, [1] * 3, contexts, table)
    want = _StandIn(defrag)._create_decode_input_data(*args) if num_decodes else ([], [])
    assert runner._create_decode_input_data(*args) == want
    assert runner.seen[0][0] is table  # the runner's own tensor, its own resolves


def test_a_table_narrower_than_a_decode_needs_fails_as_the_runners_own_path_does() -> None:
    defrag = _moved()
    table, contexts = _batch()
    args = (3, [1] * 3, contexts, table[:, :4])  # row c needs 5 columns
    for runner in (_patched_class()(defrag), _StandIn(defrag)):
        with pytest.raises(RuntimeError, match="out of bounds"):
            runner._create_decode_input_data(*args)


def test_a_hook_of_another_shape_is_left_alone(caplog: pytest.LogCaptureFixture) -> None:
    def other(self: Any, num_decodes: int, block_table: Any) -> None: ...

    module = types.ModuleType("other_runner")
    module.Runner = type("Runner", (_StandIn,), {DECODE_HOOK: other})  # type: ignore[attr-defined]
    with caplog.at_level(logging.WARNING):
        assert patch_decode_inputs(module) == []
    assert "resolved id by id" in caplog.text
    assert vars(module.Runner)[DECODE_HOOK] is other


def test_the_switch_installs_the_hook() -> None:
    module = types.ModuleType("vllm_gaudi.v1.worker.hpu_model_runner")
    own = {DECODE_HOOK: _StandIn._create_decode_input_data}
    module.HPUModelRunner = type("HPUModelRunner", (_StandIn,), own)  # type: ignore[attr-defined]
    import sys

    sys.modules[module.__name__] = module
    try:
        patched = gaudi.install([module.__name__])
    finally:
        del sys.modules[module.__name__]
    assert f"{module.__name__}.HPUModelRunner.{DECODE_HOOK}" in patched


# -- vllm-gaudi's own method -----------------------------------------------------------------

ROOT = source_root()
_NAMES = (DECODE_HOOK, "get_habana_paged_attn_buffers", "_resolve_block", "_resolve_all_blocks")


def _h2d(source: Any, device: Any = None, dtype: Any = None) -> torch.Tensor | None:
    """``vllm_gaudi.utils.async_h2d_copy`` on a CPU "device": a copy."""
    return None if source is None else torch.as_tensor(source, dtype=dtype).clone()


def _pad_list(values: list[Any], length: int, pad: Any) -> list[Any]:
    return values + list(itertools.islice(pad, length - len(values)))


def _real_runner(defrag: Any, contiguous: bool, window: bool) -> tuple[Any, Any]:
    """vllm-gaudi's ``HPUModelRunner`` methods that build a decode's inputs, unpatched and
    patched, on stand-in attributes (a CPU device, two pad rows, no mrope or mamba)."""
    assert ROOT is not None
    namespace: dict[str, Any] = {
        "np": np, "torch": torch, "itertools": itertools, "math": math,
        "pad_sequence": pad_sequence,
        "async_h2d_copy": _h2d, "pad_list": _pad_list, "logger": logging.getLogger("extract"),
        "DecodeInputData": SimpleNamespace,
        "HPUAttentionMetadataV1": SimpleNamespace(make_decode_metadata=SimpleNamespace),
    }  # fmt: skip
    real = extract_methods(ROOT, FILES[1], "HPUModelRunner", _NAMES, namespace)
    buckets = SimpleNamespace(find_decode_bucket=lambda b, n, seek=False: (b + 2, 0, n + 3))
    attrs = {
        "attn_block_size": BS, "bucketing_manager": buckets, "_PAD_BLOCK_ID": NUM_BLOCKS,
        "uses_mrope": False, "pin_memory": False, "device": "cpu", "use_contiguous_pa": contiguous,
        "interleaved_sliding_window": window, "sliding_window": 2 * BS,
        "model_has_chunked_attention": False, "num_mamba_like_layers": 0,
        "use_async_scheduling": False, "model_config": SimpleNamespace(dtype=torch.float32),
        "get_dp_padding": lambda self, n: 0, "_get_model_type": lambda self: None,
    }  # fmt: skip
    plain = type("HPUModelRunner", (), {**attrs, **real})
    module = types.ModuleType("extracted_runner")
    module.HPUModelRunner = type("HPUModelRunner", (plain,), {DECODE_HOOK: real[DECODE_HOOK]})  # type: ignore[attr-defined]
    assert patch_decode_inputs(module)
    return plain(), module.HPUModelRunner()  # type: ignore[attr-defined]


def _same(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, SimpleNamespace):
        assert vars(a).keys() == vars(b).keys(), where
        for k in vars(a):
            _same(getattr(a, k), getattr(b, k), f"{where}.{k}")
    else:
        assert a == b, where


@pytest.mark.skipif(ROOT is None, reason="vllm-gaudi's source is not at ../shared/vllm_gaudi")
@pytest.mark.parametrize("tokens", [1, 2])
@pytest.mark.parametrize(("contiguous", "window"), [(False, False), (True, False), (False, True)])
def test_vllm_gaudis_decode_inputs_are_the_same_patched(
    tokens: int, contiguous: bool, window: bool
) -> None:
    defrag = _moved()
    table, contexts = _batch()
    contexts = contexts - (tokens - 1)  # the last token still in the last block
    before = table.clone()
    runs: list[Any] = []
    for runner in _real_runner(defrag, contiguous, window):
        runner.defragmenter = defrag
        positions = np.concatenate([c + np.arange(tokens) for c in contexts])
        runner.positions_cpu = torch.from_numpy(positions)
        runner.input_ids_cpu = torch.arange(100, 100 + 3 * tokens, dtype=torch.int32)
        runs.append(runner._create_decode_input_data(3, [tokens] * 3, contexts, table))
    _same(runs[0], runs[1], "DecodeInputData")
    assert torch.equal(table, before)
    meta = runs[0].attn_metadata
    logical = [int(table[i, (c + j) // BS]) for i, c in enumerate(contexts) for j in range(tokens)]
    got = (meta.slot_mapping.view(-1)[: 3 * tokens] // BS).tolist()
    assert got == [defrag.resolve(b) for b in logical] != logical


@st.composite
def _decode_batches(draw: st.DrawFn) -> tuple[list[list[int]], int, int, int]:
    """Random books and a decode batch: tables (distinct ids in a 64-block pool, some
    finished before the batch so that defrag moved blocks), each decode's context within
    its table, tokens a decode, and how many decodes of the live tables run."""
    ids = draw(st.permutations(range(1, NUM_BLOCKS)))
    lengths = draw(st.lists(st.integers(1, 6), min_size=2, max_size=8))
    tables, at = [], 0
    for n in lengths:
        if at + n > len(ids):
            break
        tables.append(list(ids[at : at + n]))
        at += n
    tokens = draw(st.integers(1, 3))
    finished = draw(st.integers(0, len(tables) - 1))
    extra = draw(st.integers(0, 3))  # table columns past the longest table
    return tables, tokens, finished, extra


@pytest.mark.skipif(ROOT is None, reason="vllm-gaudi's source is not at ../shared/vllm_gaudi")
@given(batch=_decode_batches(), contiguous=st.booleans())
def test_vllm_gaudis_decode_inputs_are_the_same_patched_on_any_books(
    batch: tuple[list[list[int]], int, int, int], contiguous: bool
) -> None:
    tables, tokens, finished, extra = batch
    defrag = _defragmenter()
    named = {f"r{i}": t for i, t in enumerate(tables)}
    defrag.update_state(named, ())
    defrag.defragment()
    gone = [f"r{i}" for i in range(finished)]
    defrag.update_state({}, gone)
    defrag.defragment()  # the finished tables' holes filled from the top
    live = [t for r, t in named.items() if r not in gone]
    width = max(map(len, live)) + extra
    table = torch.zeros((len(live) + 1, width), dtype=torch.int32)
    for i, t in enumerate(live):
        table[i, : len(t)] = torch.tensor(t)
    # each decode's last token in its table's last block
    contexts = np.array([len(t) * BS - tokens - (i % BS if tokens == 1 else 0)
                         for i, t in enumerate(live)])  # fmt: skip
    contexts = np.maximum(contexts, 0)
    runs = []
    for runner in _real_runner(defrag, contiguous, window=False):
        runner.defragmenter = defrag
        positions = np.concatenate([c + np.arange(tokens) for c in contexts])
        runner.positions_cpu = torch.from_numpy(positions)
        runner.input_ids_cpu = torch.arange(len(positions), dtype=torch.int32)
        runs.append(
            runner._create_decode_input_data(len(live), [tokens] * len(live), contexts, table)
        )
    _same(runs[0], runs[1], "DecodeInputData")

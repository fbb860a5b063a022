"""Cache layouts: canonical views, page sizes, pad blocks, aliasing, and clear LayoutErrors."""

from __future__ import annotations

import pytest
import torch

from kvlog.errors import LayoutError
from kvlog.executors import make_executor, register_layout
from tests.support.executor_helpers import config_for

N, BS = 10, 4


def test_hpu_layout_is_slot_major_with_a_pad_block_and_fp8_scales() -> None:
    key = torch.zeros((N + 1) * BS, 2, 8, dtype=torch.float8_e4m3fn)
    value = torch.zeros_like(key)
    key_scale = torch.zeros((N + 1) * BS, 2)  # slot-major, like the key
    value_scale = torch.zeros(N + 1)  # per block
    layout = register_layout([(key, value, key_scale, value_scale)], N, BS, "hpu")
    assert [t.kind for t in layout.tensors] == [
        "slot_major",
        "slot_major",
        "slot_major",
        "block_major",
    ]
    assert [t.page_bytes for t in layout.tensors] == [BS * 16, BS * 16, BS * 8, 4]
    assert layout.page_size_bytes == BS * 16 * 2 + BS * 8 + 4
    assert (layout.has_pad_block, layout.pad_block_id, layout.num_block_rows) == (True, N, N + 1)
    view = layout.tensors[0].view
    assert view.data_ptr() == key.data_ptr() and view.shape == (N + 1, BS * 16)


def test_block_major_vllm_and_state_layouts_have_no_pad_block() -> None:
    block_major = torch.zeros(N, BS, 2, 4, dtype=torch.bfloat16)
    vllm = torch.zeros(2, N, BS, 2, 4, dtype=torch.float16)
    state = torch.zeros(N, 7, dtype=torch.float32)
    layout = register_layout([(block_major, None, state), vllm], N, BS)
    assert [t.name for t in layout.tensors] == [
        "layer 0 key",
        "layer 0 scale 0",
        "layer 1 key",
        "layer 1 value",
    ]
    assert [t.page_bytes for t in layout.tensors] == [BS * 16, 28, BS * 16, BS * 16]
    assert (layout.has_pad_block, layout.pad_block_id, layout.num_block_rows) == (False, 0, N)
    assert layout.tensors[3].view.data_ptr() == vllm[1].data_ptr()


def test_mixed_pad_rows_fall_back_to_block_zero() -> None:
    with_pad = torch.zeros((N + 1) * BS, 8)
    without_pad = torch.zeros(N, BS, 8)
    layout = register_layout([(with_pad, without_pad)], N, BS)
    assert (layout.has_pad_block, layout.pad_block_id) == (False, 0)


def test_dict_of_layers_and_aliases_are_registered_once() -> None:
    shared = torch.zeros(N, BS, 8)
    layout = register_layout({"a": (shared, shared), "b": shared.view(N, -1)}, N, BS)
    assert [t.name for t in layout.tensors] == ["a key"]
    assert layout.page_size_bytes == BS * 8 * 4


def test_vllm_pair_needs_the_explicit_layout_when_two_blocks_make_it_ambiguous() -> None:
    tensor = torch.zeros(2, 2, BS, 8)
    assert [t.name for t in register_layout([tensor], 2, BS).tensors] == ["layer 0"]
    names = [t.name for t in register_layout([tensor], 2, BS, "vllm").tensors]
    assert names == ["layer 0 key", "layer 0 value"]


@pytest.mark.parametrize(
    ("layers", "layout", "message"),
    [
        ([], "auto", "empty"),
        ([(torch.zeros(N + 3, 8),)], "auto", r"first dimension 13 .* fits no 'auto' layout"),
        ([(torch.zeros(N, BS, 8),)], "hpu", r"\(num_gpu_blocks \+ 1\) \* block_size"),
        ([(torch.zeros(N * BS, 8),)], "hpu", "needs the pad block"),
        ([(torch.zeros((N + 1) * BS, 8),)], "block_major", r"expected 10 or 11 blocks"),
        ([torch.zeros(N, BS, 8)], "vllm", r"layout 'vllm' needs \(2, 10, \.\.\.\)"),
        ([(torch.zeros(8, N).t(),)], "auto", "not contiguous"),
        ([(None, torch.zeros(N, 8))], "auto", "must not be None"),
        ([(torch.zeros(N, 8), "value")], "auto", "expected a tensor or None"),
        ([(torch.zeros(N, 0),)], "auto", "empty or 0-dimensional"),
        ([(torch.zeros(N, 8),)], "paged", "unknown layout 'paged'"),
        ([42], "auto", "expected a tensor or a tuple"),
    ],
)
def test_bad_layouts_raise_clear_layout_errors(
    layers: list[object], layout: str, message: str
) -> None:
    with pytest.raises(LayoutError, match=message):
        register_layout(layers, N, BS, layout)  # type: ignore[arg-type]


def test_partially_overlapping_tensors_are_refused() -> None:
    storage = torch.zeros((N + 1) * 8)
    first, second = storage[: N * 8].view(N, 8), storage[8:].view(N, 8)
    with pytest.raises(LayoutError, match="overlaps layer 0 key partially"):
        register_layout([(first,), (second,)], N, BS)


def test_a_single_tensor_is_not_a_list_of_layers() -> None:
    with pytest.raises(LayoutError, match="list"):
        register_layout(torch.zeros(N, 8), N, BS)  # type: ignore[arg-type]


def test_make_executor_checks_page_size_bytes_and_device() -> None:
    layers = [(torch.zeros(N, BS, 8), torch.zeros(N, BS, 8))]
    page = 2 * BS * 8 * 4
    executor = make_executor(layers, config_for(N, BS, page_size_bytes=page))
    assert executor.page_size_bytes == page and executor.backend == "cpu"
    with pytest.raises(LayoutError, match=f"page_size_bytes={page + 1} but .* hold {page}"):
        make_executor(layers, config_for(N, BS, page_size_bytes=page + 1))
    meta = [(torch.zeros(N, BS, 8, device="meta"),)]
    with pytest.raises(LayoutError, match="backend 'cpu' needs KV-cache tensors on 'cpu'"):
        make_executor(meta, config_for(N, BS))

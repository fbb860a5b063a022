"""KV-cache layouts, described once and reduced to canonical per-block byte views.

Every registered tensor becomes a *canonical view*: a contiguous 2-D ``int8`` view
``(num_block_rows, page_bytes)`` of the same storage, in which row ``b`` holds every byte of
block ``b`` in that tensor. Executors only ever index rows of canonical views, so one copy
routine serves every layout:

``slot_major`` (the HPU layout of the seed)
    first dimension ``num_blocks * block_size``, usually with one trailing pad block, i.e.
    ``(num_gpu_blocks + 1) * block_size``; block ``b`` is the ``block_size`` consecutive
    slots ``b * block_size ...``, which are contiguous, so the view is free.
``block_major``
    first dimension ``num_gpu_blocks`` (or ``+ 1`` with a pad block), e.g. ``(num_blocks,
    block_size, heads, head_size)``. Per-block state caches (first dimension = blocks) and
    per-block FP8 scale tensors are block-major too: they move per block and are never
    indexed per slot.
``vllm``
    one tensor per layer of shape ``(2, num_blocks, ...)``: key ``[0]`` and value ``[1]``
    become two canonical views.

A layer is a tensor or a tuple ``(key, value, *scales)``; ``value`` (MLA) and scales may be
``None``. Scale tensors may be slot-major like the key or per-block. Tensors that alias each
other (the same tensor twice, or views of the same bytes) are registered once; tensors that
overlap only partially, are not contiguous, are empty, live on different devices or have a
first dimension that fits no layout raise :class:`~kvlog.errors.LayoutError`.

The pad block: when every canonical view has ``num_gpu_blocks + 1`` rows, row
``num_gpu_blocks`` is the pad block and padded swap entries copy it onto itself. Otherwise
padded entries copy block 0 onto itself, which is safe because defrag never uses block 0 as
a source or a destination (free blocks are searched from 1 upwards).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, TypeAlias

import torch

from kvlog.errors import LayoutError

__all__ = [
    "LAYOUTS",
    "CacheLayout",
    "CanonicalTensor",
    "KVCaches",
    "LayerCache",
    "LayoutName",
    "register_layout",
]

LayoutName: TypeAlias = Literal["auto", "hpu", "block_major", "vllm"]
LAYOUTS: tuple[str, ...] = ("auto", "hpu", "block_major", "vllm")
LayerCache: TypeAlias = "torch.Tensor | Sequence[torch.Tensor | None]"
KVCaches: TypeAlias = "Sequence[LayerCache] | Mapping[str, LayerCache]"


@dataclass(frozen=True)
class CanonicalTensor:
    """One registered tensor as ``(num_block_rows, page_bytes)`` int8 rows, one per block."""

    name: str
    kind: str
    view: torch.Tensor

    @property
    def num_block_rows(self) -> int:
        return int(self.view.shape[0])

    @property
    def page_bytes(self) -> int:
        return int(self.view.shape[1])


@dataclass(frozen=True)
class CacheLayout:
    """The canonical views of a whole KV cache, deduplicated, in registration order."""

    tensors: tuple[CanonicalTensor, ...]
    num_gpu_blocks: int
    block_size: int
    device: torch.device

    @functools.cached_property
    def page_size_bytes(self) -> int:
        """Bytes of one GPU block over every canonical view (compare ``page_size_bytes``)."""
        return sum(t.page_bytes for t in self.tensors)

    @functools.cached_property
    def has_pad_block(self) -> bool:
        """Whether every view has a row past the pool (read once: the views' shapes are
        fixed at registration, and a swap plan's check asks on every step, where a pass
        over an 80-layer model's 160 views cost 35 us)."""
        return all(t.num_block_rows == self.num_gpu_blocks + 1 for t in self.tensors)

    @property
    def pad_block_id(self) -> int:
        """The block that padded swap entries copy onto itself (see the module docstring)."""
        return self.num_gpu_blocks if self.has_pad_block else 0

    @property
    def num_block_rows(self) -> int:
        """Addressable block ids: ``num_gpu_blocks``, plus the pad block where there is one."""
        return self.num_gpu_blocks + (1 if self.has_pad_block else 0)


def register_layout(
    kv_caches: KVCaches, num_gpu_blocks: int, block_size: int, layout: str = "auto"
) -> CacheLayout:
    """Check ``kv_caches`` against ``layout`` and build their canonical views."""
    if layout not in LAYOUTS:
        raise LayoutError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
    if num_gpu_blocks < 1 or block_size < 1:
        raise LayoutError(f"num_gpu_blocks={num_gpu_blocks}, block_size={block_size} must be >= 1")
    layers = _named_layers(kv_caches)
    if not layers:
        raise LayoutError("kv_caches is empty: register at least one layer")
    shape = _Geometry(num_gpu_blocks, block_size, layout)
    views: list[CanonicalTensor] = []
    for layer_name, layer in layers:
        views.extend(_layer_views(layer_name, layer, shape))
    tensors = _deduplicate(views)
    devices = {t.view.device for t in tensors}
    if len(devices) != 1:
        raise LayoutError(f"KV-cache tensors live on several devices: {sorted(map(str, devices))}")
    return CacheLayout(tuple(tensors), num_gpu_blocks, block_size, devices.pop())


@dataclass(frozen=True)
class _Geometry:
    num_gpu_blocks: int
    block_size: int
    layout: str

    @property
    def block_rows(self) -> tuple[int, int]:
        return (self.num_gpu_blocks, self.num_gpu_blocks + 1)

    @property
    def slot_rows(self) -> tuple[int, int]:
        return (self.num_gpu_blocks * self.block_size, (self.num_gpu_blocks + 1) * self.block_size)

    def expected(self) -> str:
        n, bs = self.num_gpu_blocks, self.block_size
        return (
            f"num_gpu_blocks={n} or {n + 1} rows (block-major, per-block state or scale), "
            f"{n * bs} or {(n + 1) * bs} slots (slot-major, block_size={bs}), "
            f"or (2, {n} or {n + 1}, ...) (vLLM key/value)"
        )


def _named_layers(kv_caches: KVCaches) -> list[tuple[str, LayerCache]]:
    if isinstance(kv_caches, torch.Tensor):
        raise LayoutError("kv_caches must be a list (or dict) of layers, not one tensor")
    if isinstance(kv_caches, Mapping):
        return [(str(name), layer) for name, layer in kv_caches.items()]
    return [(f"layer {i}", layer) for i, layer in enumerate(kv_caches)]


def _layer_views(name: str, layer: LayerCache, shape: _Geometry) -> list[CanonicalTensor]:
    """Canonical views of one layer: a bare tensor or ``(key, value, *scales)``."""
    if isinstance(layer, torch.Tensor):
        if _is_vllm_pair(layer, shape):
            _check_contiguous(f"{name} key/value", layer)
            return [
                _canonical(f"{name} key", layer[0], shape, "vllm"),
                _canonical(f"{name} value", layer[1], shape, "vllm"),
            ]
        if shape.layout == "vllm":
            raise LayoutError(
                f"{name}: layout 'vllm' needs (2, {shape.num_gpu_blocks}, ...) per layer, "
                f"got shape {tuple(layer.shape)}"
            )
        return [_canonical(name, layer, shape, "tensor")]
    if not isinstance(layer, Sequence) or isinstance(layer, str | bytes):
        raise LayoutError(f"{name}: expected a tensor or a tuple of tensors, got {type(layer)}")
    if len(layer) == 0 or layer[0] is None:
        raise LayoutError(f"{name}: the first tensor of a layer (the key) must not be None")
    roles = ["key", "value", *(f"scale {i}" for i in range(len(layer)))][: len(layer)]
    views = []
    for role, tensor in zip(roles, layer, strict=True):
        if tensor is None:
            continue  # MLA (value None) or an absent scale
        if not isinstance(tensor, torch.Tensor):
            raise LayoutError(f"{name} {role}: expected a tensor or None, got {type(tensor)}")
        views.append(_canonical(f"{name} {role}", tensor, shape, role))
    return views


def _is_vllm_pair(tensor: torch.Tensor, shape: _Geometry) -> bool:
    """A ``(2, num_blocks, ...)`` tensor; with ``auto`` only where the first dim is unambiguous."""
    if tensor.ndim < 2 or tensor.shape[0] != 2 or tensor.shape[1] not in shape.block_rows:
        return False
    return shape.layout == "vllm" or (
        shape.layout == "auto" and 2 not in shape.block_rows + shape.slot_rows
    )


def _canonical(name: str, tensor: torch.Tensor, shape: _Geometry, role: str) -> CanonicalTensor:
    _check_contiguous(name, tensor)
    if tensor.ndim == 0 or tensor.numel() == 0:
        raise LayoutError(f"{name}: empty or 0-dimensional tensor of shape {tuple(tensor.shape)}")
    first = int(tensor.shape[0])
    is_scale = role.startswith("scale")
    if first in shape.block_rows and (shape.layout != "hpu" or is_scale or shape.block_size == 1):
        kind, num_rows = "block_major", first
    elif first in shape.slot_rows and shape.layout not in ("block_major", "vllm"):
        kind, num_rows = "slot_major", first // shape.block_size
    else:
        wanted = _wanted(shape, is_scale)
        raise LayoutError(
            f"{name}: first dimension {first} (shape {tuple(tensor.shape)}) fits no "
            f"{shape.layout!r} layout; expected {wanted}"
        )
    if shape.layout == "hpu" and not is_scale and num_rows != shape.num_gpu_blocks + 1:
        raise LayoutError(
            f"{name}: layout 'hpu' needs the pad block, first dimension "
            f"{shape.slot_rows[1]} = (num_gpu_blocks + 1) * block_size, got {first}"
        )
    view = tensor.view(torch.int8).view(num_rows, -1)
    return CanonicalTensor(name=name, kind=kind, view=view)


def _wanted(shape: _Geometry, is_scale: bool) -> str:
    n, bs = shape.num_gpu_blocks, shape.block_size
    if shape.layout == "hpu" and not is_scale:
        return f"{(n + 1) * bs} = (num_gpu_blocks + 1) * block_size slots"
    if shape.layout in ("block_major", "vllm"):
        return f"{n} or {n + 1} blocks"
    return shape.expected()


def _check_contiguous(name: str, tensor: torch.Tensor) -> None:
    if not tensor.is_contiguous():
        raise LayoutError(
            f"{name}: tensor of shape {tuple(tensor.shape)} and strides {tensor.stride()} is not "
            "contiguous; kvlog moves blocks in place and will not copy it silently"
        )


def _deduplicate(views: list[CanonicalTensor]) -> list[CanonicalTensor]:
    """Drop views of the same bytes (aliased layers); refuse partial overlaps."""
    kept: list[CanonicalTensor] = []
    spans: list[tuple[torch.device, int, int, tuple[int, ...]]] = []
    for view in views:
        tensor = view.view
        start = tensor.data_ptr()
        end = start + tensor.numel()
        key = (tensor.device, start, end, tuple(tensor.shape))
        if key in spans:
            continue
        for other, (device, other_start, other_end, _) in zip(kept, spans, strict=True):
            if device == tensor.device and start < other_end and other_start < end:
                raise LayoutError(
                    f"{view.name} overlaps {other.name} partially (bytes {start:#x}-{end:#x} "
                    f"vs {other_start:#x}-{other_end:#x}); aliased tensors must match exactly"
                )
        kept.append(view)
        spans.append(key)
    return kept

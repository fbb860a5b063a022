"""A cost model for what-ifs: what a step's KV-cache layout and data movement cost in time.

With contiguous paged attention on Gaudi the decode block list is indexed by physical block
id, so a decode step reads the KV of every block up to the highest used one: decode work
grows with ``max_used``, not with the blocks in use. Defragmentation and transfers cost the
bytes they move. Per step:

- ``decode_s = (max_used + 1) * page_size_bytes / hbm_bytes_per_s``;
- ``defrag_s = padded_to * page_size_bytes * k * 2 / hbm_bytes_per_s``: a ``"move"`` pair
  (k = 1) reads one page and writes one, a ``"swap"`` pair (k = 2) both ways; a graph-captured
  swap copies all ``padded_to`` pairs of its pad bucket, the dummy ones included;
- ``transfer_s = max(store_bytes, load_bytes) / link_bytes_per_s``: the host link carries
  both directions at once;
- ``step_s = decode_s + defrag_s + transfer_s``: nothing overlaps (an upper bound: in a real
  server async stores hide behind compute).

Constants (override any of them): HBM bandwidth of Gaudi 2 ``2.46e12`` B/s and Gaudi 3
``3.67e12`` B/s; host link PCIe Gen5 x16, about ``63e9`` B/s each way. Only differences
between policies on the same log mean much: the model leaves out compute, which no
defrag policy changes.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlog.errors import ConfigError
from kvlog.events import pair_bytes

__all__ = [
    "GAUDI2_HBM_BYTES_PER_S",
    "GAUDI3_HBM_BYTES_PER_S",
    "HARDWARE",
    "PCIE_GEN5_X16_BYTES_PER_S",
    "CostModel",
    "cost_model",
]

GAUDI2_HBM_BYTES_PER_S = 2.46e12
GAUDI3_HBM_BYTES_PER_S = 3.67e12
PCIE_GEN5_X16_BYTES_PER_S = 63e9


@dataclass(frozen=True)
class CostModel:
    """Bandwidths that turn a step's bytes into seconds (see the module docstring)."""

    name: str = "gaudi2"
    hbm_bytes_per_s: float = GAUDI2_HBM_BYTES_PER_S
    link_bytes_per_s: float = PCIE_GEN5_X16_BYTES_PER_S

    def decode_s(self, max_used: int, page_size_bytes: int) -> float:
        """KV read by one decode step under contiguous paged attention."""
        return (max_used + 1) * page_size_bytes / self.hbm_bytes_per_s

    def defrag_s(self, padded_pairs: int, page_size_bytes: int, swap: bool) -> float:
        """HBM traffic of one step's defrag plan (``padded_pairs`` = its ``padded_to``):
        every byte a pair moves is read once and written once."""
        moved = pair_bytes(page_size_bytes, "swap" if swap else "move")
        return padded_pairs * 2 * moved / self.hbm_bytes_per_s

    def transfer_s(self, store_bytes: int, load_bytes: int) -> float:
        """Host-link time of one step's stores and loads (both directions at once)."""
        return max(store_bytes, load_bytes) / self.link_bytes_per_s

    def describe(self) -> str:
        return (
            f"{self.name}: HBM {self.hbm_bytes_per_s / 1e12:.2f} TB/s, "
            f"host link {self.link_bytes_per_s / 1e9:.0f} GB/s each way"
        )


HARDWARE: dict[str, CostModel] = {
    "gaudi2": CostModel("gaudi2", GAUDI2_HBM_BYTES_PER_S),
    "gaudi3": CostModel("gaudi3", GAUDI3_HBM_BYTES_PER_S),
}
"""The named presets (PCIe Gen5 x16 host link for both)."""


def cost_model(
    hardware: str = "gaudi2", hbm_tb_per_s: float | None = None, link_gb_per_s: float | None = None
) -> CostModel:
    """A preset by name, with the HBM (TB/s) or host-link (GB/s) bandwidth overridden."""
    if hardware not in HARDWARE:
        raise ConfigError("hardware", hardware, f"one of {sorted(HARDWARE)}")
    base = HARDWARE[hardware]
    for name, value in (("hbm_tb_per_s", hbm_tb_per_s), ("link_gb_per_s", link_gb_per_s)):
        if value is not None and not value > 0:
            raise ConfigError(name, value, "a bandwidth > 0")
    hbm = base.hbm_bytes_per_s if hbm_tb_per_s is None else hbm_tb_per_s * 1e12
    link = base.link_bytes_per_s if link_gb_per_s is None else link_gb_per_s * 1e9
    custom = hbm_tb_per_s is not None or link_gb_per_s is not None
    return CostModel(base.name + ("*" if custom else ""), hbm, link)

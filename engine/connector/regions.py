"""Memory regions as NIXL sees them: pure layout arithmetic, no NIXL, no torch.

A region is a named set of tensors that share a leading dimension of `num_units`, e.g.
  "kv":    one tensor `kv_cache[num_blocks, ...]`       (unit = one block, all layers), or
           per-layer tensors `k[l][num_blocks, ...]`   (unit = block i of every tensor);
  "state": `snapshots[num_slots, ...]`                 (unit = one recurrent-state slot).
Unit `i` of a region is the i-th leading slice of each of its tensors, so it is described
to NIXL by one descriptor per tensor. Descriptors are laid out tensor-major:
  index(tensor t, unit i) = t * num_units + i
and the regions of an engine are concatenated in registration order into one descriptor
list, so one NIXL transfer (and one notification) can cover several regions.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

MEM_TYPES = ("DRAM", "VRAM")


class RegionError(ValueError):
    """A region that cannot be registered, or a read plan that does not fit the regions."""


@dataclass(frozen=True)
class RegionLayout:
    """Where a region's units live in one process, and how big they are."""

    name: str
    num_units: int
    slice_bytes: tuple[int, ...]  # bytes of one unit in each tensor
    base_addrs: tuple[int, ...]  # data pointer of each tensor
    mem_type: str = "DRAM"
    device_id: int = 0

    def __post_init__(self):
        if not self.name:
            raise RegionError("a region needs a name")
        if self.num_units <= 0:
            raise RegionError(f"region {self.name!r}: num_units must be positive")
        if not self.slice_bytes or len(self.slice_bytes) != len(self.base_addrs):
            raise RegionError(f"region {self.name!r}: one slice size per tensor is needed")
        if any(b <= 0 for b in self.slice_bytes):
            raise RegionError(f"region {self.name!r}: empty units")
        if self.mem_type not in MEM_TYPES:
            raise RegionError(f"region {self.name!r}: mem_type must be one of {MEM_TYPES}")

    @property
    def unit_bytes(self) -> int:
        return sum(self.slice_bytes)

    @property
    def num_descriptors(self) -> int:
        return self.num_units * len(self.slice_bytes)

    def descriptors(self) -> list[tuple[int, int, int]]:
        """(address, length, device id) for every (tensor, unit), tensor-major."""
        return [
            (base + unit * size, size, self.device_id)
            for base, size in zip(self.base_addrs, self.slice_bytes, strict=True)
            for unit in range(self.num_units)
        ]

    def descriptor_indices(self, unit_ids: Sequence[int], offset: int = 0) -> list[int]:
        """Indices into `descriptors()` (+ offset) for these units, tensor by tensor."""
        return [
            offset + t * self.num_units + u for t in range(len(self.slice_bytes)) for u in unit_ids
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_units": self.num_units,
            "unit_bytes": self.unit_bytes,
            "slice_bytes": list(self.slice_bytes),
            "base_addrs": list(self.base_addrs),
            "mem_type": self.mem_type,
            "device_id": self.device_id,
        }

    @classmethod
    def from_dict(cls, name: str, data: Mapping[str, Any]) -> "RegionLayout":
        try:
            layout = cls(
                name=name,
                num_units=_int(data["num_units"]),
                slice_bytes=tuple(_int(b) for b in data["slice_bytes"]),
                base_addrs=tuple(_int(a) for a in data["base_addrs"]),
                mem_type=str(data["mem_type"]),
                device_id=_int(data["device_id"]),
            )
        except (KeyError, TypeError) as exc:
            raise RegionError(f"region {name!r}: malformed description ({exc!r})") from None
        if "unit_bytes" in data and _int(data["unit_bytes"]) != layout.unit_bytes:
            raise RegionError(f"region {name!r}: unit_bytes does not match slice_bytes")
        return layout


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an integer, got {value!r}")
    return value


def layout_of_tensors(name: str, tensors: Iterable[Any]) -> RegionLayout:
    """The layout of torch tensors sharing a leading dimension (duck-typed: no torch import)."""
    tensors = list(tensors)
    if not tensors:
        raise RegionError(f"region {name!r}: no tensors")
    num_units = tensors[0].shape[0] if tensors[0].dim() > 0 else 0
    devices = {str(t.device) for t in tensors}
    if len(devices) != 1:
        raise RegionError(f"region {name!r}: tensors on several devices {sorted(devices)}")
    slice_bytes, base_addrs = [], []
    for t in tensors:
        if t.dim() == 0 or t.shape[0] != num_units:
            raise RegionError(f"region {name!r}: every tensor needs leading dimension {num_units}")
        if not t.is_contiguous():
            raise RegionError(f"region {name!r}: tensors must be contiguous")
        slice_bytes.append(t[0].numel() * t.element_size())
        base_addrs.append(t.data_ptr())
    device = tensors[0].device
    if device.type not in ("cpu", "cuda"):
        raise RegionError(f"region {name!r}: unsupported device {device}")
    mem_type = "VRAM" if device.type == "cuda" else "DRAM"
    device_id = (device.index or 0) if mem_type == "VRAM" else 0
    return RegionLayout(name, num_units, tuple(slice_bytes), tuple(base_addrs), mem_type, device_id)


def check_unit_ids(region: RegionLayout, ids: Sequence[int], side: str) -> list[int]:
    """`ids` as a list of ints within the region, or RegionError naming the bad ones."""
    out = []
    for i in ids:
        try:
            if isinstance(i, bool):
                raise TypeError
            out.append(operator.index(i))  # ints, numpy and torch integers; not floats
        except TypeError:
            raise RegionError(
                f"{side} region {region.name!r}: id {i!r} is not an integer"
            ) from None
    bad = [i for i in out if not 0 <= i < region.num_units]
    if bad:
        raise RegionError(
            f"{side} region {region.name!r}: ids {bad[:8]} out of range [0, {region.num_units})"
        )
    return out


def check_read_pair(
    local: RegionLayout, remote: RegionLayout, local_ids: Sequence[int], remote_ids: Sequence[int]
) -> tuple[list[int], list[int]]:
    """Validated (local, remote) unit ids for one region of a READ; raises RegionError."""
    if len(local_ids) != len(remote_ids):
        raise RegionError(
            f"region {local.name!r}: {len(local_ids)} local ids for {len(remote_ids)} remote ids"
        )
    if local.slice_bytes != remote.slice_bytes:
        raise RegionError(
            f"region {local.name!r}: unit layout differs (local slices "
            f"{list(local.slice_bytes)} bytes, remote {list(remote.slice_bytes)})"
        )
    lids = check_unit_ids(local, local_ids, "local")
    if len(set(lids)) != len(lids):
        raise RegionError(f"region {local.name!r}: a local unit is written twice")
    return lids, check_unit_ids(remote, remote_ids, "remote")

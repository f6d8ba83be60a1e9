"""What the encoders need to store an item as a delta against its base (docs/FORMAT.md).

The save-side bookkeeping (which base, where its bytes come from) is :mod:`nvdcp.dcp.delta`;
this is the part the CPU and GPU encoders see.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import numpy as np
import torch

#: Default ``min_gain``: a delta is kept only if it is at least this fraction smaller than the
#: item stored whole (as far as the writer knows its whole size).
DEFAULT_MIN_GAIN = 0.02
#: Default ``min_item_bytes``: smaller items are stored whole, never as deltas. A delta costs an
#: item a fixed amount of host work on every save and load (its base found, copied and kept; one
#: more record per chain level read, checked and folded), and what it saves is a fraction of the
#: item's size. In the reference GPT's fp32 AdamW state (benchmarks/delta_bench.py) the 294 of
#: 447 items under this size (norms and biases) hold 0.14% of the bytes; on the H200 a delta
#: save kept the GPU encode thread busy about twice as long as a full save, in per-segment torch
#: calls of which each of these items made as many as a large one.
DEFAULT_MIN_ITEM_BYTES = 64 << 10
#: Environment variable that overrides :data:`DEFAULT_MIN_ITEM_BYTES` (bytes) for policies and
#: writers given no ``min_item_bytes`` (the test suite sets 0: its states are small).
MIN_ITEM_BYTES_ENV = "NVDCP_DELTA_MIN_ITEM_BYTES"


def default_min_item_bytes() -> int:
    """:data:`DEFAULT_MIN_ITEM_BYTES`, or the value of ``$NVDCP_DELTA_MIN_ITEM_BYTES``.

    Raises:
        ValueError: the variable is set to something other than a non-negative integer.
    """
    value = os.environ.get(MIN_ITEM_BYTES_ENV)
    if value is None or value == "":
        return DEFAULT_MIN_ITEM_BYTES
    try:
        parsed = int(value)
    except ValueError:
        parsed = -1
    if parsed < 0:
        raise ValueError(f"${MIN_ITEM_BYTES_ENV} must be a number of bytes >= 0, got {value!r}")
    return parsed


class _HasNbytes(Protocol):
    @property
    def nbytes(self) -> int: ...


_Sized = TypeVar("_Sized", bound=_HasNbytes)


@dataclass
class DeltaInput:
    """What the encoder needs to store one item as a delta (or whole, and keep its bytes).

    ``base``: the base item's raw bytes (host uint8) or None (store whole); ``keep``: where the
    item's own raw bytes go for the next save (may be the same memory as ``base``: the encoder
    reads the base before it writes there); ``whole_nbytes``: the item's size stored whole as
    last measured (a delta at least ``min_gain`` smaller is kept, else the item is stored whole).
    """

    base: torch.Tensor | None
    base_digest: int | None
    keep: torch.Tensor | None
    whole_nbytes: int | None
    min_gain: float = DEFAULT_MIN_GAIN
    #: told the item's size stored whole when the encoder measures it (unknown ``whole_nbytes``)
    on_whole: Callable[[int], None] | None = None
    #: each plane's codec for a GPU delta with ``codec="auto"``, from how the item's last delta
    #: compressed (:func:`nvdcp.pipeline.policy.next_delta_plane_codecs`); None: the default
    plane_codecs: tuple[str, ...] | None = None

    def host_base(self) -> np.ndarray:
        """The base's bytes in host memory, for the CPU encoder (a copy when it is kept on a GPU)."""
        assert self.base is not None
        return (self.base if self.base.device.type == "cpu" else self.base.cpu()).numpy()

    def store_kept(self, raw: np.ndarray) -> None:
        """Write the item's raw bytes (host memory) to ``keep``, wherever that is: only once
        every read of the base is done (they may be the same memory)."""
        assert self.keep is not None
        if self.keep.device.type == "cpu":
            self.keep.numpy()[:] = raw
        else:
            self.keep.copy_(torch.from_numpy(raw))

    def host_keep(self) -> np.ndarray | None:
        """``keep`` as a flat uint8 array when it is host memory the encoder can write while it
        takes the difference (:func:`~nvdcp.transform.delta.delta_split`), else None."""
        keep = self.keep
        if keep is None or keep.device.type != "cpu" or keep.dtype != torch.uint8 or not keep.is_contiguous():
            return None
        return keep.numpy().reshape(-1)

    def pays(self, delta_nbytes: int) -> bool:
        """Whether a delta record of ``delta_nbytes`` is worth keeping over the item stored whole."""
        return self.whole_nbytes is None or delta_nbytes <= self.whole_nbytes * (1 - self.min_gain)

    def wants_whole(self, delta_nbytes: int) -> bool:
        """Whether the item must also be encoded whole to decide: its whole size is unknown (a
        base read back from storage) or the delta of ``delta_nbytes`` does not pay against it."""
        return self.whole_nbytes is None or not self.pays(delta_nbytes)

    def choose(self, delta_record: _Sized, whole_record: _Sized) -> _Sized:
        """The record to store once the item was encoded both ways (:meth:`wants_whole`): the
        delta when it is at least ``min_gain`` smaller. Tells ``on_whole`` the whole size."""
        if self.on_whole is not None:
            self.on_whole(whole_record.nbytes)
        return whole_record if delta_record.nbytes > whole_record.nbytes * (1 - self.min_gain) else delta_record


@dataclass
class DeltaTensor:
    """A tensor to encode together with its :class:`DeltaInput`."""

    tensor: torch.Tensor
    delta: DeltaInput


__all__ = [
    "DEFAULT_MIN_GAIN", "DEFAULT_MIN_ITEM_BYTES", "MIN_ITEM_BYTES_ENV", "DeltaInput", "DeltaTensor", "default_min_item_bytes",
]

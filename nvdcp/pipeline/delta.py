"""What the encoders need to store an item as a delta against its base (docs/FORMAT.md).

The save-side bookkeeping (which base, where its bytes come from) is :mod:`nvdcp.dcp.delta`;
this is the part the CPU and GPU encoders see.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

#: Default ``min_gain``: a delta is kept only if it is at least this fraction smaller than the
#: item stored whole (as far as the writer knows its whole size).
DEFAULT_MIN_GAIN = 0.02


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

    def pays(self, delta_nbytes: int) -> bool:
        """Whether a delta record of ``delta_nbytes`` is worth keeping over the item stored whole."""
        return self.whole_nbytes is None or delta_nbytes <= self.whole_nbytes * (1 - self.min_gain)


@dataclass
class DeltaTensor:
    """A tensor to encode together with its :class:`DeltaInput`."""

    tensor: torch.Tensor
    delta: DeltaInput


__all__ = ["DEFAULT_MIN_GAIN", "DeltaInput", "DeltaTensor"]

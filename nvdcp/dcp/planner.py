"""A load planner that never unpickles arbitrary objects from a checkpoint.

DCP stores non-tensor state (optimizer ``param_groups``, step counters, user objects) as BYTE_IO
items and torch's ``DefaultLoadPlanner`` reads them back with ``torch.load(weights_only=False)``:
a crafted checkpoint can run code there whatever the storage layer checks (docs/SECURITY.md).
"""

from __future__ import annotations

import io
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` whose BYTE_IO items load with ``torch.load(weights_only=True)``.

    Plain containers, numbers, strings and tensors load as before; anything else is refused with
    torch's "Weights only load failed". Use it for checkpoints you did not write::

        dcp.load(sd, storage_reader=nvdcp.NvcompReader(path), planner=nvdcp.WeightsOnlyLoadPlanner())
    """

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        obj: Any = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj

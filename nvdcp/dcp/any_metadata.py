"""Reading ``.metadata`` of stock checkpoints too.

torch's ``FileSystemWriter`` pickles ``storage_meta.checkpoint_id`` as a ``pathlib`` path, which
the bare allow-list of :func:`~nvdcp.dcp.metadata_io.load_metadata` refuses. Everything that reads
stock checkpoints (:class:`~nvdcp.NvcompReader`, :func:`nvdcp.is_nvdcp_checkpoint`, the commands)
reads ``.metadata`` here, allowing paths (inert: building one runs nothing beyond string
handling). Everything else is :func:`nvdcp.dcp.metadata_io.load_metadata`: size bound, opcode
pre-scan, allow-list, record checks.
"""

from __future__ import annotations

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from nvdcp.dcp.metadata_io import load_metadata
from nvdcp.storage import Storage


def load_any_metadata(storage: Storage) -> Metadata:
    """:func:`nvdcp.dcp.metadata_io.load_metadata`, also accepting stock DCP's path objects."""
    metadata = load_metadata(storage, allow_paths=True)
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    return metadata

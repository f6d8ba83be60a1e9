"""Reading ``.metadata``: existence, size bounds, and unpickling with an allow-list.

``.metadata`` is a pickle, as in stock DCP. Loading a pickle runs code named in it, so nvdcp
unpickles with a restricted ``Unpickler`` that only resolves the classes a DCP ``Metadata``
contains (torch.distributed.checkpoint's dataclasses, torch dtypes and sizes, builtins).
That narrows, but does not remove, the need to load only checkpoints you trust (docs/SECURITY.md).
"""

from __future__ import annotations

import io
import pickle
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from nvdcp.errors import CorruptCheckpointError, IncompleteCheckpointError, MissingDataFileError
from nvdcp.storage import Storage

METADATA_NAME = ".metadata"
MAX_METADATA_BYTES = 1 << 31

_ALLOWED_MODULE_PREFIXES = ("torch.distributed.checkpoint.",)
_ALLOWED = {
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"), ("builtins", "range"),
    ("builtins", "getattr"), ("collections", "OrderedDict"), ("torch", "Size"),
    ("torch", "device"), ("torch", "layout"), ("torch", "memory_format"),
    ("torch._utils", "_rebuild_tensor_v2"), ("copyreg", "_reconstructor"),
    ("builtins", "object"), ("torch.serialization", "_get_layout"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        import torch

        if module.startswith(_ALLOWED_MODULE_PREFIXES) or (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        ):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from .metadata")


def load_metadata(storage: Storage) -> Metadata:
    """Read and validate ``.metadata`` from ``storage``."""
    where = storage.describe(METADATA_NAME)
    try:
        blob = storage.read(METADATA_NAME)
    except (MissingDataFileError, FileNotFoundError):
        raise IncompleteCheckpointError(
            f"{storage.url}: no committed checkpoint here ({METADATA_NAME} is missing: the save "
            "never finished, or this is not a checkpoint)"
        ) from None
    if len(blob) > MAX_METADATA_BYTES:
        raise CorruptCheckpointError(f"{where}: {len(blob)} bytes is implausibly large")
    try:
        metadata = _MetadataUnpickler(io.BytesIO(blob)).load()
    except Exception as exc:  # a corrupt pickle can raise almost anything
        raise CorruptCheckpointError(f"{where}: cannot unpickle: {exc}") from exc
    if not isinstance(metadata, Metadata):
        raise CorruptCheckpointError(f"{where}: holds {type(metadata).__name__}, not Metadata")
    return metadata

"""Reading ``.metadata``: existence, size bounds, unpickling with an allow-list, record checks.

``.metadata`` is a pickle, as in stock DCP. Loading a pickle runs code named in it, so nvdcp
unpickles with a restricted ``Unpickler`` that resolves only what a DCP ``Metadata`` contains:
the dataclasses and enums *defined in* ``torch.distributed.checkpoint.metadata`` and
``.filesystem``, torch dtypes, layouts, memory formats and ``torch.Size``, ``OrderedDict``, sets.
Nothing callable beyond those constructors (no ``getattr``, no dotted names, no functions
imported into those modules) is reachable. That narrows, but does not replace, the rule to load
only checkpoints you trust (docs/SECURITY.md).
"""

from __future__ import annotations

import dataclasses
import enum
import io
import pickle
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from nvdcp.errors import CorruptCheckpointError, IncompleteCheckpointError, MissingDataFileError
from nvdcp.storage import Storage
from nvdcp.storage.base import check_name

METADATA_NAME = ".metadata"
MAX_METADATA_BYTES = 1 << 31
#: Largest offset or length a storage record may hold (S3 objects stop at 5 TiB).
MAX_RECORD_BYTES = 1 << 62

#: Modules whose dataclasses and enums may be rebuilt (only classes defined in them, by plain name).
_DCP_MODULES = frozenset({"torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem"})
_ALLOWED = {
    ("builtins", "set"), ("builtins", "frozenset"), ("collections", "OrderedDict"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        import torch

        # A dotted name walks attributes (pickle protocol 4): ``<allowed module>.os.system``.
        if not name.isidentifier():
            raise pickle.UnpicklingError(f"refusing to load {module}.{name} from .metadata")
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module in _DCP_MODULES:
            obj = super().find_class(module, name)
            if (
                isinstance(obj, type)
                and obj.__module__ == module
                and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum))
            ):
                return obj
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        ):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from .metadata")


def load_metadata(storage: Storage) -> Metadata:
    """Read and validate ``.metadata`` from ``storage``.

    Beyond unpickling, every storage record must name a plain file inside the checkpoint (no
    ``/``, ``..`` or absolute path) and hold a non-negative integer offset and length, so a
    hostile record fails here, before any data is fetched or allocated.
    """
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
    check_records(metadata, where)
    return metadata


def check_records(metadata: Metadata, where: str) -> None:
    """Refuse storage records that point outside the checkpoint or hold impossible ranges."""
    records = metadata.storage_data
    if not isinstance(records, dict):
        raise CorruptCheckpointError(f"{where}: has no storage records")
    names: set[int] = set()  # ids: records of one file share one name object (pickle memo)
    for index, info in records.items():
        name = getattr(info, "relative_path", None)
        offset = getattr(info, "offset", None)
        length = getattr(info, "length", None)
        fqn = getattr(index, "fqn", index)
        if id(name) not in names:
            check_name(name, f"{where}: item {fqn!r}")  # type: ignore[arg-type]
            names.add(id(name))
        for value in (offset, length):
            if type(value) is not int or not 0 <= value < MAX_RECORD_BYTES:
                raise CorruptCheckpointError(
                    f"{where}: item {fqn!r} has an invalid byte range (offset {offset!r}, length {length!r})"
                )

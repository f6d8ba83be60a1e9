"""Reading ``.metadata`` of stock checkpoints too.

torch's ``FileSystemWriter`` pickles ``storage_meta.checkpoint_id`` as a ``pathlib`` path, which
nvdcp's allow-listing unpickler (:mod:`nvdcp.dcp.metadata_io`) refuses. Path objects are inert
(building one runs nothing beyond string handling), so the commands allow them on top of that
list; the rest (size bound, messages, allowed classes) follows ``load_metadata``.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from nvdcp.dcp import metadata_io
from nvdcp.dcp.metadata_io import MAX_METADATA_BYTES, METADATA_NAME
from nvdcp.errors import CorruptCheckpointError, IncompleteCheckpointError, MissingDataFileError
from nvdcp.storage import Storage

_PATHS = {("pathlib", n) for n in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path")}


class _Unpickler(metadata_io._MetadataUnpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _PATHS:
            return pickle.Unpickler.find_class(self, module, name)
        return super().find_class(module, name)


def load_any_metadata(storage: Storage) -> Metadata:
    """:func:`nvdcp.dcp.metadata_io.load_metadata`, also accepting stock DCP's path objects."""
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
        metadata = _Unpickler(io.BytesIO(blob)).load()
    except Exception as exc:  # a corrupt pickle can raise almost anything
        raise CorruptCheckpointError(f"{where}: cannot unpickle: {exc}") from exc
    if not isinstance(metadata, Metadata):
        raise CorruptCheckpointError(f"{where}: holds {type(metadata).__name__}, not Metadata")
    if not isinstance(metadata.storage_data, dict):
        raise CorruptCheckpointError(f"{where}: has no storage records")
    # The record checks (plain file names, sane ranges) of metadata_io, where this build has them.
    check_records = getattr(metadata_io, "check_records", None)
    if check_records is not None:
        check_records(metadata, where)
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    return metadata

"""Committing a checkpoint: the steps every producer of an nvdcp checkpoint follows.

``NvcompWriter`` (through DCP's ``finish``) and ``nvdcp convert`` both write data files and then
commit them here, so the protocol exists once:

1. :meth:`CheckpointCommit.begin` marks the save in progress (:class:`~nvdcp.dcp.save_guard.SaveGuard`)
   before any data file of it exists;
2. every data file starts with :func:`data_file_header`;
3. :meth:`CheckpointCommit.commit` checks that every data file the new ``.metadata`` names is
   there and whole, then writes ``.metadata`` atomically (temp and rename; one PUT on S3);
4. :meth:`CheckpointCommit.cleanup` deletes data files of earlier saves that no live save needs;
   :meth:`CheckpointCommit.abort` deletes what a failed producer wrote and drops its marker.
"""

from __future__ import annotations

import pickle
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta

from nvdcp.dcp.metadata_io import METADATA_NAME
from nvdcp.dcp.save_guard import SaveGuard
from nvdcp.format.file_info import file_info
from nvdcp.format.header import pack_file_header
from nvdcp.storage import Storage


def data_file_header(rank: int, save_id: str, **extra: Any) -> bytes:
    """The header every nvdcp data file starts with (``extra`` goes into its info block)."""
    return pack_file_header(file_info(rank, save_id, **extra))


class CheckpointCommit:
    """One save's commit on ``storage`` (the coordinator's side)."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self.guard = SaveGuard(storage)
        self.blob: bytes | None = None

    def begin(self, token: str) -> None:
        """Mark the save ``token`` in progress; call before any of its data files is created."""
        self.guard.mark(token)

    def commit(
        self, metadata: Metadata, storage_data: dict[MetadataIndex, Any], checkpoint_id: str, save_id: str,
        *, stock_pickle: bool = False,
    ) -> bytes:
        """Record ``storage_data`` in ``metadata``, check the data files, write ``.metadata``.

        ``stock_pickle`` pickles as torch's ``FileSystemWriter.finish`` does (default protocol),
        for checkpoints meant for stock readers. Returns the committed bytes.

        Raises:
            MissingDataFileError, TruncatedCheckpointError: a data file is missing or short;
                nothing is committed.
        """
        metadata.storage_data = storage_data
        metadata.storage_meta = StorageMeta(checkpoint_id=checkpoint_id, save_id=save_id)
        blob = pickle.dumps(metadata) if stock_pickle else pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)
        self.guard.check_data_files(storage_data)
        self.storage.write_atomic(METADATA_NAME, blob)
        self.blob = blob
        return blob

    def cleanup(self, keep: set[str]) -> bool:
        """After :meth:`commit`: delete other saves' data files that no live save needs, drop
        the marker. False when a later save has superseded this one (nothing was deleted)."""
        return self.guard.cleanup(keep, self.blob)

    def abandon(self) -> None:
        """Forget a save that never reached its commit (its marker is left for cleanup)."""
        self.guard.abandon()

    def abort(self, created: list[str]) -> None:
        """Delete the data files a failed producer created and drop its marker."""
        self.storage.delete(created)
        self.guard.unmark()


__all__ = ["CheckpointCommit", "data_file_header"]

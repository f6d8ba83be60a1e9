"""nvdcp: compressed torch.distributed.checkpoint storage, with nvCOMP on the GPU.

    import torch.distributed.checkpoint as dcp, nvdcp
    dcp.save(state_dict, storage_writer=nvdcp.NvcompWriter("/ckpt/step100"))
    dcp.load(state_dict, storage_reader=nvdcp.NvcompReader("/ckpt/step100"))
"""

from __future__ import annotations

__version__ = "0.1.0"

from nvdcp.dcp.delta import DeltaPolicy
from nvdcp.dcp.planner import WeightsOnlyLoadPlanner
from nvdcp.dcp.reader import NvcompReader, is_nvdcp_checkpoint
from nvdcp.dcp.stager import NvcompStager
from nvdcp.dcp.writer import NvcompWriter
from nvdcp.errors import (
    BaseMismatchError,
    CheckpointExistsError,
    CheckpointInUseError,
    CodecUnavailableError,
    CorruptCheckpointError,
    DeltaBaseError,
    FormatVersionError,
    IncompleteCheckpointError,
    MissingBaseError,
    MissingDataFileError,
    NotACheckpointDirectoryError,
    NvdcpError,
    StagingError,
    StaleSaveError,
    StorageError,
    TruncatedCheckpointError,
    UnknownCodecError,
)
from nvdcp.verify import VerifyReport, verify_checkpoint


def release_resources() -> None:
    """Free what nvdcp keeps per process between saves and loads.

    Writers and readers made per save share, per settings, an item encoder (CPU codec threads,
    GPU encoders, pinned buffers), an async stager (its host buffers, pinned when CUDA is
    present), the readers' pinned staging pool and nvCOMP's GPU workspace. This closes all of them (waiting for an
    async save still holding staged buffers) and unmaps the CPU path's idle plane buffers; the next save or load builds them again. Objects
    you pass yourself (``NvcompWriter(stager=..., encoder=...)``) are yours to close.
    """
    from nvdcp.dcp.stager import close_shared_stagers
    from nvdcp.gpu.nvcomp_batch import WORKSPACES
    from nvdcp.gpu.pinned import close_shared_pools
    from nvdcp.pipeline.encoder import close_shared_encoders
    from nvdcp.pipeline.scratch import PLANE_BUFFERS

    close_shared_stagers()
    close_shared_encoders()
    close_shared_pools()
    WORKSPACES.release()
    PLANE_BUFFERS.clear()


__all__ = [
    "NvcompWriter",
    "NvcompReader",
    "NvcompStager",
    "DeltaPolicy",
    "WeightsOnlyLoadPlanner",
    "is_nvdcp_checkpoint",
    "NvdcpError",
    "BaseMismatchError",
    "CheckpointExistsError",
    "CheckpointInUseError",
    "DeltaBaseError",
    "MissingBaseError",
    "CodecUnavailableError",
    "CorruptCheckpointError",
    "FormatVersionError",
    "IncompleteCheckpointError",
    "MissingDataFileError",
    "NotACheckpointDirectoryError",
    "StagingError",
    "StaleSaveError",
    "StorageError",
    "TruncatedCheckpointError",
    "UnknownCodecError",
    "VerifyReport",
    "release_resources",
    "verify_checkpoint",
    "__version__",
]

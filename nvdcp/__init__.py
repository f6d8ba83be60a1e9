"""nvdcp: compressed torch.distributed.checkpoint storage, with nvCOMP on the GPU.

    import torch.distributed.checkpoint as dcp, nvdcp
    dcp.save(state_dict, storage_writer=nvdcp.NvcompWriter("/ckpt/step100"))
    dcp.load(state_dict, storage_reader=nvdcp.NvcompReader("/ckpt/step100"))
"""

from __future__ import annotations

__version__ = "0.1.0"

from nvdcp.dcp.planner import WeightsOnlyLoadPlanner
from nvdcp.dcp.reader import NvcompReader
from nvdcp.dcp.stager import NvcompStager
from nvdcp.dcp.writer import NvcompWriter
from nvdcp.verify import VerifyReport, verify_checkpoint
from nvdcp.errors import (
    CheckpointExistsError,
    CodecUnavailableError,
    CorruptCheckpointError,
    FormatVersionError,
    IncompleteCheckpointError,
    MissingDataFileError,
    NotACheckpointDirectoryError,
    NvdcpError,
    StorageError,
    TruncatedCheckpointError,
    UnknownCodecError,
)

__all__ = [
    "NvcompWriter",
    "NvcompReader",
    "NvcompStager",
    "WeightsOnlyLoadPlanner",
    "NvdcpError",
    "CheckpointExistsError",
    "CodecUnavailableError",
    "CorruptCheckpointError",
    "FormatVersionError",
    "IncompleteCheckpointError",
    "MissingDataFileError",
    "NotACheckpointDirectoryError",
    "StorageError",
    "TruncatedCheckpointError",
    "UnknownCodecError",
    "VerifyReport",
    "verify_checkpoint",
    "__version__",
]

"""One error hierarchy for everything nvdcp raises.

Every class derives from :class:`NvdcpError` and, where one fits, from the matching builtin, so
callers can catch either (``except FileNotFoundError`` still works for a missing checkpoint).
Messages name the thing that is wrong and where: the URL or file, the item, the chunk.
"""

from __future__ import annotations


class NvdcpError(Exception):
    """Base class of every error nvdcp raises."""


class CorruptCheckpointError(NvdcpError, ValueError):
    """Stored bytes do not match what was written: a checksum, a header field or a size is wrong."""


class TruncatedCheckpointError(CorruptCheckpointError):
    """A data file or an item in it is shorter than its records say."""


class IncompleteCheckpointError(NvdcpError, FileNotFoundError):
    """The location holds no committed checkpoint (no ``.metadata``): a save never finished there."""


class MissingDataFileError(CorruptCheckpointError, FileNotFoundError):
    """``.metadata`` names a data file that is not there."""


class FormatVersionError(NvdcpError, ValueError):
    """The checkpoint was written by a newer, unknown version of the container format."""


class UnknownCodecError(NvdcpError, ValueError):
    """A codec name or id that no registered codec has."""


class CodecUnavailableError(NvdcpError, RuntimeError):
    """The codec exists but cannot run on this machine (a GPU-only codec without a GPU, a missing library)."""


class StagingError(NvdcpError, ValueError):
    """A staged state dict (``dcp.async_save`` through :class:`~nvdcp.NvcompStager`) does not fit
    what is being saved, or is used in a way staging does not support."""


class StorageError(NvdcpError, OSError):
    """An I/O failure of the storage backend (disk full, permission denied, network failure)."""


class CheckpointExistsError(NvdcpError, FileExistsError, RuntimeError):
    """The target location already holds a checkpoint and overwriting was not allowed.

    Also a ``RuntimeError``: what torch's ``FileSystemWriter(overwrite=False)`` raises there, so
    code written against stock DCP catches it unchanged.
    """


class NotACheckpointDirectoryError(NvdcpError, NotADirectoryError):
    """The checkpoint path exists but is a file."""


class StaleSaveError(NvdcpError, RuntimeError):
    """A save whose every item is byte-identical to the previous save of this process was refused
    (``on_identical_save="error"``); nothing was committed, the previous checkpoint is intact."""


class DeltaBaseError(NvdcpError):
    """A delta checkpoint's base (docs/FORMAT.md, "Delta checkpoints") cannot serve it."""


class MissingBaseError(DeltaBaseError, FileNotFoundError):
    """The base checkpoint a delta needs is gone (deleted, moved, or never committed)."""


class BaseMismatchError(DeltaBaseError, CorruptCheckpointError):
    """The checkpoint found where a delta's base should be is not the one it was saved against
    (another save overwrote it) or one of its items differs from what the delta records."""


class CheckpointInUseError(NvdcpError, ValueError):
    """A checkpoint that other checkpoints are deltas against (directly or down their chain)
    was to be deleted; :attr:`dependents` are their paths."""

    def __init__(self, message: str, dependents: list[str]) -> None:
        super().__init__(message)
        self.dependents = dependents


class BucketNotFoundError(StorageError):
    """The bucket (or container) named in a storage URL does not exist.

    Deliberately not a ``FileNotFoundError``: a missing bucket is a configuration error, and must not
    read as "no checkpoint saved here yet".
    """


class AccessDeniedError(StorageError, PermissionError):
    """The storage service refused the request: the credentials lack a permission (S3 ``AccessDenied``)."""


class S3AccessDeniedError(AccessDeniedError):
    """S3 answered ``AccessDenied`` (HTTP 403) for a bucket or object."""


class StorageCredentialsError(AccessDeniedError):
    """Credentials are missing, unknown, malformed or expired (``InvalidAccessKeyId``, ``ExpiredToken``...)."""


class StorageUnavailableError(StorageError, ConnectionError):
    """The endpoint could not be reached, or kept failing (throttling, 5xx, dropped connections) after every retry."""

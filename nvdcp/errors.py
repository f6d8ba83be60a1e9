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
    """The checkpoint was written by a newer, unknown version of the container format or a codec."""


class UnknownCodecError(NvdcpError, ValueError):
    """A codec name or id that no registered codec has."""


class CodecUnavailableError(NvdcpError, RuntimeError):
    """The codec exists but cannot run on this machine (a GPU-only codec without a GPU, a missing library)."""


class StorageError(NvdcpError, OSError):
    """An I/O failure of the storage backend (disk full, permission denied, network failure)."""


class CheckpointExistsError(NvdcpError, FileExistsError):
    """The target location already holds a checkpoint and overwriting was not allowed."""


class NotACheckpointDirectoryError(NvdcpError, NotADirectoryError):
    """The checkpoint path exists but is a file."""

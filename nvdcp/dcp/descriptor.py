"""The per-item record nvdcp leaves in ``.metadata``.

We reuse torch's own ``_StorageInfo(relative_path, offset, length, transform_descriptors)``
so stock torch can unpickle our ``.metadata``; the descriptor ``nvdcp.<codec>/<format version>``
marks the item as ours (stock FileSystemReader refuses unknown descriptors instead of misreading
the bytes) and tells a reader, before it fetches anything, whether it can decode the item.
"""

from __future__ import annotations

import functools
from typing import Any

from torch.distributed.checkpoint.filesystem import _StorageInfo

from nvdcp.codecs import codec_id
from nvdcp.errors import CorruptCheckpointError, FormatVersionError, UnknownCodecError
from nvdcp.format.header import DELTA_ITEM_VERSION, FORMAT_VERSION, FULL_ITEM_VERSION

PREFIX = "nvdcp."


@functools.cache
def descriptors(codec: str, version: int = FULL_ITEM_VERSION) -> tuple[str, ...]:
    """The descriptor tuple for items whose main codec is ``codec`` and whose record is of
    ``version`` (2: a delta item, which needs its base checkpoint to load).

    Cached so every item shares one tuple object: pickle memoizes it, which keeps ``.metadata``
    within a few bytes per item of stock DCP's.
    """
    return (f"{PREFIX}{codec}/{version}",)


def storage_info(relative_path: str, offset: int, length: int, codec: str, delta: bool = False) -> _StorageInfo:
    return _StorageInfo(
        relative_path, offset, length, descriptors(codec, DELTA_ITEM_VERSION if delta else FULL_ITEM_VERSION)
    )


def is_delta(info: object) -> bool:
    """Whether a storage record is an nvdcp delta item (descriptor version 2), from ``.metadata`` alone."""
    descs: tuple[Any, ...] = tuple(getattr(info, "transform_descriptors", None) or ())
    if len(descs) != 1 or not isinstance(descs[0], str):
        return False
    return descs[0].startswith(PREFIX) and descs[0].endswith(f"/{DELTA_ITEM_VERSION}")


def parse(info: object, where: str) -> tuple[str, int]:
    """Validate one storage record from ``.metadata``; returns ``(codec name, format version)``."""
    if not isinstance(info, _StorageInfo):
        raise CorruptCheckpointError(f"{where}: storage record is {type(info).__name__}, not _StorageInfo")
    if not isinstance(info.offset, int) or not isinstance(info.length, int) or info.offset < 0 or info.length < 0:
        raise CorruptCheckpointError(f"{where}: storage record has invalid offset/length")
    descs = info.transform_descriptors or ()
    ours = [d for d in descs if isinstance(d, str) and d.startswith(PREFIX)]
    if len(ours) != 1 or len(descs) != 1:
        raise CorruptCheckpointError(
            f"{where}: not an nvdcp item (descriptors {list(descs)!r}); a checkpoint written by "
            "torch's FileSystemWriter is read by NvcompReader as stock items (no checksums to verify); "
            "`nvdcp convert` makes an nvdcp copy that has them"
        )
    body = ours[0][len(PREFIX) :]
    name, _, version_s = body.partition("/")
    if not version_s.isdigit():
        raise CorruptCheckpointError(f"{where}: malformed descriptor {ours[0]!r}")
    version = int(version_s)
    if version > FORMAT_VERSION:
        raise FormatVersionError(
            f"{where}: written by nvdcp container format v{version}; this nvdcp reads up to "
            f"v{FORMAT_VERSION}; upgrade nvdcp"
        )
    try:
        codec_id(name)
    except UnknownCodecError:
        raise UnknownCodecError(f"{where}: unknown codec {name!r} in descriptor {ours[0]!r}") from None
    return name, version

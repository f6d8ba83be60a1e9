"""The delta record of ``.metadata``: which base checkpoint a delta checkpoint needs.

A *delta checkpoint* stores some items as version 2 records (docs/FORMAT.md): the XOR of the
item's bytes with the same item of a *base* checkpoint, whose header digest the record names. The
checkpoint as a whole names its base in one extra attribute of torch's ``Metadata``
(:data:`DELTA_ATTR`, plain values only, as the digest record)::

    {"version": 1, "base": "<base location as the writer was given it>",
     "relative": "<base relative to this checkpoint, or None>", "save_id": "<base's save id>",
     "digests_crc": <CRC32C of the base's digest record, or None>, "depth": <chain length>}

``depth`` is 1 for a delta whose base was saved whole, one more than its base's otherwise. A
reader resolves the base (``relative`` first, so a tree of checkpoints moved or copied as a whole
keeps loading; then ``base``), and before any tensor is written checks that what it found there
is the save the delta was written against (its save id and digest record), recursively down the
chain. Nothing here imports torch.
"""

from __future__ import annotations

import os
import posixpath
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from nvdcp.errors import CorruptCheckpointError

#: Attribute of ``Metadata`` holding the delta record.
DELTA_ATTR = "nvdcp_delta"
DELTA_VERSION = 1


@dataclass(frozen=True)
class BaseRef:
    """What a delta checkpoint records about its base."""

    location: str
    save_id: str
    depth: int
    relative: str | None = None
    digests_crc: int | None = None

    def as_record(self) -> dict[str, Any]:
        return {
            "version": DELTA_VERSION, "base": self.location, "relative": self.relative,
            "save_id": self.save_id, "digests_crc": self.digests_crc, "depth": self.depth,
        }


def read_delta(metadata: Any, where: str) -> BaseRef | None:
    """The base recorded in ``metadata`` (None: a checkpoint saved whole).

    Raises:
        CorruptCheckpointError: the record is malformed or of a newer version (a delta cannot be
            loaded without understanding its base, unlike a digest record, which can be skipped).
    """
    record = getattr(metadata, "__dict__", {}).get(DELTA_ATTR)
    if record is None:
        return None
    if not isinstance(record, dict) or type(record.get("version")) is not int:
        raise CorruptCheckpointError(f"{where}: the delta record of .metadata is malformed")
    if record["version"] > DELTA_VERSION:
        raise CorruptCheckpointError(
            f"{where}: delta record v{record['version']} is newer than this nvdcp reads (v{DELTA_VERSION}); upgrade nvdcp"
        )
    base, save_id, depth = record.get("base"), record.get("save_id"), record.get("depth")
    relative, crc = record.get("relative"), record.get("digests_crc")
    if (
        not isinstance(base, str) or not base or not isinstance(save_id, str) or type(depth) is not int or depth < 1
        or not (relative is None or isinstance(relative, str)) or not (crc is None or type(crc) is int)
    ):
        raise CorruptCheckpointError(f"{where}: the delta record of .metadata is malformed (fields)")
    return BaseRef(base, save_id, depth, relative, crc)


def _split(location: str) -> tuple[str, str, str]:
    """(scheme, netloc, path) of a URL, or ("", "", path) of a local path."""
    parts = urlsplit(location)
    if parts.scheme and "://" in location:
        return parts.scheme, parts.netloc, parts.path
    return "", "", os.path.abspath(location)


def relative_location(checkpoint: str, base: str) -> str | None:
    """``base`` relative to ``checkpoint`` when both are local or in one bucket; else None."""
    s1, n1, p1 = _split(checkpoint)
    s2, n2, p2 = _split(base)
    if (s1, n1) != (s2, n2):
        return None
    return posixpath.relpath(p2.rstrip("/") or "/", p1.rstrip("/") or "/")


def base_candidates(checkpoint: str, ref: BaseRef) -> list[str]:
    """Where to look for ``ref``'s base, in order: relative to ``checkpoint``, then as recorded."""
    out: list[str] = []
    if ref.relative is not None:
        scheme, netloc, path = _split(checkpoint)
        joined = posixpath.normpath(posixpath.join(path.rstrip("/") or "/", ref.relative))
        out.append(urlunsplit((scheme, netloc, joined, "", "")) if scheme else joined)
    if ref.location not in out:
        out.append(ref.location)
    return out


def same_location(a: str, b: str) -> bool:
    """Whether two checkpoint locations name the same place (paths normalized)."""
    return _split(a)[0:2] == _split(b)[0:2] and _split(a)[2].rstrip("/") == _split(b)[2].rstrip("/")


__all__ = ["BaseRef", "DELTA_ATTR", "DELTA_VERSION", "base_candidates", "read_delta", "relative_location", "same_location"]

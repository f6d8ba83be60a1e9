"""Save/load helpers for single-process DCP tests."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp

import nvdcp

# Re-exported: many tests import these from here; the one copy is in nvdcp.testing.
from nvdcp.testing import empty_like_sd, failure_of  # noqa: F401


def save(sd: dict[str, Any], path: str | os.PathLike[str], **kwargs: Any) -> nvdcp.NvcompWriter:
    writer = nvdcp.NvcompWriter(path, **kwargs)
    dcp.save(sd, storage_writer=writer)
    return writer


def load(sd: dict[str, Any], path: str | os.PathLike[str], **kwargs: Any) -> nvdcp.NvcompReader:
    reader = nvdcp.NvcompReader(path, **kwargs)
    dcp.load(sd, storage_reader=reader)
    return reader


def data_files(path: str | os.PathLike[str]) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.endswith(".nvdcp"))


def item_span(path: Path, fqn: str) -> tuple[Path, int, int]:
    """The data file, offset and length of the first stored item of ``fqn`` (to damage it)."""
    md = nvdcp.NvcompReader(path).read_metadata()
    for index, info in md.storage_data.items():
        if index.fqn == fqn:
            return path / info.relative_path, info.offset, info.length
    raise KeyError(fqn)

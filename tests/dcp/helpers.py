"""Save/load helpers for single-process DCP tests."""

from __future__ import annotations

import os
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

"""Save/load helpers for single-process DCP tests."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

import nvdcp


def save(sd: dict[str, Any], path: str | os.PathLike[str], **kwargs: Any) -> nvdcp.NvcompWriter:
    writer = nvdcp.NvcompWriter(path, **kwargs)
    dcp.save(sd, storage_writer=writer)
    return writer


def empty_like_sd(sd: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            out[k] = torch.zeros(v.shape, dtype=v.dtype) if v.dtype != torch.bool else torch.zeros(v.shape, dtype=torch.bool)
        elif isinstance(v, dict):
            out[k] = empty_like_sd(v)
        else:
            out[k] = None
    return out


def load(sd: dict[str, Any], path: str | os.PathLike[str], **kwargs: Any) -> nvdcp.NvcompReader:
    reader = nvdcp.NvcompReader(path, **kwargs)
    dcp.load(sd, storage_reader=reader)
    return reader


def failure_of(exc: BaseException) -> BaseException:
    """The first rank's underlying exception inside DCP's CheckpointException."""
    failures = getattr(exc, "failures", None)
    if not failures:
        return exc
    wrapped = next(iter(failures.values()))
    # torch wraps each rank's failure as (exception, traceback summary)
    return wrapped[0] if isinstance(wrapped, tuple) else wrapped


def data_files(path: str | os.PathLike[str]) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.endswith(".nvdcp"))

"""Records in host memory as columns: the input of :meth:`nvdcp.gpu.decoder.GpuDecoder.decode_columns`
(here, not there, so that code without nvCOMP can build them)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(eq=False)
class RecordColumns:
    """Records already in host memory, as columns (row ``i``: item ``i``), for
    :meth:`GpuDecoder.decode_columns`: what a :class:`DecodeRequest` per item holds, without an
    object per item. The caller parsed and checked their headers (e.g.
    :func:`~nvdcp.pipeline.cpu_batch.parse_records`). The items' chunks lie back to back in one
    table, item ``i``'s from row ``first_chunk[i]``: chunk ``k`` is ``sizes[k]`` bytes at
    ``chunk_at[k]`` of ``buffers[chunk_src[k]]``, with CRC32C ``crcs[k]``."""

    raw: np.ndarray  # int64: raw bytes of each item
    n_planes: np.ndarray  # int64
    chunk_bytes: np.ndarray  # int64
    transform: np.ndarray  # int64
    codecs: np.ndarray  # uint8 (items, MAX_PLANES): plane codec ids, zero past n_planes
    dtype_codes: np.ndarray  # int64: the stored dtype's code (-1: a bytes item)
    sizes: np.ndarray  # int64 per chunk
    crcs: np.ndarray  # uint32 per chunk
    first_chunk: np.ndarray  # int64, one more than items
    buffers: list[np.ndarray]
    chunk_src: np.ndarray  # int64 per chunk
    chunk_at: np.ndarray  # int64 per chunk
    out_addr: np.ndarray  # int64 per item: where its raw bytes go on the device (0: a new tensor)
    where: Callable[[int], Any]  # names item i in errors

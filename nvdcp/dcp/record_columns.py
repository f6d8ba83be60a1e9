"""A GPU batch's small records as columns, for :meth:`nvdcp.gpu.decoder.GpuDecoder.decode_columns`.

A GPU load reads small records in runs (one read per stretch of a file) and parses each run's
headers together (:func:`~nvdcp.pipeline.cpu_batch.parse_records`). Checking them against
``.metadata`` and handing them to the decoder one :class:`~nvdcp.gpu.decoder.DecodeRequest` at a
time cost the read threads tens of microseconds per item, all of it holding the GIL that the
other read threads and the main thread wait for (20,000 small tensors: the load's main cost,
docs/BENCHMARKS.md "Many small tensors"). Here a run's records are checked with numpy against
what ``.metadata`` expects of each, and all runs of a batch become one set of columns.

A run with any record that fails a check is not taken: the caller's per-record path parses it
again and raises the error that names the item. The CPU path checks its batches of records with
the same function (:func:`records_as_expected`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from nvdcp.format.dtypes import DTYPE_TO_CODE
from nvdcp.format.header import KIND_BYTES, KIND_TENSOR, MAX_PLANES
from nvdcp.gpu.columns import RecordColumns
from nvdcp.pipeline.cpu_batch import ParsedRecords


@dataclass
class _TakenRun:
    buffer: np.ndarray
    parsed: ParsedRecords
    rows: np.ndarray  # the run's records decoded as columns (int64)
    members: list[int]  # their items' positions in the batch
    whole: list[torch.Tensor | None]  # the destination each is decoded straight into, or None


@dataclass
class ColumnBatch:
    """The records of a GPU batch decoded as columns, run by run."""

    runs: list[_TakenRun] = field(default_factory=list)

    def __len__(self) -> int:
        return sum(len(run.rows) for run in self.runs)

    def add_run(self, buffer: np.ndarray, parsed: ParsedRecords, members: Sequence[int],
                expected: Sequence[tuple[torch.dtype | None, tuple[int, ...] | None]], deltas: Sequence[bool],
                targets: Sequence[tuple[torch.Tensor, int] | None], device: torch.device,
                takes_whole: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> np.ndarray:
        """Take the records of one parsed run (record ``j``: item ``members[j]``, which
        ``.metadata`` says holds ``expected[j]`` (dtype, shape) and is a delta where
        ``deltas[j]``; ``targets[j]``: its destination and that size in bytes, or None) if every
        one passes the checks :meth:`NvcompReader._check_against_metadata` makes; returns which
        were taken (none on a failed check; those ``takes_whole`` refuses neither)."""
        k = len(members)
        if not records_as_expected(parsed, expected, deltas):
            return np.zeros(k, dtype=bool)
        f = parsed.fields
        take = takes_whole(parsed.first_chunk[1:] - parsed.first_chunk[:-1], f.chunk_bytes)
        rows = np.flatnonzero(take)
        if len(rows):
            raw = f.raw.tolist()
            whole = []
            for j in rows.tolist():
                found = targets[j]
                fits = found is not None and found[1] == raw[j] and found[0].device == device
                whole.append(found[0] if fits else None)  # type: ignore[index]
            self.runs.append(_TakenRun(buffer, parsed, rows, [members[j] for j in rows.tolist()], whole))
        return take

    def columns(self, where: Callable[[int], Any]) -> RecordColumns:
        """All taken records as one set of columns (row ``i``: the ``i``-th taken, run by run;
        ``where(i)`` names it)."""
        pieces = [_run_columns(run, src) for src, run in enumerate(self.runs)]
        first = [np.zeros(1, dtype=np.int64)]
        total = 0
        for piece in pieces:
            first.append(piece["first_chunk"][1:] + total)
            total += int(piece["first_chunk"][-1])

        def joined(name: str) -> np.ndarray:
            return np.concatenate([piece[name] for piece in pieces])

        return RecordColumns(
            raw=joined("raw"), n_planes=joined("n_planes"), chunk_bytes=joined("chunk_bytes"),
            transform=joined("transform"), codecs=np.concatenate([piece["codecs"] for piece in pieces], axis=0),
            dtype_codes=joined("dtype_codes"), sizes=joined("sizes"), crcs=joined("crcs"),
            first_chunk=np.concatenate(first), buffers=[run.buffer for run in self.runs], chunk_src=joined("chunk_src"),
            chunk_at=joined("chunk_at"), out_addr=joined("out_addr"), where=where,
        )

    def members(self) -> list[int]:
        """The items' batch positions, in column order."""
        return [i for run in self.runs for i in run.members]

    def destinations(self) -> list[torch.Tensor | None]:
        return [t for run in self.runs for t in run.whole]

    def header(self, column: int) -> Any:
        """The :class:`~nvdcp.format.header.ItemHeader` of column ``column`` (built on demand)."""
        for run in self.runs:
            if column < len(run.rows):
                return run.parsed.headers[int(run.rows[column])]
            column -= len(run.rows)
        raise IndexError(column)


def _run_columns(run: _TakenRun, src: int) -> dict[str, np.ndarray]:
    parsed, rows = run.parsed, run.rows
    fields = parsed.fields
    n_chunks = parsed.first_chunk[1:] - parsed.first_chunk[:-1]
    if len(rows) == len(n_chunks):
        ids = np.arange(len(parsed.sizes), dtype=np.int64)
    else:
        counts = n_chunks[rows]
        ids = np.repeat(parsed.first_chunk[rows] - (np.cumsum(counts) - counts), counts) + np.arange(
            int(counts.sum()), dtype=np.int64)
    first = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(n_chunks[rows], out=first[1:])
    codes = np.where(fields.kind[rows] == KIND_BYTES, -1, fields.dtype_code[rows])
    out_addr = np.fromiter((t.data_ptr() if t is not None else 0 for t in run.whole), dtype=np.int64, count=len(rows))
    return {
        "raw": fields.raw[rows], "n_planes": fields.n_planes[rows], "chunk_bytes": fields.chunk_bytes[rows],
        "transform": fields.transform[rows], "codecs": fields.codec_matrix(MAX_PLANES)[rows], "dtype_codes": codes,
        "sizes": parsed.sizes[ids], "crcs": parsed.crcs[ids], "first_chunk": first,
        "chunk_src": np.full(len(ids), src, dtype=np.int64), "chunk_at": parsed.starts[ids], "out_addr": out_addr,
    }


def records_as_expected(parsed: ParsedRecords, expected: Sequence[tuple[torch.dtype | None, tuple[int, ...] | None]],
                     deltas: Sequence[bool]) -> bool:
    """Whether every record is what ``.metadata`` says: a delta exactly where it says so; a
    bytes item where it has no dtype; else a tensor of its dtype and shape, of that many bytes,
    with one byte plane per element byte when split into planes."""
    f = parsed.fields
    k = len(expected)
    codes, sizes, ndims, numels = [], [], [], []
    dims: list[int] = []
    for dtype, shape in expected:
        if dtype is None:
            codes.append(-1)
            sizes.append(1)
            ndims.append(0)
            numels.append(0)
            continue
        if shape is None:
            return False  # no chunk of this shape in .metadata: the per-record path decides
        codes.append(DTYPE_TO_CODE.get(dtype, -2))  # -2 matches no stored code: the per-record path names it
        sizes.append(dtype.itemsize)
        ndims.append(len(shape))
        dims.extend(shape)
        numels.append(math.prod(shape))
    code = np.asarray(codes, dtype=np.int64)
    element = np.asarray(sizes, dtype=np.int64)
    tensor = code >= 0
    if (f.delta != np.asarray(deltas, dtype=bool)).any():
        return False
    if (f.kind != np.where(tensor, KIND_TENSOR, KIND_BYTES)).any() or (tensor & (f.dtype_code != code)).any():
        return False
    ndim = np.asarray(ndims, dtype=np.int64)
    if (tensor & (f.ndim != ndim)).any():
        return False
    kept = np.repeat(tensor, f.ndim)  # the stored dims of tensor records (bytes items store none)
    if not np.array_equal(f.shapes[kept].astype(np.int64), np.asarray(dims, dtype=np.int64)):
        return False
    if (tensor & (np.asarray(numels, dtype=np.int64) * element != f.raw)).any():
        return False
    return not (tensor & (f.transform != 0) & (f.n_planes != element)).any() and len(f.raw) == k

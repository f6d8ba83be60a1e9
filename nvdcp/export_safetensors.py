"""Export a DCP checkpoint (nvdcp or stock) as consolidated, sharded safetensors files.

The output is what Hugging Face tools read: ``model-00001-of-0000K.safetensors`` files and
``model.safetensors.index.json`` (``{"metadata": {"total_size": N}, "weight_map": {name: file}}``),
sharded like ``save_pretrained`` (``max_shard_size``, default 5 GB; a tensor larger than that
gets a file of its own). Each tensor is written whole, under its DCP fully qualified name: a
tensor saved sharded across ranks (several stored chunks with offsets) is assembled from its
chunks. Non-tensor (byte) items have no safetensors form; they are skipped and listed.

Memory is bounded by ``max_memory``: items are read through :class:`nvdcp.convert.Source` one
stored chunk at a time, a bounded number in flight, and each chunk is written straight into its
place in the output file (``os.pwrite`` of its contiguous runs: a chunk covering a block of
columns of a 2-D tensor is one run per row; short, dense runs go through a read-modify-write
window). The file's header (dtype, shape and byte range of every tensor) is known from
``.metadata`` before any data is read, so a file is laid out first and filled in any order.
Sharded tensors that fit in a quarter of the budget are assembled in memory and written with one
call; larger ones are never held whole. Limit: :meth:`Source.read` decodes a stored chunk whole
(an nvdcp item costs its stored record plus twice its size, for the byte-plane merge), so peak
memory is about the larger of the budget and ~3x the largest stored chunk.

Atomicity: files are written under their final names and ``model.safetensors.index.json`` last
(through a temporary name and a rename); a failed export removes what it wrote.
"""

from __future__ import annotations

import ctypes
import functools
import json
import math
import os
import re
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from numpy.lib.stride_tricks import as_strided
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from nvdcp.convert import Source, bounded_map
from nvdcp.errors import CheckpointExistsError, CorruptCheckpointError
from nvdcp.report import Report

INDEX_NAME = "model.safetensors.index.json"
#: ``save_pretrained``'s default: 5 GB (decimal).
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9
#: ``--dtype`` names (and their long spellings).
DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16,
    "fp32": torch.float32, "float32": torch.float32,
}
#: torch dtype -> safetensors dtype string (the safetensors format's list).
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint64: "U64", torch.uint32: "U32", torch.uint16: "U16", torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ", torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
    torch.complex64: "C64",
}
#: Output weight files that ``overwrite`` replaces (other files in the directory, such as a
#: model's config.json, are left alone).
_WEIGHT_FILE = re.compile(r"^model(?:-\d{5,}-of-\d{5,})?\.safetensors$")
#: A chunk whose contiguous runs start less than this many bytes apart in the file is placed
#: through a read-modify-write window (read the file span, fill the runs in, write it back);
#: otherwise each run is one ``pwrite``. Measured on a 2-core VM, four 32 MiB column blocks:
#: 256-byte runs 1 KiB apart 0.27 s windowed vs 1.07 s per run; 1 KiB runs 4 KiB apart 0.49 vs
#: 0.41 s; 2 KiB runs 16 KiB apart 1.33 vs 0.50 s.
_DENSE_RUNS_BYTES = 4096
_MIN_MEMORY = 1 << 20


@dataclass
class ExportedFile:
    name: str
    tensors: int
    #: file size: 8-byte length, JSON header, tensor data
    size: int


@dataclass
class ExportResult:
    """What :func:`export_safetensors` wrote.

    ``total_size`` is the index's ``metadata.total_size``: bytes of tensor data in the output
    (after the ``dtype`` cast). ``skipped`` maps items under ``prefix`` that have no safetensors
    form (byte items, unsupported dtypes) to the reason; ``excluded`` counts the items outside
    ``prefix``. ``streamed`` names the sharded tensors larger than the in-memory limit, written
    chunk by chunk into place; ``largest_chunk_bytes`` is the largest stored chunk read (decoded
    whole: the floor of peak memory).
    """

    source: str
    destination: str
    source_format: str
    prefix: str | None
    dtype: str | None
    files: list[ExportedFile]
    tensors: int
    total_size: int
    source_raw_bytes: int
    skipped: dict[str, str]
    excluded: int
    streamed: list[str]
    largest_chunk_bytes: int
    max_memory: int
    max_shard_size: int
    report: Report

    @property
    def seconds(self) -> float:
        return self.report.seconds

    def as_dict(self) -> dict[str, Any]:
        return {
            "source": self.source, "destination": self.destination, "source_format": self.source_format,
            "to": "safetensors", "prefix": self.prefix, "dtype": self.dtype, "index": INDEX_NAME,
            "files": [vars(f) for f in self.files], "tensors": self.tensors, "total_size": self.total_size,
            "source_raw_bytes": self.source_raw_bytes, "skipped": self.skipped, "excluded": self.excluded,
            "streamed": self.streamed, "largest_chunk_bytes": self.largest_chunk_bytes,
            "max_memory": self.max_memory, "max_shard_size": self.max_shard_size,
            "seconds": round(self.report.seconds, 4),
            "phases": {k: round(v, 4) for k, v in sorted(self.report.phases.items())},
        }


@dataclass
class _Tensor:
    fqn: str
    dtype: torch.dtype
    out_dtype: torch.dtype
    shape: tuple[int, ...]
    #: the source's stored chunks of this tensor (``Source.jobs()`` entries)
    jobs: list[Any] = field(default_factory=list)
    #: byte offset of the tensor in its file's data section
    start: int = 0

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.out_dtype.itemsize

    @property
    def cast(self) -> bool:
        return self.out_dtype != self.dtype


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """``"bf16"``/``"fp16"``/``"fp32"`` (or a floating torch dtype) -> torch dtype; None stays None."""
    if dtype is None or isinstance(dtype, torch.dtype):
        if isinstance(dtype, torch.dtype) and not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating point type, got {dtype}")
        return dtype
    try:
        return DTYPES[dtype.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}: use one of bf16, fp16, fp32") from None


def shard_names(n: int) -> list[str]:
    """Hugging Face's sharded file names: ``model-00001-of-00003.safetensors``..."""
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def plan_shards(sizes: list[tuple[str, int]], max_shard_size: int) -> list[list[str]]:
    """Split ``(name, bytes)`` pairs into files as ``save_pretrained`` does: in order, a new file
    when the next tensor would push the current one past ``max_shard_size``; a tensor larger than
    that alone in a file of its own."""
    shards: list[list[str]] = []
    current: list[str] = []
    current_size = 0
    for name, size in sizes:
        if size > max_shard_size:
            shards.append([name])
            continue
        if current and current_size + size > max_shard_size:
            shards.append(current)
            current, current_size = [], 0
        current.append(name)
        current_size += size
    if current:
        shards.append(current)
    return shards


def _c_strides(shape: tuple[int, ...]) -> list[int]:
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    return strides


def check_tiling(fqn: str, shape: tuple[int, ...], chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> None:
    """Raise unless the ``(offsets, sizes)`` chunks cover the tensor exactly once."""
    numel = math.prod(shape)
    total = 0
    boxes = []
    for offsets, sizes in chunks:
        if len(offsets) != len(shape) or len(sizes) != len(shape) or any(
            o < 0 or s < 0 or o + s > g for o, s, g in zip(offsets, sizes, shape)
        ):
            raise CorruptCheckpointError(
                f"{fqn}: stored chunk at offsets {list(offsets)} of size {list(sizes)} is outside shape {list(shape)}"
            )
        total += math.prod(sizes)
        if math.prod(sizes):
            boxes.append((offsets, sizes))
    if total != numel:
        raise CorruptCheckpointError(
            f"{fqn}: stored chunks hold {total} elements, shape {list(shape)} has {numel} "
            "(chunks missing or overlapping)"
        )
    if len(boxes) > 1 and shape:
        lo = np.array([b[0] for b in boxes], dtype=np.int64)
        hi = lo + np.array([b[1] for b in boxes], dtype=np.int64)
        for i in range(len(boxes) - 1):
            overlap = np.all(np.maximum(lo[i], lo[i + 1:]) < np.minimum(hi[i], hi[i + 1:]), axis=1)
            if overlap.any():
                j = i + 1 + int(np.argmax(overlap))
                raise CorruptCheckpointError(
                    f"{fqn}: stored chunks at offsets {list(boxes[i][0])} and {list(boxes[j][0])} overlap"
                )


# -- writing one safetensors file --------------------------------------------------------------
def _header_bytes(tensors: list[_Tensor], metadata: dict[str, str]) -> bytes:
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    for t in tensors:
        header[t.fqn] = {
            "dtype": SAFETENSORS_DTYPES[t.out_dtype], "shape": list(t.shape),
            "data_offsets": [t.start, t.start + t.nbytes],
        }
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    return text + b" " * (-len(text) % 8)  # 8-byte aligned data section, as the safetensors library writes


class _OutputFile:
    """One safetensors file, laid out (header written, size set) before its data is filled in."""

    def __init__(self, path: str, tensors: list[_Tensor], metadata: dict[str, str]) -> None:
        header = _header_bytes(tensors, metadata)
        self.path = path
        self.data_start = 8 + len(header)
        self.size = self.data_start + sum(t.nbytes for t in tensors)
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            self.pwrite(memoryview(len(header).to_bytes(8, "little") + header), 0)
            os.ftruncate(self.fd, self.size)  # sparse until filled; reads of unfilled ranges give zeros
        except BaseException:
            os.close(self.fd)
            raise

    def pwrite(self, data: memoryview, offset: int) -> None:
        data = data.cast("B")
        while len(data):
            n = os.pwrite(self.fd, data, offset)
            data, offset = data[n:], offset + n

    def pread_into(self, buf: memoryview, offset: int) -> None:
        while len(buf):
            n = os.preadv(self.fd, [buf], offset)
            if n <= 0:
                raise OSError(f"{self.path}: short read at {offset}")
            buf, offset = buf[n:], offset + n

    def finish(self) -> None:
        os.fsync(self.fd)
        os.close(self.fd)
        self.fd = -1

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def place(self, tensor: _Tensor, offsets: tuple[int, ...], sizes: tuple[int, ...], data: np.ndarray,
              window: int) -> None:
        """Write ``data`` (flat uint8, the chunk's elements in C order, output dtype) into the
        region ``offsets:offsets+sizes`` of ``tensor``."""
        b = tensor.out_dtype.itemsize
        shape = tensor.shape
        base = self.data_start + tensor.start
        partial = [i for i in range(len(shape)) if sizes[i] != shape[i]]
        if not partial:
            self.pwrite(data.data, base)
            return
        g = _c_strides(shape)
        j = partial[-1]  # dims after j are covered whole: one run spans sizes[j] * g[j] elements
        run = sizes[j] * g[j]
        outer = sizes[:j]
        first = sum(o * s for o, s in zip(offsets, g))
        if math.prod(outer) <= 1:
            self.pwrite(data.data, base + first * b)
            return
        if g[j - 1] * b >= _DENSE_RUNS_BYTES:
            mv, runb, step = data.data, run * b, g[j - 1] * b
            k = 0
            for idx in np.ndindex(*sizes[:j - 1]):
                at = base + (first + sum(i * gi for i, gi in zip(idx, g))) * b
                for r in range(sizes[j - 1]):
                    self.pwrite(mv[k * runb:(k + 1) * runb], at + r * step)
                    k += 1
            return
        self._place_windowed(base, b, offsets, sizes, g, j, run, data, window)

    def _place_windowed(self, base: int, b: int, offsets: tuple[int, ...], sizes: tuple[int, ...], g: list[int],
                        j: int, run: int, data: np.ndarray, window: int) -> None:
        """Short runs: read the file span holding a block of them, fill them in, write it back."""
        win_el = max(window // b, run)

        def span1(q: int) -> int:  # elements spanned by the block with indices < q fixed, one index at q
            return sum((sizes[i] - 1) * g[i] for i in range(q + 1, j)) + run

        q = next(q for q in range(j) if span1(q) <= win_el)  # q = j - 1 always qualifies
        k = max(1, min(sizes[q], (win_el - span1(q)) // g[q] + 1))
        src = data.reshape(*sizes[:j], run * b)
        buf = np.empty(((k - 1) * g[q] + span1(q)) * b, dtype=np.uint8)
        strides = tuple(g[i] * b for i in range(q, j)) + (1,)
        tail = sum(offsets[i] * g[i] for i in range(q, len(sizes)))
        for idx in np.ndindex(*sizes[:q]):
            head = sum((offsets[i] + idx[i]) * g[i] for i in range(q))
            for t in range(0, sizes[q], k):
                kk = min(k, sizes[q] - t)
                at = base + (head + tail + t * g[q]) * b
                span = buf.data[:((kk - 1) * g[q] + span1(q)) * b]
                self.pread_into(span, at)
                view = as_strided(buf, shape=(kk, *sizes[q + 1:j], run * b), strides=strides, writeable=True)
                view[...] = src[tuple(idx) + (slice(t, t + kk),)]
                self.pwrite(span, at)


# -- the export --------------------------------------------------------------------------------
def _local_directory(dst: str | os.PathLike[str]) -> str:
    spec = os.fspath(dst).removeprefix("file://")
    if "://" in spec:
        raise ValueError(f"safetensors output goes to a local directory; got {spec!r}")
    return os.path.abspath(spec)


def _prefixes(names: list[str], limit: int = 8) -> str:
    firsts = list(dict.fromkeys(n.split(".", 1)[0] + ("." if "." in n else "") for n in names))
    return ", ".join(repr(p) for p in firsts[:limit]) + (", ..." if len(firsts) > limit else "")


class _Exporter:
    def __init__(self, src: str, dst: str, *, max_memory: int, max_shard_size: int, prefix: str | None,
                 dtype: torch.dtype | None, threads: int, overwrite: bool,
                 storage_options: dict[str, Any] | None) -> None:
        if max_memory < _MIN_MEMORY:
            raise ValueError(f"max_memory must be at least 1 MiB, got {max_memory}")
        if max_shard_size < 1:
            raise ValueError(f"max_shard_size must be positive, got {max_shard_size}")
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        if sys.byteorder != "little":
            raise ValueError("safetensors data is little-endian; exporting on a big-endian machine is not supported")
        self.path = _local_directory(dst)
        self.source = Source(src, threads=threads, storage_options=storage_options)
        if "://" not in src.removeprefix("file://") and os.path.realpath(src.removeprefix("file://")) == os.path.realpath(self.path):
            raise ValueError(f"source and destination are the same location ({self.path})")
        self.max_memory = max_memory
        self.max_shard_size = max_shard_size
        self.prefix = prefix
        self.dtype = dtype
        self.threads = threads
        self.overwrite = overwrite
        self.report = Report("export", self.path)
        # a quarter of the budget for a tensor assembled in memory, half for items in flight,
        # the rest for the read-modify-write window of short runs
        self.assemble_limit = max_memory // 4
        self.window = max(64 << 10, min(max_memory // 8, 16 << 20))
        self.trim_bytes = max(1 << 20, max_memory // 16)

    # -- planning -----------------------------------------------------------------------------
    def plan(self) -> tuple[list[_Tensor], dict[str, str], int, list[Any]]:
        jobs = self.source.jobs()
        by_fqn: dict[str, list[Any]] = {}
        for job in jobs:
            by_fqn.setdefault(job.index.fqn, []).append(job)
        tensors: list[_Tensor] = []
        skipped: dict[str, str] = {}
        excluded = 0
        names = list(self.source.metadata.state_dict_metadata)
        for fqn, md in self.source.metadata.state_dict_metadata.items():
            if self.prefix is not None and not fqn.startswith(self.prefix):
                excluded += 1
                continue
            if isinstance(md, BytesStorageMetadata):
                skipped[fqn] = "not a tensor"
                continue
            if not isinstance(md, TensorStorageMetadata):
                skipped[fqn] = f"unknown item kind {type(md).__name__}"
                continue
            dtype = md.properties.dtype
            out = self.dtype if self.dtype is not None and dtype.is_floating_point else dtype
            if out not in SAFETENSORS_DTYPES:
                skipped[fqn] = f"dtype {str(dtype).removeprefix('torch.')} has no safetensors type"
                continue
            t = _Tensor(fqn, dtype, out, tuple(md.size), sorted(by_fqn.get(fqn, []), key=lambda j: list(j.index.offset or [])))
            check_tiling(fqn, t.shape, [(tuple(j.index.offset or ()), tuple(j.shape)) for j in t.jobs])
            tensors.append(t)
        if not tensors:
            if self.prefix is not None:
                raise ValueError(
                    f"prefix {self.prefix!r} matches no tensor in {self.source.storage.url}; "
                    f"its keys start with {_prefixes(names)}"
                )
            raise ValueError(f"{self.source.storage.url} holds no tensor to export")
        return tensors, skipped, excluded, jobs

    # -- destination --------------------------------------------------------------------------
    def prepare_destination(self) -> bool:
        """Make the output directory ready; True when this export created it."""
        path = self.path
        if not os.path.lexists(path):
            os.makedirs(path)
            return True
        if not os.path.isdir(path):
            raise CheckpointExistsError(f"{path} exists and is not a directory")
        entries = os.listdir(path)
        if entries:
            if not self.overwrite:
                raise CheckpointExistsError(f"{path} exists and is not empty; pass --overwrite to replace its safetensors files")
            # the index first: a reader never sees an index naming files being replaced
            old = [INDEX_NAME] if INDEX_NAME in entries else []
            old += sorted(e for e in entries if _WEIGHT_FILE.match(e))
            for name in old:
                os.unlink(os.path.join(path, name))
        return False

    # -- reading ------------------------------------------------------------------------------
    def load(self, task: tuple[_Tensor, Any]) -> list[np.ndarray]:
        """The chunk's bytes in the output dtype, in a list the consumer empties: the future
        holding it outlives its use in :func:`bounded_map` (until the next one is submitted)."""
        tensor, job = task
        raw = self.source.read(job)
        if not tensor.cast:
            return [raw]
        t0 = time.perf_counter()
        if not raw.flags.writeable:
            raw = raw.copy()
        src = torch.from_numpy(raw).view(tensor.dtype)
        out = src.to(tensor.out_dtype).view(torch.uint8).numpy()
        del src, raw
        self.report.add(0, 0, cast_s=time.perf_counter() - t0)
        return [out]

    def cost(self, task: tuple[_Tensor, Any]) -> int:
        """Peak bytes of reading the chunk: the stored record, the decoded bytes twice (nvdcp's
        byte-plane merge), the cast copy."""
        tensor, job = task
        out = math.prod(job.shape) * tensor.out_dtype.itemsize if tensor.cast else 0
        return job.info.length + 2 * job.raw_nbytes + out

    # -- the run ------------------------------------------------------------------------------
    def run(self, progress: Callable[[int, int], None] | None) -> ExportResult:
        started = time.perf_counter()
        tensors, skipped, excluded, jobs = self.plan()
        by_name = {t.fqn: t for t in tensors}
        groups = plan_shards([(t.fqn, t.nbytes) for t in tensors], self.max_shard_size)
        names = shard_names(len(groups))
        layout: list[list[_Tensor]] = []
        for group in groups:
            # widest elements first: every tensor starts aligned to its element size
            members = sorted((by_name[n] for n in group), key=lambda t: -t.out_dtype.itemsize)
            at = 0
            for t in members:
                t.start = at
                at += t.nbytes
            layout.append(members)
        total = sum(j.raw_nbytes for t in tensors for j in t.jobs)
        streamed = [t.fqn for t in tensors if self._mode(t) == "stream"]
        created_dir = self.prepare_destination()
        written: list[str] = []
        files: list[ExportedFile] = []
        done = 0
        try:
            with ThreadPoolExecutor(self.threads, thread_name_prefix="nvdcp-export") as pool:
                for name, members in zip(names, layout):
                    path = os.path.join(self.path, name)
                    out = _OutputFile(path, members, {"format": "pt"})
                    written.append(path)
                    try:
                        for n in self._fill(out, members, pool):
                            done += n
                            if progress:
                                progress(done, total)
                        t0 = time.perf_counter()
                        out.finish()
                        self.report.add(0, 0, write_s=time.perf_counter() - t0)
                    finally:
                        out.close()
                    files.append(ExportedFile(name, len(members), out.size))
            index = {
                "metadata": {"total_size": sum(t.nbytes for t in tensors)},
                "weight_map": {t.fqn: name for name, members in zip(names, layout) for t in members},
            }
            tmp = os.path.join(self.path, f".{INDEX_NAME}.{uuid.uuid4().hex[:12]}.tmp")
            written.append(tmp)
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(json.dumps(index, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, os.path.join(self.path, INDEX_NAME))
            _fsync_dir(self.path)
        except BaseException:
            for p in written:
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass
            if created_dir:
                try:
                    os.rmdir(self.path)
                except OSError:
                    pass
            raise
        for phase, seconds in self.source.report.phases.items():
            self.report.add(0, 0, **{phase: seconds})
        self.report.add(self.source.report.raw_bytes, sum(f.size for f in files))
        self.report.seconds = time.perf_counter() - started
        selected = [j for t in tensors for j in t.jobs]
        kinds = {"nvdcp" if Source.is_nvdcp(j.info) else "stock" for j in jobs}
        return ExportResult(
            source=self.source.storage.url, destination=self.path,
            source_format="mixed" if len(kinds) > 1 else (kinds.pop() if kinds else "empty"),
            prefix=self.prefix, dtype=None if self.dtype is None else str(self.dtype).removeprefix("torch."),
            files=files, tensors=len(tensors), total_size=sum(t.nbytes for t in tensors),
            source_raw_bytes=total, skipped=skipped, excluded=excluded, streamed=streamed,
            largest_chunk_bytes=max((j.raw_nbytes for j in selected), default=0),
            max_memory=self.max_memory, max_shard_size=self.max_shard_size, report=self.report,
        )

    def _mode(self, t: _Tensor) -> str:
        """``whole``: every chunk is one contiguous run of the output (one write each);
        ``assemble``: built in memory, one write; ``stream``: chunk by chunk into place."""
        contiguous = all(_is_contiguous(t.shape, tuple(j.index.offset or ()), tuple(j.shape)) for j in t.jobs)
        if contiguous:
            return "whole"
        return "assemble" if t.nbytes <= self.assemble_limit else "stream"

    def _fill(self, out: _OutputFile, members: list[_Tensor], pool: ThreadPoolExecutor) -> Iterator[int]:
        """Read every chunk of the file's tensors (a bounded number in flight) and put it in place;
        yields the source bytes done."""
        modes = {t.fqn: self._mode(t) for t in members}
        tasks = [(t, j) for t in members for j in t.jobs if math.prod(j.shape)]
        left = {t.fqn: sum(1 for tt, _ in tasks if tt is t) for t in members}
        buffers: dict[str, np.ndarray] = {}
        results = bounded_map(self.load, tasks, self.cost, self.max_memory // 2, pool, 2 * self.threads)
        try:
            for i, holder in enumerate(results):
                tensor, job = tasks[i]
                data = holder.pop()
                t0 = time.perf_counter()
                offsets, sizes = tuple(job.index.offset or ()), tuple(job.shape)
                if modes[tensor.fqn] == "assemble":
                    buf = buffers.get(tensor.fqn)
                    if buf is None:
                        buf = buffers[tensor.fqn] = np.empty(tensor.nbytes, dtype=np.uint8)
                    b = tensor.out_dtype.itemsize
                    region = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
                    buf.reshape(*tensor.shape, b)[region] = data.reshape(*sizes, b)
                    left[tensor.fqn] -= 1
                    if not left[tensor.fqn]:
                        out.pwrite(buffers.pop(tensor.fqn).data, out.data_start + tensor.start)
                else:
                    out.place(tensor, offsets, sizes, data, self.window)
                del data
                if job.raw_nbytes >= self.trim_bytes:
                    _release_freed_memory()
                self.report.add(0, 0, write_s=time.perf_counter() - t0)
                yield job.raw_nbytes
        finally:
            close = getattr(results, "close", None)  # a generator: cancels what is queued when writing failed
            if close is not None:
                close()


def _is_contiguous(shape: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...]) -> bool:
    """Whether the region is one contiguous byte range of the C-order tensor."""
    partial = [i for i in range(len(shape)) if sizes[i] != shape[i]]
    return not partial or math.prod(sizes[:partial[-1]]) <= 1


@functools.cache
def _malloc_trim() -> Callable[[], object] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return functools.partial(fn, 0)


def _release_freed_memory() -> None:
    """Hand memory freed after a large chunk back to the OS. glibc keeps freed blocks in the
    arena of the thread that allocated them (here the read workers'), and once a block of a few
    MiB was freed it serves blocks of that size from arenas instead of fresh mappings: without
    this, the 300 MB export of benchmarks/safetensors_export_bench.py peaked 35 MiB higher."""
    trim = _malloc_trim()
    if trim is not None:
        trim()


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def export_safetensors(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    max_memory: int = 1 << 30,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    prefix: str | None = None,
    dtype: str | torch.dtype | None = None,
    storage_options: dict[str, Any] | None = None,
    progress: Callable[[int, int], None] | None = None,
    threads: int = 2,
    overwrite: bool = False,
) -> ExportResult:
    """Write the tensors of the checkpoint at ``src`` (nvdcp or stock DCP, any URL) as
    consolidated safetensors files and ``model.safetensors.index.json`` in the local directory
    ``dst``.

    Args:
        max_memory: bytes of chunk data in memory at once (at least 1 MiB); one stored chunk
            larger than this is still read, alone, and decoded whole.
        max_shard_size: bytes of tensor data per output file (default 5 GB, as
            ``save_pretrained``); a larger tensor gets a file of its own.
        prefix: keep only the items whose name starts with it (e.g. ``"model."``).
        dtype: cast floating point tensors to ``"bf16"``, ``"fp16"`` or ``"fp32"``; integer and
            bool tensors keep their type.
        storage_options: options of the source's storage backend.
        progress: ``progress(done, total)`` in uncompressed source bytes.
        threads: chunks read and decoded at once.
        overwrite: replace the safetensors files (index and ``model*.safetensors``) of a non-empty
            ``dst``; its other files are kept.

    Raises:
        IncompleteCheckpointError: no ``.metadata`` at ``src``.
        CheckpointExistsError: ``dst`` is not empty and ``overwrite`` is False.
        CorruptCheckpointError: a source item fails its checks, or a tensor's stored chunks do
            not cover it exactly once (nothing is left at ``dst``).
        ValueError: an unknown dtype, a prefix matching no tensor, a non-local ``dst``.
    """
    exporter = _Exporter(
        os.fspath(src), os.fspath(dst), max_memory=max_memory, max_shard_size=max_shard_size, prefix=prefix,
        dtype=resolve_dtype(dtype), threads=threads, overwrite=overwrite, storage_options=storage_options,
    )
    return exporter.run(progress)


__all__ = [
    "DEFAULT_MAX_SHARD_SIZE", "DTYPES", "INDEX_NAME", "SAFETENSORS_DTYPES", "ExportResult", "ExportedFile",
    "check_tiling", "export_safetensors", "plan_shards", "resolve_dtype", "shard_names",
]

"""Hypothesis fuzz targets: header parsers, the item decoder with forged checksums, and the reader
over hostile ``.metadata`` records and data files. Each asserts that only ``NvdcpError`` comes out.

They run in a forked worker under ``RLIMIT_AS`` (tests/reliability/test_fuzz.py), so an
unbounded allocation fails as MemoryError, and a crash or an abort kills only that worker.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import pickle
import resource
import shutil
import struct
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo

import nvdcp
from nvdcp.codecs.gdeflate import GDeflateCodec, guarded
from nvdcp.format.header import (
    KIND_BYTES,
    KIND_TENSOR,
    ChunkTable,
    ItemHeader,
    checksum,
    file_header_size,
    item_header_size,
    parse_file_header,
    parse_item_header,
)
from nvdcp.pipeline.cpu import decode_item, encode_item
from nvdcp.pipeline.policy import choose_layout
from nvdcp.testing import empty_like_sd, failure_of
from nvdcp.testing.faults import same_state

EXAMPLES = int(os.environ.get("NVDCP_FUZZ_EXAMPLES", "150"))
#: Outcomes of the examples run in this process, for the report.
SEEN: Counter[str] = Counter()


def fuzz_settings(n: int = EXAMPLES) -> Any:
    return settings(
        max_examples=n, deadline=2000, database=None, derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


def _only_nvdcp(fn: Any, *args: Any) -> Any:
    try:
        out = fn(*args)
    except nvdcp.NvdcpError as exc:
        SEEN[type(exc).__name__] += 1
        return None
    SEEN["parsed"] += 1
    return out


# -- decoder over forged records ----------------------------------------------------------------

@functools.cache
def _records() -> list[tuple[bytes, int, np.ndarray]]:
    """Valid item records of every layout and CPU codec: (record, element size, raw bytes)."""
    out = []
    g = torch.Generator().manual_seed(0)
    tensors = [
        (torch.randn(700, generator=g) * 0.02).float(),
        torch.arange(900, dtype=torch.int64),
        torch.randint(0, 2, (1500,), generator=g).bool(),
    ]
    codecs = ["zstd", "none"] + (["gdeflate"] if GDeflateCodec.available() and guarded() else [])
    for codec in codecs:
        for t in tensors:
            raw = t.contiguous().view(-1).view(torch.uint8).numpy()
            enc = encode_item(raw, kind=KIND_TENSOR, dtype_code=9, shape=tuple(t.shape),
                              element_size=t.element_size(), layout=choose_layout(t.dtype, codec),
                              pool=None, chunk_bytes=1024)
            out.append((enc.header_bytes + b"".join(bytes(c) for c in enc.chunks), t.element_size(), raw))
        blob = np.frombuffer(b"bytes item " * 300, dtype=np.uint8)
        enc = encode_item(blob, kind=KIND_BYTES, dtype_code=0, shape=(), element_size=1,
                          layout=choose_layout(None, codec), pool=None, chunk_bytes=1024)
        out.append((enc.header_bytes + b"".join(bytes(c) for c in enc.chunks), 1, blob))
    return out


def fix_checksums(record: bytearray) -> None:
    """Recompute the header CRC and every chunk CRC, so damage reaches the codecs (a forgery)."""
    try:
        hb = item_header_size(memoryview(record), "forge")
    except nvdcp.NvdcpError:
        return
    if hb > len(record):
        return
    n_planes, ndim = record[9], record[10]
    table = 28 + 8 * ndim + n_planes + (-n_planes) % 4
    pos = hb
    for off in range(table, hb - 4, 8):
        size = struct.unpack_from("<I", record, off)[0]
        struct.pack_into("<I", record, off + 4, checksum(bytes(record[pos : pos + size])))
        pos += size
    struct.pack_into("<I", record, hb - 4, checksum(bytes(record[: hb - 4])))


@st.composite
def forged_records(draw: Any) -> tuple[bytes, int, np.ndarray, bool]:
    records = _records()
    record, esize, raw = records[draw(st.integers(0, len(records) - 1))]
    data = bytearray(record)
    for _ in range(draw(st.integers(0, 6))):
        pos = draw(st.integers(0, len(data) - 1))
        data[pos] = draw(st.integers(0, 255))
    cut = draw(st.one_of(st.none(), st.integers(0, len(data))))
    if cut is not None:
        data = data[:cut]
    if draw(st.booleans()):
        data += draw(st.binary(max_size=64))
    if draw(st.booleans()):
        fix_checksums(data)
    return bytes(data), esize, raw, bytes(data) == record


@given(st.one_of(st.binary(max_size=700), forged_records().map(lambda c: c[0])))
def fuzz_parsers_on_bytes(blob: bytes) -> None:
    view = memoryview(blob)
    _only_nvdcp(parse_item_header, view, "fuzz")
    _only_nvdcp(item_header_size, view, "fuzz")
    _only_nvdcp(file_header_size, view, "fuzz")
    _only_nvdcp(parse_file_header, view, "fuzz")


@st.composite
def synthetic_records(draw: Any) -> tuple[bytes, int, np.ndarray, bool]:
    """Self-consistent headers with arbitrary fields, codecs and chunk sizes, valid checksums
    over random payloads: everything a forger controls, reaching every codec."""
    n_planes = draw(st.sampled_from([1, 2, 4, 8, 16]))
    chunk_bytes = draw(st.sampled_from([1024, 4096, 65536]))
    blocks = draw(st.integers(0, 3))
    last = draw(st.integers(1, chunk_bytes)) if blocks else 0
    raw_nbytes = n_planes * ((blocks - 1) * chunk_bytes + last) if blocks else 0
    codecs = tuple(draw(st.sampled_from([0, 1, 2, 2, 16, 17, 99])) for _ in range(n_planes))
    if 2 in codecs and not (GDeflateCodec.available() and guarded()):
        codecs = tuple(1 if c == 2 else c for c in codecs)
    payloads = []
    for b in range(blocks):
        raw_size = chunk_bytes if b < blocks - 1 else last
        for _ in range(n_planes):
            payloads.append(draw(st.binary(max_size=min(raw_size, 80))) if draw(st.booleans())
                            else bytes(raw_size))
    header = ItemHeader(
        kind=draw(st.sampled_from([KIND_TENSOR, KIND_BYTES])), dtype_code=draw(st.integers(0, 30)),
        shape=tuple(draw(st.lists(st.integers(0, 1 << 62), max_size=3))), raw_nbytes=raw_nbytes,
        transform=draw(st.sampled_from([0, 1])), plane_codecs=codecs,
        chunks=ChunkTable((len(p), checksum(p)) for p in payloads), chunk_bytes=chunk_bytes,
    )
    return header.pack() + b"".join(payloads), draw(st.sampled_from([1, 2, 4, 8, 16])), np.empty(0), False


@given(st.one_of(forged_records(), synthetic_records()))
def fuzz_decode_forged(case: tuple[bytes, int, np.ndarray, bool]) -> None:
    data, esize, raw, unchanged = case
    try:
        _, out = decode_item(memoryview(data), "fuzz", None, esize)
    except nvdcp.NvdcpError as exc:
        assert not unchanged, "a valid record was refused"
        SEEN[type(exc).__name__] += 1
        return
    SEEN["decoded"] += 1
    if unchanged:
        assert np.array_equal(out, raw)


# -- the reader over hostile .metadata and data files -----------------------------------------

def _state() -> dict[str, Any]:
    return {"w": torch.linspace(-1, 1, 3000), "ids": torch.arange(2000), "extra": {"k": "v" * 100}}


@functools.cache
def _checkpoint() -> Path:
    root = Path(tempfile.mkdtemp(prefix="nvdcp-fuzz-"))
    dcp.save(_state(), storage_writer=nvdcp.NvcompWriter(root / "ckpt", chunk_bytes=1024, sync_files=False,
                                                         codec_threads=1))
    (root / "outside.nvdcp").write_bytes(next((root / "ckpt").glob("*.nvdcp")).read_bytes())
    return root / "ckpt"


def _load(path: Path) -> str:
    sd = empty_like_sd(_state())
    try:  # dcp.load reports a read_metadata failure as AssertionError text: ask the reader first
        nvdcp.NvcompReader(path).read_metadata()
        dcp.load(sd, storage_reader=nvdcp.NvcompReader(path, thread_count=1, codec_threads=1))
    except (CheckpointException, nvdcp.NvdcpError) as exc:
        err = failure_of(exc)
        assert isinstance(err, nvdcp.NvdcpError), f"{type(err).__name__}: {err}"
        SEEN[type(err).__name__] += 1
        return "refused"
    result = "intact" if same_state(sd, _state()) else "WRONG"
    SEEN[result] += 1
    return result


_NAMES = st.one_of(
    st.sampled_from(["../outside.nvdcp", "/etc/passwd", "sub/x.nvdcp", "..", ".", "", ".metadata",
                     "__0_0_0.nvdcp", "a\x00b", "C:\\x", "%2e%2e/outside.nvdcp"]),
    st.text(max_size=20), st.integers(), st.none(),
)
_INTS = st.one_of(st.integers(-5, 1 << 20), st.sampled_from([1 << 31, 1 << 32, 1 << 60, 1 << 63, -(1 << 63)]),
                  st.booleans(), st.floats(allow_nan=True), st.none())


@contextlib.contextmanager
def _case(data: Any) -> Iterator[tuple[Path, Any, Any, Any]]:
    """A fresh copy of the checkpoint for one example: its path, its ``.metadata``, and an item
    drawn from it (index and storage info); the copy is removed afterwards."""
    work = Path(tempfile.mkdtemp(prefix="nvdcp-fuzz-case-")) / "ckpt"
    shutil.copytree(_checkpoint(), work)
    try:
        md = pickle.loads((work / ".metadata").read_bytes())
        index = data.draw(st.sampled_from(sorted(md.storage_data, key=lambda ix: ix.fqn)))
        yield work, md, index, md.storage_data[index]
    finally:
        shutil.rmtree(work.parent)


@given(st.data())
def fuzz_reader_records(data: Any) -> None:
    with _case(data) as (work, md, index, info):
        path, offset, length, descs = info.relative_path, info.offset, info.length, info.transform_descriptors
        field = data.draw(st.sampled_from(["path", "offset", "length", "descriptor", "all"]))
        if field in ("path", "all"):
            path = data.draw(_NAMES)
        if field in ("offset", "all"):
            offset = data.draw(_INTS)
        if field in ("length", "all"):
            length = data.draw(_INTS)
        if field in ("descriptor", "all"):
            descs = data.draw(st.one_of(
                st.sampled_from([("nvdcp.zstd/2",), ("nvdcp.brotli/1",), ("nvdcp.zstd/x",), (), None,
                                 ("nvdcp.zstd/1", "nvdcp.none/1"), ("other",)]),
                st.lists(st.text(max_size=12), max_size=2).map(tuple)))
        md.storage_data[index] = _StorageInfo(path, offset, length, descs)
        (work / ".metadata").write_bytes(pickle.dumps(md))
        result = _load(work)
        assert result != "WRONG"


@given(st.data())
def fuzz_reader_files(data: Any) -> None:
    with _case(data) as (work, _, index, info):
        # A forged bytes item is a valid nvdcp item holding other bytes: what torch's planner then
        # makes of them (torch.load) is not nvdcp's to check. Forge tensors only.
        forgeable = index.fqn != "extra.k"
        f = work / info.relative_path
        blob = bytearray(f.read_bytes())
        record = bytearray(blob[info.offset : info.offset + info.length])
        for _ in range(data.draw(st.integers(1, 4))):
            pos = data.draw(st.integers(0, len(record) - 1))
            record[pos] = data.draw(st.integers(0, 255))
        forged = forgeable and data.draw(st.booleans())
        if forged:
            fix_checksums(record)
        blob[info.offset : info.offset + info.length] = record
        f.write_bytes(blob)
        result = _load(work)
        # Damage is always caught; a forgery with valid checksums may decode to other values
        # (it is a different, valid file), but must still fail only with NvdcpError.
        assert result != "WRONG" or forged
        SEEN["forged" if forged else "damaged"] += 1


TARGETS = {
    "parsers": fuzz_parsers_on_bytes,
    "decode_forged": fuzz_decode_forged,
    "reader_records": fuzz_reader_records,
    "reader_files": fuzz_reader_files,
}


def run(name: str, examples: int, headroom: int) -> dict[str, Any]:
    """Run one target under RLIMIT_AS = current size + ``headroom``; report peak RSS growth."""
    logging.getLogger("torch.distributed.checkpoint").setLevel(logging.CRITICAL)  # expected failures
    with open("/proc/self/statm") as f:
        vm = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (vm + headroom, resource.RLIM_INFINITY))
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    target = TARGETS[name]
    if name in ("reader_records", "reader_files"):
        _checkpoint()
    fuzz_settings(examples)(target)()
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"target": name, "examples": examples, "outcomes": dict(SEEN), "rss_growth_kib": rss1 - rss0,
            "rlimit_as": vm + headroom}

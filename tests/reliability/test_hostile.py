"""Hostile input: crafted ``.metadata`` records and headers fail fast with an NvdcpError before
anything big is allocated; object names cannot leave the checkpoint; unknown versions are refused;
``.metadata`` pickles that name anything beyond DCP's own classes are refused without running it;
a forged GDeflate stream with valid checksums is an error, not an abort."""

from __future__ import annotations

import os
import pickle
import resource
import shutil
import struct
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata

import nvdcp
from nvdcp.codecs.gdeflate import GDeflateCodec, guarded
from nvdcp.dcp.any_metadata import load_any_metadata
from nvdcp.format.header import checksum
from nvdcp.storage import open_storage
from nvdcp.testing import empty_like_sd, failure_of
from nvdcp.testing import faults as F
from nvdcp.testing.fuzz_targets import fix_checksums

pytestmark = pytest.mark.timeout(120)


def _state() -> dict[str, Any]:
    return {"w": torch.linspace(-1, 1, 5000), "ids": torch.arange(3000), "extra": {"k": "v"}}


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    path = tmp_path / "ckpt"
    dcp.save(_state(), storage_writer=nvdcp.NvcompWriter(path, sync_files=False, codec_threads=1))
    return path


def _edit_record(path: Path, fqn: str, **changes: Any) -> _StorageInfo:
    md = pickle.loads((path / ".metadata").read_bytes())
    index = next(ix for ix in md.storage_data if ix.fqn == fqn)
    old = md.storage_data[index]
    fields = {"relative_path": old.relative_path, "offset": old.offset, "length": old.length,
                  "transform_descriptors": old.transform_descriptors}
    fields.update(changes)
    md.storage_data[index] = _StorageInfo(**fields)
    (path / ".metadata").write_bytes(pickle.dumps(md))
    return old


def _load_error(path: Path) -> BaseException:
    try:
        nvdcp.NvcompReader(path).read_metadata()
    except nvdcp.NvdcpError as exc:
        return exc
    with pytest.raises((CheckpointException, nvdcp.NvdcpError)) as info:
        dcp.load(empty_like_sd(_state()), storage_reader=nvdcp.NvcompReader(path, thread_count=1))
    return failure_of(info.value)


# -- sizes: validated against the file before allocating --------------------------------------

def _load_capped(path: str, headroom: int) -> tuple[str, str, int, float]:
    with open("/proc/self/statm") as f:
        vm = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (vm + headroom, resource.RLIM_INFINITY))
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    try:
        dcp.load(empty_like_sd(_state()), storage_reader=nvdcp.NvcompReader(path, thread_count=1))
        name, msg = "loaded", ""
    except BaseException as exc:
        err = failure_of(exc)
        name, msg = type(err).__name__, str(err)
    return name, msg, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0, time.perf_counter() - t0


@pytest.mark.parametrize("length", [1 << 34, 1 << 60])
def test_record_longer_than_its_file_fails_before_allocating(ckpt: Path, length: int) -> None:
    old = _edit_record(ckpt, "w", length=length)
    result = F.call_in_process(_load_capped, str(ckpt), 1 << 30)
    assert result[0] == "ok", result
    name, msg, rss_growth_kib, seconds = result[1]
    assert name == "TruncatedCheckpointError", (name, msg)
    # The storage layer names the file and the range (reader.py does not add the item name here).
    assert old.relative_path in msg and f"offset {old.offset}" in msg
    assert rss_growth_kib < 256 * 1024 and seconds < 10


def test_item_header_claiming_2_60_bytes_fails_fast(ckpt: Path) -> None:
    md = nvdcp.NvcompReader(ckpt).read_metadata()
    info = next(i for ix, i in md.storage_data.items() if ix.fqn == "w")
    f = ckpt / info.relative_path
    data = bytearray(f.read_bytes())
    record = data[info.offset : info.offset + info.length]
    struct.pack_into("<Q", record, 16, 1 << 60)  # raw_nbytes
    fix_checksums(record)  # a forgery, not damage: every checksum matches
    data[info.offset : info.offset + info.length] = record
    f.write_bytes(data)
    result = F.call_in_process(_load_capped, str(ckpt), 1 << 30)
    name, msg, rss_growth_kib, seconds = result[1]
    assert name == "CorruptCheckpointError" and "header claims" in msg and f.name in msg, msg
    assert rss_growth_kib < 256 * 1024 and seconds < 10


@pytest.mark.parametrize("offset,length", [(-1, 10), (True, 10), (0, 1 << 63), (0.5, 10), ("0", 10)])
def test_impossible_ranges_refused_at_read_metadata(ckpt: Path, offset: Any, length: Any) -> None:
    _edit_record(ckpt, "ids", offset=offset, length=length)
    err = _load_error(ckpt)
    assert isinstance(err, nvdcp.CorruptCheckpointError) and "'ids'" in str(err), err


# -- names cannot leave the checkpoint ----------------------------------------------------------

@pytest.mark.parametrize("kind", ["dotdot", "absolute", "subdir", "dot", "empty", "nul", "not-a-str"])
def test_relative_paths_cannot_escape(ckpt: Path, kind: str) -> None:
    md = nvdcp.NvcompReader(ckpt).read_metadata()
    real = next(i for ix, i in md.storage_data.items() if ix.fqn == "w").relative_path
    # A valid copy of the data file outside the root: following the name would load fine.
    outside = ckpt.parent / real
    shutil.copy(ckpt / real, outside)
    (ckpt / "sub").mkdir()
    shutil.copy(ckpt / real, ckpt / "sub" / real)
    name = {"dotdot": f"../{real}", "absolute": str(outside), "subdir": f"sub/{real}", "dot": ".",
            "empty": "", "nul": f"{real}\x00", "not-a-str": 7}[kind]
    _edit_record(ckpt, "w", relative_path=name)
    err = _load_error(ckpt)
    assert isinstance(err, nvdcp.CorruptCheckpointError) and "refusing object name" in str(err), err
    assert "'w'" in str(err)


def test_symlink_pointing_outside_is_refused(ckpt: Path) -> None:
    md = nvdcp.NvcompReader(ckpt).read_metadata()
    name = next(i for ix, i in md.storage_data.items() if ix.fqn == "w").relative_path
    outside = ckpt.parent / "elsewhere.nvdcp"
    shutil.move(ckpt / name, outside)
    (ckpt / name).symlink_to(outside)
    err = _load_error(ckpt)
    assert isinstance(err, nvdcp.MissingDataFileError) and "outside the checkpoint" in str(err), err
    assert name in str(err)


def test_symlink_inside_the_root_is_followed(ckpt: Path) -> None:
    md = nvdcp.NvcompReader(ckpt).read_metadata()
    name = next(i for ix, i in md.storage_data.items() if ix.fqn == "w").relative_path
    shutil.move(ckpt / name, ckpt / "real.bin")
    (ckpt / name).symlink_to("real.bin")
    sd = empty_like_sd(_state())
    dcp.load(sd, storage_reader=nvdcp.NvcompReader(ckpt))
    assert torch.equal(sd["w"], _state()["w"])


# -- versions ------------------------------------------------------------------------------------

def _forge_item(ckpt: Path, fqn: str, mutate: Any) -> str:
    md = nvdcp.NvcompReader(ckpt).read_metadata()
    info = next(i for ix, i in md.storage_data.items() if ix.fqn == fqn)
    f = ckpt / info.relative_path
    data = bytearray(f.read_bytes())
    record = data[info.offset : info.offset + info.length]
    mutate(record)
    fix_checksums(record)
    data[info.offset : info.offset + info.length] = record
    f.write_bytes(data)
    return info.relative_path


def test_unknown_item_format_version_refused(ckpt: Path) -> None:
    name = _forge_item(ckpt, "w", lambda r: struct.pack_into("<H", r, 4, 3))
    err = _load_error(ckpt)
    assert isinstance(err, nvdcp.FormatVersionError) and "v3" in str(err) and name in str(err)


def test_whole_record_relabelled_as_delta_refused(ckpt: Path) -> None:
    """A v1 record whose version says 2 (a delta) without the delta flag and base digest."""
    name = _forge_item(ckpt, "w", lambda r: struct.pack_into("<H", r, 4, 2))
    err = _load_error(ckpt)
    assert isinstance(err, nvdcp.CorruptCheckpointError) and "flags" in str(err) and name in str(err), err


def test_unknown_codec_id_refused(ckpt: Path) -> None:
    # plane codec ids follow the fixed fields and the shape; ids has ndim 1 and 8 planes
    _forge_item(ckpt, "ids", lambda r: r.__setitem__(28 + 8 + 7, 99))
    err = _load_error(ckpt)
    assert isinstance(err, nvdcp.CorruptCheckpointError) and "unknown codec id 99" in str(err), err


@pytest.mark.parametrize("desc,error", [
    ("nvdcp.zstd/3", nvdcp.FormatVersionError), ("nvdcp.brotli/1", nvdcp.UnknownCodecError),
    ("nvdcp.zstd/2", nvdcp.CorruptCheckpointError),  # says delta; the record is stored whole
    ("nvdcp.zstd/one", nvdcp.CorruptCheckpointError),
])
def test_unknown_descriptors_refused(ckpt: Path, desc: str, error: type) -> None:
    _edit_record(ckpt, "w", transform_descriptors=(desc,))
    err = _load_error(ckpt)
    assert isinstance(err, error) and "'w'" in str(err), err


def test_unknown_file_header_version_is_reported(ckpt: Path) -> None:
    from nvdcp.inspection import inspect_checkpoint

    f = next(ckpt.glob("*.nvdcp"))
    data = bytearray(f.read_bytes())
    struct.pack_into("<H", data, 8, 2)
    f.write_bytes(data)
    errors = [d.error for d in inspect_checkpoint(ckpt, threads=1).files if d.error]
    assert errors and "v2" in errors[0] and "upgrade nvdcp" in errors[0]


# -- the .metadata pickle ------------------------------------------------------------------------

class _Reduce:
    """Pickles as ``fn(*args)``: how a hostile .metadata calls things."""

    def __init__(self, fn: Any, args: tuple[Any, ...]) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.fn, self.args

    def __call__(self, *args: Any) -> None:  # lets one _Reduce stand where a callable goes
        pass


def _global(module: str, name: str, *args: str) -> bytes:
    """A protocol-4 pickle of ``module.name(*args)``, by raw opcodes (any name, even dotted)."""
    def s(text: str) -> bytes:
        raw = text.encode()
        return pickle.SHORT_BINUNICODE + bytes([len(raw)]) + raw

    return (pickle.PROTO + b"\x04" + s(module) + s(name) + pickle.STACK_GLOBAL + pickle.MARK
            + b"".join(s(a) for a in args) + pickle.TUPLE + pickle.REDUCE + pickle.STOP)


def _payloads(marker: Path) -> dict[str, bytes]:
    cmd = f"touch {marker}"
    init = _Reduce(getattr, (Metadata, "__init__"))
    glb = _Reduce(getattr, (init, "__globals__"))
    builtins_ = _Reduce(_Reduce(getattr, (glb, "get")), ("__builtins__",))
    evil_eval = _Reduce(_Reduce(getattr, (builtins_, "get")), ("eval",))
    md = Metadata(state_dict_metadata={}, storage_data={})
    md.storage_meta = _Reduce(os.system, (cmd,))  # type: ignore[assignment]
    return {
        "os.system": pickle.dumps(_Reduce(os.system, (cmd,)), protocol=4),
        "inside a valid Metadata": pickle.dumps(md, protocol=4),
        "builtins.eval": _global("builtins", "eval", f"__import__('os').system({cmd!r})"),
        "subprocess.getoutput": _global("subprocess", "getoutput", cmd),
        "getattr chain to eval": pickle.dumps(_Reduce(evil_eval, (f"__import__('os').system({cmd!r})",)), protocol=4),
        "dotted name through a DCP module": _global("torch.distributed.checkpoint.filesystem", "os.system", cmd),
        "module imported by a DCP module": _global("torch.distributed.checkpoint.filesystem", "pickle"),
        "non-dataclass DCP class": _global("torch.distributed.checkpoint.filesystem", "FileSystemWriter", str(marker)),
        "torch function": _global("torch", "load", str(marker)),
    }


@pytest.mark.parametrize("gadget", list(_payloads(Path("/x"))))
def test_metadata_pickle_gadgets_are_refused_and_not_run(ckpt: Path, tmp_path: Path, gadget: str) -> None:
    marker = tmp_path / "pwned"
    (ckpt / ".metadata").write_bytes(_payloads(marker)[gadget])
    with pytest.raises(nvdcp.CorruptCheckpointError, match="cannot unpickle|not Metadata|refusing"):
        nvdcp.NvcompReader(ckpt).read_metadata()
    with pytest.raises(nvdcp.CorruptCheckpointError):
        load_any_metadata(open_storage(ckpt))  # nvdcp inspect / convert use the same allow-list
    with pytest.raises(nvdcp.CorruptCheckpointError):
        nvdcp.verify_checkpoint(ckpt)
    assert not marker.exists(), "the pickle ran code"


def test_golden_metadata_still_loads() -> None:
    for path in sorted(Path(__file__).parents[1].joinpath("golden", "v1").glob("*/.metadata")):
        md = nvdcp.NvcompReader(path.parent).read_metadata()
        assert md.storage_data, path


# -- GDeflate: a forged stream with valid checksums --------------------------------------------

def _load_forged_gdeflate(path: str) -> str:
    sd = empty_like_sd(_state())
    try:
        dcp.load(sd, storage_reader=nvdcp.NvcompReader(path, thread_count=1))
    except (CheckpointException, nvdcp.NvdcpError) as exc:
        err = failure_of(exc)
        return f"{type(err).__name__}: {err}"
    return "loaded"


@pytest.mark.skipif(not GDeflateCodec.available(), reason="libnvcomp_cpu is not installed")
def test_forged_gdeflate_stream_is_an_error_not_an_abort(tmp_path: Path) -> None:
    path = tmp_path / "g"
    dcp.save(_state(), storage_writer=nvdcp.NvcompWriter(path, codec="gdeflate", sync_files=False))
    md = nvdcp.NvcompReader(path).read_metadata()
    info = next(i for ix, i in md.storage_data.items() if ix.fqn == "ids")
    f = path / info.relative_path
    data = bytearray(f.read_bytes())
    record = data[info.offset : info.offset + info.length]
    hb = struct.unpack_from("<I", record, 24)[0]
    table = 28 + 8 + 8  # fixed fields, one shape dim, 8 plane codec ids
    size = struct.unpack_from("<I", record, table)[0]  # chunk 0: plane 0 of int64s, compressed
    assert 0 < size < 1024, "expected a compressed chunk"
    record[hb : hb + size] = bytes((i * 37 + 11) & 0xFF for i in range(size))
    struct.pack_into("<I", record, table + 4, checksum(bytes(record[hb : hb + size])))
    struct.pack_into("<I", record, hb - 4, checksum(bytes(record[: hb - 4])))
    data[info.offset : info.offset + info.length] = record
    f.write_bytes(data)
    result = F.call_in_process(_load_forged_gdeflate, str(path))
    if not guarded():
        assert result == ("signal", 6), result  # the limitation docs/SECURITY.md describes
        pytest.skip("nvdcp.codecs._gdeflate_guard is not built: a forged stream aborts the loader")
    assert result[0] == "ok", result
    msg = result[1]
    assert msg.startswith("CorruptCheckpointError") and "gdeflate" in msg and "chunk 0" in msg, msg
    assert info.relative_path in msg and "'ids'" in msg


# -- bytes items: DCP's planner unpickles them --------------------------------------------------

WeightsOnlyLoadPlanner = nvdcp.WeightsOnlyLoadPlanner  # shipped in nvdcp/dcp/planner.py


def _load_with_default_planner(path: str) -> str:
    dcp.load({"extra": None, "w": torch.zeros(3)}, storage_reader=nvdcp.NvcompReader(path))
    return "loaded"


def test_bytes_items_are_unpickled_by_dcp_planner(tmp_path: Path) -> None:
    """A data file's non-tensor item is a torch.save pickle that DCP's DefaultLoadPlanner loads
    with weights_only=False: it can run code, checksums or not. WeightsOnlyLoadPlanner refuses."""
    marker = tmp_path / "ran"
    path = tmp_path / "ckpt"
    evil = _Reduce(os.system, (f"touch {marker}",))
    dcp.save({"extra": evil, "w": torch.ones(3)}, storage_writer=nvdcp.NvcompWriter(path, sync_files=False))
    assert not marker.exists()
    sd: dict[str, Any] = {"extra": None, "w": torch.zeros(3)}
    with pytest.raises((CheckpointException, nvdcp.NvdcpError)) as info:
        dcp.load(sd, storage_reader=nvdcp.NvcompReader(path), planner=WeightsOnlyLoadPlanner())
    assert "Weights only load failed" in str(failure_of(info.value))
    assert not marker.exists()
    # Stock DCP behaviour, pinned so docs/SECURITY.md is revisited if torch changes it.
    assert F.call_in_process(_load_with_default_planner, str(path)) == ("ok", "loaded")
    assert marker.exists(), "torch's DefaultLoadPlanner no longer runs pickled code: update docs/SECURITY.md"


def test_weights_only_planner_loads_plain_bytes_items(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    extra = {"step": 7, "lr": 0.5, "name": "run", "ids": [1, 2], "pair": (1, "b")}
    dcp.save({"extra": extra, "w": torch.ones(3)}, storage_writer=nvdcp.NvcompWriter(path, sync_files=False))
    sd: dict[str, Any] = {"extra": {k: None for k in extra}, "w": torch.zeros(3)}
    dcp.load(sd, storage_reader=nvdcp.NvcompReader(path), planner=WeightsOnlyLoadPlanner())
    assert sd["extra"] == extra


# -- pickle opcodes that make the C unpickler allocate --------------------------------------

def _read_metadata_capped(path: str) -> tuple[str, str, int, float]:
    with open("/proc/self/statm") as f:
        vm = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), resource.RLIM_INFINITY))
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    try:
        nvdcp.NvcompReader(path).read_metadata()
        name, msg = "loaded", ""
    except BaseException as exc:
        name, msg = type(exc).__name__, str(exc)
    return name, msg, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0, time.perf_counter() - t0


@pytest.mark.parametrize("opcode", [pickle.LONG_BINPUT + struct.pack("<I", (1 << 31) + 5), pickle.PUT + b"4000000000\n"])
def test_huge_memo_index_refused_before_unpickling(ckpt: Path, opcode: bytes) -> None:
    """Without the pre-scan one such opcode made the C unpickler zero a multi-GiB memo table."""
    blob = pickle.PROTO + b"\x02" + pickle.EMPTY_DICT + opcode + pickle.STOP
    (ckpt / ".metadata").write_bytes(blob)
    name, msg, rss_growth_kib, seconds = F.call_in_process(_read_metadata_capped, str(ckpt))[1]
    assert name == "CorruptCheckpointError" and "memo index" in msg, (name, msg)
    assert rss_growth_kib < 64 * 1024 and seconds < 5


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_every_pickle_protocol_still_loads(ckpt: Path, protocol: int) -> None:
    md = pickle.loads((ckpt / ".metadata").read_bytes())
    (ckpt / ".metadata").write_bytes(pickle.dumps(md, protocol=protocol))
    sd = empty_like_sd(_state())
    dcp.load(sd, storage_reader=nvdcp.NvcompReader(ckpt))
    assert torch.equal(sd["w"], _state()["w"]) and sd["extra"] == {"k": "v"}

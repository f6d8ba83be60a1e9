"""``nvdcp convert --to safetensors``: consolidated, sharded Hugging Face files from nvdcp and stock
checkpoints, single-process and 2-rank sharded, read back with the ``safetensors`` library and
compared bit for bit; the streamed path (tensors larger than the budget written chunk by chunk
into place), shard splitting, prefix filtering, dtype casts and clean failures."""

from __future__ import annotations

import io
import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

import nvdcp
from nvdcp.export_safetensors import (
    INDEX_NAME,
    _OutputFile,
    _Tensor,
    check_tiling,
    export_safetensors,
    plan_shards,
    resolve_dtype,
)
from tests._dist import run_ranks
from tests.cli.conftest import cli, flip_byte, invoke
from tests.cli.states import bit_equal

safetensors_torch = pytest.importorskip("safetensors.torch")

FORMATS = ("nvdcp", "stock")
_SHARD_NAME = re.compile(r"^model-(\d{5})-of-(\d{5})\.safetensors$")


# -- checkpoints -------------------------------------------------------------------------------
def _single_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(11)
    return {
        "model": {
            "embed.weight": torch.randn(300, 257, generator=g) * 0.02,
            "head.weight": (torch.randn(128, 96, generator=g) * 0.02).bfloat16(),
            "norm.weight": (1 + torch.randn(77, generator=g) * 0.01).half(),
            "big.weight": torch.randn(1024, 1536, generator=g),  # 6 MiB, one stored chunk
            "ids": torch.arange(5000),
            "mask": torch.rand(999, generator=g) > 0.3,
            "empty": torch.zeros(0, 3),
            "scale": torch.tensor(3.5),
        },
        "optim": {"embed.exp_avg": torch.randn(300, 257, generator=g) * 1e-3, "lr": 0.1},
        "step": 7,
        "extra": io.BytesIO(b"hello" * 100),
    }


def _single_tensors() -> dict[str, torch.Tensor]:
    """The tensors of ``_single_state()`` under their DCP names."""
    out: dict[str, torch.Tensor] = {}
    for top, v in _single_state().items():
        if isinstance(v, dict):
            out.update({f"{top}.{k}": t for k, t in v.items() if isinstance(t, torch.Tensor)})
    return out


def _sharded_full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {
        "model.wide": torch.randn(256, 2048, generator=g),  # Shard(1): 4 KiB runs, one pwrite each
        "model.narrow": torch.randn(2048, 256, generator=g),  # Shard(1): 512-byte runs, windowed
        "model.cube": torch.randn(8, 64, 1024, generator=g).bfloat16(),  # Shard(2) of a 3-D tensor
        "model.rows": torch.randn(1000, 300, generator=g),  # Shard(0): one contiguous run per chunk
        "model.rep": torch.randn(50, 7, generator=g).half(),  # replicated: one chunk
        "model.ids": torch.arange(10_001, dtype=torch.int64),
        "model.mask": torch.rand(64, 100, generator=g) > 0.5,  # Shard(1), bool
        "model.checker": torch.randn(600, 1000, generator=g),  # 2-D blocks, 2 per rank (ShardedTensor)
        "optim.exp_avg": torch.randn(513, 65, generator=g),
    }


_CHECKER = [((0, 0), (250, 333), 0), ((0, 333), (250, 667), 1), ((250, 0), (350, 333), 1), ((250, 333), (350, 667), 0)]


def _save_sharded(rank: int, world: int, root: str) -> None:
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard as STShard
    from torch.distributed._shard.sharded_tensor import init_from_local_shards
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = _sharded_full()
    placements = {"model.wide": Shard(1), "model.narrow": Shard(1), "model.cube": Shard(2), "model.rows": Shard(0),
                  "model.rep": Replicate(), "model.ids": Shard(0), "model.mask": Shard(1), "optim.exp_avg": Shard(0)}
    model: dict[str, Any] = {k.split(".", 1)[1]: distribute_tensor(full[k], mesh, [p])
                             for k, p in placements.items() if k.startswith("model.")}
    c = full["model.checker"]
    local = [STShard(c[o0:o0 + s0, o1:o1 + s1].clone(), ShardMetadata([o0, o1], [s0, s1], f"rank:{r}/cpu"))
             for (o0, o1), (s0, s1), r in _CHECKER if r == rank]
    model["checker"] = init_from_local_shards(local, list(c.shape))
    sd = {"model": model, "optim": {"exp_avg": distribute_tensor(full["optim.exp_avg"], mesh, [Shard(0)]), "lr": 0.5},
          "step": 3}
    dcp.save(sd, storage_writer=FileSystemWriter(os.path.join(root, "stock")))
    dcp.save(sd, storage_writer=nvdcp.NvcompWriter(os.path.join(root, "nvdcp")))


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("st_single")
    paths = {"nvdcp": root / "nvdcp", "stock": root / "stock"}
    dcp.save(_single_state(), storage_writer=nvdcp.NvcompWriter(paths["nvdcp"], thread_count=2))
    dcp.save(_single_state(), storage_writer=FileSystemWriter(paths["stock"]))
    return paths


@pytest.fixture(scope="module")
def sharded2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``_sharded_full()`` saved by 2 gloo ranks: DTensors sharded on dims 0, 1, 2, replicated,
    and a ShardedTensor cut into 2-D blocks; every sharded tensor has several stored chunks."""
    root = tmp_path_factory.mktemp("st_sharded")
    run_ranks(2, _save_sharded, str(root))
    return {"nvdcp": root / "nvdcp", "stock": root / "stock"}


# -- reading the output ------------------------------------------------------------------------
def read_export(out: Path) -> dict[str, torch.Tensor]:
    """Load every file with the safetensors library, check the index against them, return all tensors."""
    index = json.loads((out / INDEX_NAME).read_text())
    assert set(index) == {"metadata", "weight_map"}
    files = sorted(p.name for p in out.iterdir() if p.name.endswith(".safetensors"))
    assert files and all(_SHARD_NAME.match(f) for f in files), files
    assert {int(_SHARD_NAME.match(f).group(2)) for f in files} == {len(files)}  # type: ignore[union-attr]
    assert sorted(set(index["weight_map"].values())) == files  # every file is named by the index
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        got = safetensors_torch.load_file(str(out / f))
        assert not set(got) & set(tensors), f
        for k in got:
            assert index["weight_map"][k] == f, k
        tensors.update(got)
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    return tensors


def assert_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k, w in want.items():
        assert bit_equal(got[k], w), (k, got[k].dtype, tuple(got[k].shape), w.dtype, tuple(w.shape))


def cast(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: t.to(dtype) if t.is_floating_point() else t for k, t in tensors.items()}


# -- single process ----------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_single_process_export_is_bit_exact(single: dict[str, Path], tmp_path: Path, fmt: str) -> None:
    out = tmp_path / "hf"
    ran = invoke("convert", single[fmt], out, "--to", "safetensors", "--json")
    assert ran.exit_code == 0, ran.stderr
    doc = ran.json()
    assert doc["to"] == "safetensors" and doc["source_format"] == fmt
    assert doc["skipped"] == {"optim.lr": "not a tensor", "step": "not a tensor", "extra": "not a tensor"}
    assert doc["tensors"] == 9 and [f["name"] for f in doc["files"]] == ["model-00001-of-00001.safetensors"]
    got = read_export(out)
    assert_tensors(got, _single_tensors())
    assert doc["total_size"] == sum(t.numel() * t.element_size() for t in got.values())
    assert sorted(os.listdir(out)) == sorted([INDEX_NAME, "model-00001-of-00001.safetensors"])  # no temporary left
    with safetensors_torch.safe_open(str(out / "model-00001-of-00001.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_cli_in_a_real_process(single: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "hf"
    ran = cli("convert", single["stock"], out, "--to", "safetensors", "--prefix", "model.", "--dtype", "bf16",
              "--max-memory", "1MiB", "--max-shard-size", "3MB")
    assert ran.exit_code == 0, ran.stderr
    assert "(stock) ->" in ran.stdout and "(safetensors, bfloat16)" in ran.stdout and "8 tensors" in ran.stdout
    assert "prefix 'model.': 4 other items left out" in ran.stdout  # optim.*, step, extra
    got = read_export(out)
    want = {k: v for k, v in cast(_single_tensors(), torch.bfloat16).items() if k.startswith("model.")}
    assert_tensors(got, want)
    assert len([f for f in os.listdir(out) if f.endswith(".safetensors")]) == 2  # big.weight (3 MiB in bf16) alone, the rest


def test_header_layout(single: dict[str, Path], tmp_path: Path) -> None:
    """8-byte little-endian length, a JSON header padded to 8 bytes, data sections back to back."""
    out = tmp_path / "hf"
    export_safetensors(single["nvdcp"], out)
    raw = (out / "model-00001-of-00001.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    assert (8 + n) % 8 == 0
    header = json.loads(raw[8:8 + n])
    assert header.pop("__metadata__") == {"format": "pt"}
    spans = sorted(tuple(v["data_offsets"]) for v in header.values())
    assert spans[0][0] == 0 and spans[-1][1] == len(raw) - 8 - n
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    for v in header.values():  # every tensor starts aligned to its element size
        size = {"F32": 4, "I64": 8, "BF16": 2, "F16": 2, "BOOL": 1}[v["dtype"]]
        assert (8 + n + v["data_offsets"][0]) % size == 0


def test_stock_source_with_torch_zstd_extension(tmp_path: Path) -> None:
    from torch.distributed.checkpoint._extension import ZStandard

    src, out = tmp_path / "src", tmp_path / "hf"
    dcp.save(_single_state(), storage_writer=FileSystemWriter(src, _extensions=[ZStandard()]))
    result = export_safetensors(src, out, max_memory=1 << 20, max_shard_size=10**6)
    assert result.source_format == "stock" and [f.tensors for f in result.files] == [1, 8]  # big.weight alone
    assert_tensors(read_export(out), _single_tensors())


# -- 2 ranks, sharded --------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("max_memory", ["1GiB", "1MiB"])
def test_sharded_tensors_are_consolidated(sharded2: dict[str, Path], tmp_path: Path, fmt: str, max_memory: str) -> None:
    out = tmp_path / "hf"
    ran = invoke("convert", sharded2[fmt], out, "--to", "safetensors", "--max-memory", max_memory, "--json")
    assert ran.exit_code == 0, ran.stderr
    doc = ran.json()
    assert doc["skipped"] == {"optim.lr": "not a tensor", "step": "not a tensor"}
    if max_memory == "1MiB":  # larger than a quarter of the budget and in strided chunks
        assert sorted(doc["streamed"]) == ["model.checker", "model.cube", "model.narrow", "model.wide"]
    else:
        assert doc["streamed"] == []
    assert_tensors(read_export(out), _sharded_full())


@pytest.mark.parametrize("dtype,torch_dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)])
def test_dtype_cast(sharded2: dict[str, Path], tmp_path: Path, dtype: str, torch_dtype: torch.dtype) -> None:
    out = tmp_path / "hf"
    result = export_safetensors(sharded2["nvdcp"], out, dtype=dtype, max_memory=1 << 20)
    assert result.dtype == str(torch_dtype).removeprefix("torch.")
    got = read_export(out)
    assert_tensors(got, cast(_sharded_full(), torch_dtype))
    assert got["model.ids"].dtype == torch.int64 and got["model.mask"].dtype == torch.bool


def test_max_shard_size_splits_like_save_pretrained(sharded2: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "hf"
    ran = invoke("convert", sharded2["stock"], out, "--to", "safetensors", "--max-shard-size", "1MB", "--json")
    assert ran.exit_code == 0, ran.stderr
    doc = ran.json()
    got = read_export(out)
    assert_tensors(got, _sharded_full())
    names = [f["name"] for f in doc["files"]]
    assert len(names) == len(doc["files"]) >= 5 and names == sorted(names)
    index = json.loads((out / INDEX_NAME).read_text())
    per_file: dict[str, int] = {}
    for k, f in index["weight_map"].items():
        per_file[f] = per_file.get(f, 0) + got[k].numel() * got[k].element_size()
    for f, size in per_file.items():  # at most 1 MB of data, unless one tensor larger than that
        members = [k for k, ff in index["weight_map"].items() if ff == f]
        assert size <= 10**6 or len(members) == 1, (f, size, members)


def test_prefix_filters(sharded2: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "hf"
    result = export_safetensors(sharded2["nvdcp"], out, prefix="model.")
    assert result.excluded == 3 and result.skipped == {}  # optim.exp_avg, optim.lr, step
    assert_tensors(read_export(out), {k: v for k, v in _sharded_full().items() if k.startswith("model.")})
    ran = invoke("convert", sharded2["nvdcp"], tmp_path / "none", "--to", "safetensors", "--prefix", "decoder.")
    assert ran.exit_code == 3
    assert "prefix 'decoder.' matches no tensor" in ran.stderr and "'model.', 'optim.'" in ran.stderr
    assert not (tmp_path / "none").exists()


# -- errors and cleanup ------------------------------------------------------------------------
def test_bad_arguments(single: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    cases = [
        (["--prefix", "model."], "--prefix applies to --to safetensors only"),
        (["--dtype", "bf16"], "--dtype applies to --to safetensors only"),
        (["--max-shard-size", "1GB"], "--max-shard-size applies to --to safetensors only"),
        (["--to", "safetensors", "--dtype", "fp8"], "'fp8' is not one of"),
        (["--to", "safetensors", "--codec", "zstd"], "--codec applies to nvdcp output"),
        (["--to", "safetensors", "--max-shard-size", "lots"], "not a size"),
        (["--to", "safetensors", "--max-memory", "1KiB"], "at least 1 MiB"),
        (["--to", "safetensors", "--dst-option", "a=b"], "local directory"),
    ]
    for args, message in cases:
        ran = invoke("convert", single["stock"], out, *args)
        assert ran.exit_code == 2 and message in ran.stderr, (args, ran.stderr)
    assert not out.exists()
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        resolve_dtype("int8")
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        export_safetensors(single["stock"], out, dtype="int8")
    with pytest.raises(ValueError, match="local directory"):
        export_safetensors(single["stock"], "s3://bucket/hf")
    ran = invoke("convert", tmp_path / "nothing", out, "--to", "safetensors")
    assert ran.exit_code == 3 and "no committed checkpoint" in ran.stderr
    ran = invoke("convert", single["stock"], single["stock"], "--to", "safetensors", "--overwrite")
    assert ran.exit_code == 3 and "same location" in ran.stderr
    assert not out.exists()


def test_existing_destination_needs_overwrite(single: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "hf"
    assert invoke("convert", single["nvdcp"], out, "--to", "safetensors", "--max-shard-size", "1MB").exit_code == 0
    (out / "config.json").write_text("{}")
    before = sorted(os.listdir(out))
    ran = invoke("convert", single["nvdcp"], out, "--to", "safetensors")
    assert ran.exit_code == 3 and "exists and is not empty; pass --overwrite" in ran.stderr
    assert sorted(os.listdir(out)) == before
    ran = invoke("convert", single["stock"], out, "--to", "safetensors", "--overwrite")
    assert ran.exit_code == 0, ran.stderr
    # the old shards are gone, config.json is kept
    assert sorted(os.listdir(out)) == sorted(["config.json", INDEX_NAME, "model-00001-of-00001.safetensors"])
    assert_tensors(read_export(out), _single_tensors())
    # an empty directory needs no --overwrite
    empty = tmp_path / "empty"
    empty.mkdir()
    assert invoke("convert", single["stock"], empty, "--to", "safetensors", "--prefix", "optim.").exit_code == 0
    assert_tensors(read_export(empty), {"optim.embed.exp_avg": _single_tensors()["optim.embed.exp_avg"]})


@pytest.mark.parametrize("existing", [False, True])
def test_damaged_source_leaves_nothing(single: dict[str, Path], tmp_path: Path, existing: bool) -> None:
    src, out = tmp_path / "src", tmp_path / "hf"
    shutil.copytree(single["nvdcp"], src)
    flip_byte(src, "optim.embed.exp_avg", -3)  # the last tensor written: earlier files are complete
    if existing:
        out.mkdir()
    ran = invoke("convert", src, out, "--to", "safetensors", "--max-shard-size", "100kB")
    assert ran.exit_code == 1
    assert "optim.embed.exp_avg" in ran.stderr and "checksum mismatch" in ran.stderr
    assert os.listdir(out) == [] if existing else not out.exists()


def test_tiling_checks() -> None:
    check_tiling("t", (4, 6), [((0, 0), (4, 3)), ((0, 3), (4, 3))])
    check_tiling("s", (), [((), ())])
    check_tiling("e", (0, 3), [((0, 0), (0, 3))])
    with pytest.raises(nvdcp.CorruptCheckpointError, match="t: stored chunks hold 12 elements, shape .4, 6. has 24"):
        check_tiling("t", (4, 6), [((0, 0), (4, 3))])
    with pytest.raises(nvdcp.CorruptCheckpointError, match="overlap"):
        check_tiling("t", (4, 6), [((0, 0), (4, 3)), ((0, 2), (4, 3)), ((0, 5), (4, 1)), ((0, 0), (0, 0))])
    with pytest.raises(nvdcp.CorruptCheckpointError, match="outside shape"):
        check_tiling("t", (4, 6), [((0, 0), (4, 3)), ((0, 4), (4, 3))])


def test_plan_shards() -> None:
    sizes = [("a", 4), ("b", 4), ("c", 9), ("d", 3), ("e", 20), ("f", 1)]
    assert plan_shards(sizes, 10) == [["a", "b"], ["c"], ["e"], ["d", "f"]]
    assert plan_shards(sizes, 100) == [["a", "b", "c", "d", "e", "f"]]


# -- chunk placement, exhaustively on random tilings --------------------------------------------
def _random_tiling(rng: random.Random, shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    cuts = []
    for n in shape:
        inner = sorted(rng.sample(range(1, n), min(n - 1, rng.randint(0, 3)))) if n > 1 else []
        points = [0, *inner, n]
        cuts.append(list(zip(points[:-1], points[1:])))
    import itertools

    return [(tuple(a for a, _ in box), tuple(b - a for a, b in box)) for box in itertools.product(*cuts)]


@pytest.mark.parametrize("seed", range(40))
def test_place_fills_random_tilings(tmp_path: Path, seed: int) -> None:
    """Every chunk of a random grid tiling, placed in random order with the pwrite-per-run and the
    read-modify-write paths (tiny windows: many windows per chunk), gives the C-order tensor."""
    rng = random.Random(seed)
    ndim = rng.randint(1, 4)
    shape = tuple(rng.randint(1, 40 if ndim < 3 else 12) for _ in range(ndim))
    dtype = rng.choice([torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.uint8])
    full = (torch.randint(0, 2, shape, dtype=torch.bool) if dtype == torch.bool
            else torch.randint(0, 250, shape).to(dtype))
    chunks = _random_tiling(rng, shape)
    rng.shuffle(chunks)
    check_tiling("x", shape, chunks)
    head = _Tensor("x", dtype, dtype, shape)
    other = _Tensor("y", torch.uint8, torch.uint8, (3,))
    other.start = head.nbytes
    f = _OutputFile(str(tmp_path / "x.safetensors"), [head, other], {})
    try:
        f.pwrite(memoryview(b"\xab\xcd\xef"), f.data_start + other.start)
        for offsets, sizes in chunks:
            region = full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].contiguous()
            data = region.reshape(-1).view(torch.uint8).numpy()
            window = rng.choice([1, 64, 1 << 16])
            f.place(head, offsets, sizes, data, window)
        f.finish()
    finally:
        f.close()
    got = safetensors_torch.load_file(str(tmp_path / "x.safetensors"))
    assert bit_equal(got["x"], full)
    assert got["y"].tolist() == [0xAB, 0xCD, 0xEF]  # the next tensor's bytes are untouched


def test_place_direct_runs_and_windows(tmp_path: Path) -> None:
    """Column blocks of a wide tensor (runs 12 kB apart: one pwrite per run) and of a narrow one
    (runs 256 bytes apart: read-modify-write windows, some smaller than the chunk's rows)."""
    wide = np.arange(64 * 3000, dtype=np.int32).reshape(64, 3000)
    narrow = np.arange(3000 * 64, dtype=np.int32).reshape(3000, 64) * 7
    tw = _Tensor("wide", torch.int32, torch.int32, wide.shape)
    tn = _Tensor("narrow", torch.int32, torch.int32, narrow.shape)
    tn.start = tw.nbytes
    f = _OutputFile(str(tmp_path / "x.safetensors"), [tw, tn], {})

    def block(a: np.ndarray, lo: int, hi: int) -> np.ndarray:
        return np.ascontiguousarray(a[:, lo:hi]).view(np.uint8).reshape(-1)

    try:
        for t, a, cuts, window in ((tw, wide, [0, 1500, 2900, 3000], 1 << 16), (tn, narrow, [0, 30, 31, 64], 1000)):
            for lo, hi in zip(cuts, cuts[1:]):
                f.place(t, (0, lo), (a.shape[0], hi - lo), block(a, lo, hi), window)
        f.finish()
    finally:
        f.close()
    got = safetensors_torch.load_file(str(tmp_path / "x.safetensors"))
    assert np.array_equal(got["wide"].numpy(), wide) and np.array_equal(got["narrow"].numpy(), narrow)

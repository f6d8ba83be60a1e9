"""``nvdcp convert``: stock <-> nvdcp and codec changes, bit-exact, sharding kept, failures clean."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

import nvdcp
from tests.cli.conftest import REPO, _env, cli, flip_byte, invoke, load_full, load_nvdcp, records
from tests.cli.states import assert_same, bit_equal, make_state

# Loads a stock checkpoint with torch alone: nvdcp cannot be imported in that process.
_STOCK_LOAD = """
import sys
sys.modules["nvdcp"] = None
import torch, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from tests.cli.states import assert_same, blank_like, make_state
sd = blank_like(make_state())
dcp.load(sd, storage_reader=FileSystemReader(sys.argv[1]))
assert_same(sd, make_state())
print("stock-only load ok")
"""


def test_stock_to_nvdcp_to_stock_is_bit_exact(ckpts: dict[str, Path], tmp_path: Path) -> None:
    nv, back = tmp_path / "nv", tmp_path / "back"
    ran = cli("convert", ckpts["stock"], nv, "--json")
    assert ran.exit_code == 0, ran.stderr
    doc = ran.json()
    assert (doc["source_format"], doc["to"], doc["codec"], doc["items"]) == ("stock", "nvdcp", "auto", 9)
    assert doc["stored_bytes"] < doc["source_stored_bytes"] and doc["ratio"] > 1
    assert {"read_s", "decode_s", "encode_s", "io_s"} <= set(doc["phases"])
    assert_same(load_nvdcp(nv), make_state())

    ran = invoke("convert", nv, back, "--to", "stock")
    assert ran.exit_code == 0, ran.stderr
    assert "(nvdcp) ->" in ran.stdout and "(stock DCP)" in ran.stdout
    assert sorted(os.listdir(back)) == sorted(os.listdir(ckpts["stock"]))  # .metadata, __0_0.distcp
    assert all(r.transform_descriptors is None for r in records(back).values())
    proc = subprocess.run([sys.executable, "-c", _STOCK_LOAD, str(back)], check=False, capture_output=True, text=True,
                          env=_env(), cwd=REPO, timeout=120)
    assert proc.returncode == 0 and "stock-only load ok" in proc.stdout, proc.stderr


def test_nvdcp_codec_change_round_trips(ckpts: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "gd"
    ran = invoke("convert", ckpts["nvdcp"], out, "--codec", "gdeflate", "--max-memory", "1MiB", "--threads", "3")
    assert ran.exit_code == 0, ran.stderr
    doc = invoke("inspect", out, "--json").json()
    codecs = {s["codec"] for i in doc["items"] for s in i["shards"]}
    assert codecs == {"gdeflate"}
    assert {s["descriptor"] for i in doc["items"] for s in i["shards"]} == {"nvdcp.gdeflate/1"}
    assert doc["files"][0]["info"]["converted_from"] == str(ckpts["nvdcp"])
    assert len(doc["files"]) == 2  # one output file per source file
    assert_same(load_nvdcp(out), make_state())
    none = tmp_path / "none"
    assert invoke("convert", out, none, "--codec", "none").exit_code == 0
    assert_same(load_nvdcp(none), make_state())
    assert invoke("verify", none).exit_code == 0


def test_sharding_is_kept(sharded: dict[str, Any], tmp_path: Path) -> None:
    nv, back = tmp_path / "nv", tmp_path / "back"
    assert invoke("convert", sharded["stock"], nv, "--codec", "zstd").exit_code == 0
    assert invoke("convert", nv, back, "--to", "stock").exit_code == 0
    src = {(ix.fqn, tuple(ix.offset)) for ix in _indexes(sharded["stock"])}
    assert {(ix.fqn, tuple(ix.offset)) for ix in _indexes(nv)} == src == {(ix.fqn, tuple(ix.offset)) for ix in _indexes(back)}
    assert len(src) == 6  # 3 tensors x 2 ranks
    assert sorted(os.listdir(back)) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    for got in (load_full(nv, nvdcp.NvcompReader), load_full(back, FileSystemReader)):
        for k, want in sharded["full"].items():
            assert bit_equal(got[k], want), k


def _indexes(path: Path) -> list[Any]:
    import pickle

    with open(path / ".metadata", "rb") as f:
        return list(pickle.load(f).storage_data)


def test_stock_source_with_torch_zstd_extension(tmp_path: Path) -> None:
    from torch.distributed.checkpoint._extension import ZStandard

    src, out = tmp_path / "src", tmp_path / "out"
    dcp.save(make_state(), storage_writer=FileSystemWriter(src, _extensions=[ZStandard()]))
    assert invoke("convert", src, out).exit_code == 0
    assert_same(load_nvdcp(out), make_state())


def test_existing_destination_needs_overwrite(ckpts: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert invoke("convert", ckpts["stock"], out, "--codec", "zstd").exit_code == 0
    first = set(os.listdir(out))
    ran = invoke("convert", ckpts["stock"], out)
    assert ran.exit_code == 3 and "exists; pass --overwrite" in ran.stderr
    assert set(os.listdir(out)) == first
    assert invoke("convert", ckpts["stock"], out, "--codec", "gdeflate", "--overwrite").exit_code == 0
    after = set(os.listdir(out))
    assert not (first - {".metadata"}) & after  # the replaced checkpoint's data files are gone
    assert_same(load_nvdcp(out), make_state())
    # stock output over a stock checkpoint
    back = tmp_path / "back"
    assert invoke("convert", out, back, "--to", "stock").exit_code == 0
    assert invoke("convert", out, back, "--to", "stock", "--overwrite").exit_code == 0
    assert sorted(os.listdir(back)) == [".metadata", "__0_0.distcp"]


def test_damaged_source_fails_cleanly(ckpts: dict[str, Path], tmp_path: Path) -> None:
    src, out = tmp_path / "src", tmp_path / "out"
    shutil.copytree(ckpts["nvdcp"], src)
    flip_byte(src, "model.embed.weight", -3)
    ran = invoke("convert", src, out)
    assert ran.exit_code == 1
    assert "model.embed.weight" in ran.stderr and "checksum mismatch" in ran.stderr
    assert not out.exists() or os.listdir(out) == []  # no checkpoint and no orphan data files


def test_bad_arguments(ckpts: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    cases = [
        (["--codec", "lz5"], "unknown codec 'lz5'"),
        (["--to", "stock", "--codec", "zstd"], "--codec applies to nvdcp output"),
        (["--to", "tar"], "'tar' is not one of"),
        (["--max-memory", "lots"], "not a size"),
        (["--max-memory", "1KiB"], "at least 1 MiB"),
        (["--threads", "0"], "--threads"),
    ]
    for args, message in cases:
        ran = invoke("convert", ckpts["stock"], out, *args)
        assert ran.exit_code == 2 and message in ran.stderr, (args, ran.stderr)
    from nvdcp.gpu import gpu_available

    if not gpu_available():
        ran = invoke("convert", ckpts["stock"], out, "--codec", "ans")
        assert ran.exit_code == 3 and "NVIDIA GPU" in ran.stderr
    ran = invoke("convert", ckpts["stock"], ckpts["stock"])
    assert ran.exit_code == 3 and "same location" in ran.stderr
    ran = invoke("convert", tmp_path / "nothing", out)
    assert ran.exit_code == 3 and "no committed checkpoint" in ran.stderr
    assert not out.exists()


def test_bounded_map_keeps_order_and_budget() -> None:
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from nvdcp.convert import bounded_map

    lock, state = threading.Lock(), {"now": 0, "peak": 0}

    def work(n: int) -> int:
        with lock:
            state["now"] += n
            state["peak"] = max(state["peak"], state["now"])
        with lock:
            state["now"] -= n
        return n * 10

    with ThreadPoolExecutor(4) as pool:
        sizes = [5, 1, 7, 3, 20, 2, 2]
        got = list(bounded_map(work, sizes, lambda n: n, 10, pool, window=8))
    assert got == [n * 10 for n in sizes]
    assert state["peak"] <= 20  # the one task above the budget ran alone

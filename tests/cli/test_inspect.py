"""``nvdcp inspect``: items, shards, codecs, sizes and versions, from headers only."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import nvdcp
from nvdcp.cli.app import _codec_cell
from nvdcp.inspection import HEADER_PREFIX_BYTES
from tests.cli.conftest import cli, flip_byte, invoke, records


def test_json_lists_every_item_with_codec_sizes_and_versions(ckpts: dict[str, Path]) -> None:
    ran = cli("inspect", ckpts["nvdcp"], "--json")
    assert ran.exit_code == 0, ran.stderr
    doc = ran.json()
    assert doc["format"] == "nvdcp"
    assert doc["saved_with"]["torch"] == [torch.__version__]
    assert doc["saved_with"]["nvdcp"] == [nvdcp.__version__]
    assert doc["saved_with"]["format_version"] == [1]
    assert "nvcomp" in doc["saved_with"]
    items = {i["fqn"]: i for i in doc["items"]}
    assert set(items) == {
        "model.embed.weight", "model.head.weight", "model.norm.weight", "model.ids", "model.mask",
        "model.empty", "model.scale", "step", "extra",
    }
    w = items["model.embed.weight"]
    assert (w["kind"], w["dtype"], w["shape"]) == ("tensor", "float32", [300, 257])
    assert w["original_bytes"] == 300 * 257 * 4
    [shard] = w["shards"]
    assert shard["offsets"] == [0, 0] and shard["sizes"] == [300, 257]
    # auto = zstd on the sign/exponent plane only; the codec comes from the stored header
    assert shard["codec"] == "zstd" and shard["transform"] == "byteplanes"
    assert shard["plane_codecs"] == ["none", "none", "none", "zstd"]
    assert shard["descriptor"] == "nvdcp.zstd/1"
    assert items["model.ids"]["ratio"] > 10  # arange: every plane compresses
    # a byte item's original bytes are what DCP serialized, as stock DCP stores them
    assert items["extra"]["kind"] == "bytes"
    assert items["extra"]["original_bytes"] == records(ckpts["stock"])["extra"].length
    # stored bytes are the .metadata records; totals add up per dtype and overall
    recs = records(ckpts["nvdcp"])
    assert w["stored_bytes"] == recs["model.embed.weight"].length
    total = doc["totals"]
    assert total["items"] == 9 and total["stored_bytes"] == sum(r.length for r in recs.values())
    assert sum(d["original_bytes"] for d in doc["by_dtype"].values()) == total["original_bytes"]
    assert doc["by_dtype"]["bfloat16"]["items"] == 1 and doc["by_dtype"]["bytes"]["items"] == 2
    assert len(doc["files"]) == 2 and all(f["info"]["torch"] == torch.__version__ for f in doc["files"])
    assert doc["errors"] == []


def test_table_shows_items_totals_and_versions(ckpts: dict[str, Path]) -> None:
    ran = invoke("inspect", ckpts["nvdcp"])
    assert ran.exit_code == 0, ran.stderr
    text = ran.stdout
    for needle in ("model.embed.weight", "float32", "[300, 257]", "zstd (1/4 planes)", "By dtype", "total",
                   f"torch {torch.__version__}", "container v1"):
        assert needle in text, needle


def test_stock_checkpoint_inspects_too(ckpts: dict[str, Path]) -> None:
    doc = invoke("inspect", ckpts["stock"], "--json").json()
    assert doc["format"] == "stock" and doc["dcp_version"]
    items = {i["fqn"]: i for i in doc["items"]}
    assert items["model.embed.weight"]["codecs"] == ["torch.save"]
    assert items["extra"]["codecs"] == ["raw"]
    assert doc["files"][0]["info"] == {}


def test_sharded_items_list_their_shards(sharded: dict[str, Any]) -> None:
    ran = invoke("inspect", sharded["nvdcp"], "--json")
    items = {i["fqn"]: i for i in ran.json()["items"]}
    rows = items["rows"]
    assert rows["shape"] == [64, 48]
    assert [(s["offsets"], s["sizes"]) for s in rows["shards"]] == [([0, 0], [32, 48]), ([32, 0], [32, 48])]
    assert [(s["offsets"], s["sizes"]) for s in items["cols"]["shards"]] == [([0, 0], [10, 20]), ([0, 20], [10, 20])]
    assert len({s["file"] for s in rows["shards"]}) == 2  # one data file per rank
    table = invoke("inspect", sharded["nvdcp"], "--shards").stdout
    assert "2 x [32, 48]" in table and "[32:64, 0:48]" in table


def test_reads_headers_only_so_payload_damage_goes_unnoticed(ckpts: dict[str, Path], tmp_path: Path) -> None:
    path = tmp_path / "ck"
    shutil.copytree(ckpts["nvdcp"], path)
    flip_byte(path, "model.embed.weight", -1)  # last payload byte
    assert invoke("inspect", path).exit_code == 0  # verify is what catches this (test_verify.py)


def test_damaged_item_header_is_reported_with_status_1(ckpts: dict[str, Path], tmp_path: Path) -> None:
    path = tmp_path / "ck"
    shutil.copytree(ckpts["nvdcp"], path)
    flip_byte(path, "model.ids", 1)  # inside the item magic
    ran = invoke("inspect", path, "--json")
    assert ran.exit_code == 1
    doc = ran.json()
    [bad] = [s for i in doc["items"] for s in i["shards"] if s["error"]]
    assert "bad item magic" in bad["error"] and bad["codec"] == "?"
    assert "model.ids" in ran.stderr and "nvdcp verify" in ran.stderr


def test_large_item_header_is_fetched_in_a_second_read(tmp_path: Path) -> None:
    # 8 MiB in 1 KiB chunks: 8192 chunk entries, a header larger than the first 64 KiB read
    sd = {"big": torch.arange(2 << 20, dtype=torch.float32)}
    dcp.save(sd, storage_writer=nvdcp.NvcompWriter(tmp_path, codec="none", chunk_bytes=1024))
    doc = invoke("inspect", tmp_path, "--json").json()
    [shard] = doc["items"][0]["shards"]
    assert shard["error"] is None and shard["codec"] == "none" and shard["chunk_bytes"] == 1024
    assert doc["totals"]["original_bytes"] == 8 << 20
    assert records(tmp_path)["big"].length - (8 << 20) > HEADER_PREFIX_BYTES  # the header alone


def test_missing_checkpoint_and_bad_arguments(tmp_path: Path) -> None:
    ran = invoke("inspect", tmp_path / "nothing")
    assert ran.exit_code == 3
    assert "no committed checkpoint" in ran.stderr and "nvdcp inspect: error:" in ran.stderr
    ran = invoke("inspect")
    assert ran.exit_code == 2 and "Missing argument 'PATH_OR_URL'" in ran.stderr
    ran = invoke("inspect", tmp_path, "--threads", "0")
    assert ran.exit_code == 2 and "--threads" in ran.stderr
    ran = invoke("inspect", tmp_path, "-o", "novalue")
    assert ran.exit_code == 2 and "KEY=VALUE" in ran.stderr
    (tmp_path / "file").write_text("x")
    assert "is a file" in invoke("inspect", tmp_path / "file").stderr
    assert os.listdir(tmp_path) == ["file"]


@pytest.mark.parametrize(("planes", "expected"), [
    (["none", "none", "none", "zstd"], "zstd (1/4 planes)"),
    (["gdeflate", "gdeflate", "gdeflate", "zstd"], "gdeflate+zstd (4/4 planes)"),  # a GPU delta
    (["zstd", "gdeflate"], "zstd+gdeflate (2/2 planes)"),
    (["none", "none"], "none (0/2 planes)"),
])
def test_codec_column_names_every_codec_at_work(planes: list[str], expected: str) -> None:
    assert _codec_cell(planes, planes[-1] if planes[-1] != "none" else "none", "byteplanes") == expected
    assert _codec_cell(None, "zstd", None) == "zstd"

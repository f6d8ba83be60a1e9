"""``nvdcp verify``: exit 0 when intact, 1 with the damaged items named, clear errors otherwise."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from tests.cli.conftest import cli, flip_byte, invoke, records


def test_intact_checkpoint_exits_0(ckpts: dict[str, Path]) -> None:
    ran = invoke("verify", ckpts["nvdcp"])
    assert ran.exit_code == 0, ran.stderr
    assert ran.stdout.startswith("OK ") and "9 items intact" in ran.stdout and "full decode" in ran.stdout


def test_flipped_byte_exits_1_naming_item_file_and_chunk(ckpts: dict[str, Path], tmp_path: Path) -> None:
    path = tmp_path / "ck"
    shutil.copytree(ckpts["nvdcp"], path)
    file = flip_byte(path, "model.head.weight", -1)
    ran = cli("verify", path, "--json")
    assert ran.exit_code == 1
    doc = ran.json()
    assert doc["ok"] is False and doc["items"] == 9
    [bad] = doc["damaged"]
    assert bad["item"] == "'model.head.weight' offset (0, 0)" and bad["file"] == file
    assert bad["kind"] == "CorruptCheckpointError" and "checksum mismatch" in bad["error"]
    ran = invoke("verify", path, "--checksums-only")
    assert ran.exit_code == 1
    assert "DAMAGED" in ran.stdout and "1 of 9 items failed" in ran.stdout and "model.head.weight" in ran.stdout


def test_missing_data_file_names_every_item_in_it(ckpts: dict[str, Path], tmp_path: Path) -> None:
    path = tmp_path / "ck"
    shutil.copytree(ckpts["nvdcp"], path)
    gone = records(path)["model.ids"].relative_path
    os.remove(path / gone)
    doc = invoke("verify", path, "--json").json()
    in_file = sum(1 for r in records(path).values() if r.relative_path == gone)
    assert len(doc["damaged"]) == in_file >= 1
    assert all(d["kind"] == "MissingDataFileError" and "missing" in d["error"] for d in doc["damaged"])


def test_progress_bar_on_request(ckpts: dict[str, Path]) -> None:
    ran = invoke("verify", ckpts["nvdcp"], "--progress")
    assert ran.exit_code == 0 and "verify" in ran.stderr and "9/9" in ran.stderr


def test_stock_missing_and_bad_arguments(ckpts: dict[str, Path], tmp_path: Path) -> None:
    ran = invoke("verify", ckpts["stock"])
    assert ran.exit_code == 3 and "stock DCP checkpoint" in ran.stderr and "nvdcp convert" in ran.stderr
    ran = invoke("verify", tmp_path)
    assert ran.exit_code == 3 and "no committed checkpoint" in ran.stderr
    (tmp_path / ".metadata").write_bytes(b"not a pickle")
    ran = invoke("verify", tmp_path)
    assert ran.exit_code == 1 and "cannot unpickle" in ran.stderr
    ran = invoke("verify", tmp_path, "--bogus")
    assert ran.exit_code == 2 and "No such option" in ran.stderr

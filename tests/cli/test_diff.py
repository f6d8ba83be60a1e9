"""``nvdcp inspect A --diff B``: the items that changed between two checkpoints, by their digests,
without decoding; and the save digests in ``verify`` and ``inspect`` output."""

from __future__ import annotations

import io
import pickle
import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

import nvdcp
from nvdcp.format.digest import DIGEST_ATTR
from tests.cli.conftest import cli, invoke
from tests.cli.states import make_state

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "v1"


def _changed_copy(path: Path) -> None:
    """make_state() after one "training step": one weight changed, one entry gone, one new."""
    sd = make_state()
    sd["model"]["head.weight"].add_(1)
    del sd["model"]["mask"]
    sd["model"]["bias"] = torch.zeros(4)
    sd["extra"] = io.BytesIO(b"bye" * 10)
    dcp.save(sd, storage_writer=nvdcp.NvcompWriter(path, on_identical_save="ignore"))


def test_diff_lists_added_removed_and_changed_items(ckpts: dict[str, Path], tmp_path: Path) -> None:
    _changed_copy(tmp_path / "b")
    ran = cli("inspect", ckpts["nvdcp"], "--diff", tmp_path / "b", "--json")  # once in a real process
    assert ran.exit_code == 0, ran.stderr
    doc = ran.json()
    assert doc["sources"] == {"a": "recorded", "b": "recorded"} and doc["identical"] is False
    assert doc["changed"] == ["extra", "model.head.weight"] and doc["reasons"]["model.head.weight"] == "data"
    assert doc["added"] == ["model.bias"] and doc["removed"] == ["model.mask"] and doc["unknown"] == []
    assert doc["unchanged"] == ["model.embed.weight", "model.empty", "model.ids", "model.norm.weight",
                                "model.scale", "step"]
    assert doc["counts"] == {"added": 1, "removed": 1, "changed": 2, "unchanged": 6, "unknown": 0}
    ran = invoke("inspect", ckpts["nvdcp"], "--diff", tmp_path / "b")
    assert ran.exit_code == 0, ran.stderr
    assert "2 changed, 1 added, 1 removed, 0 not comparable, 6 unchanged" in ran.stdout
    lines = {line.split()[2]: line.split()[0] for line in ran.stdout.splitlines() if "│" in line}
    assert lines == {"extra": "changed", "model.head.weight": "changed", "model.bias": "added", "model.mask": "removed"}


def test_diff_of_identical_checkpoints(ckpts: dict[str, Path], tmp_path: Path) -> None:
    shutil.copytree(ckpts["nvdcp"], tmp_path / "copy")
    ran = invoke("inspect", ckpts["nvdcp"], "--diff", tmp_path / "copy")
    assert ran.exit_code == 0 and "identical" in ran.stdout and "9 unchanged" in ran.stdout


def test_diff_falls_back_to_item_headers_without_digests(ckpts: dict[str, Path], tmp_path: Path) -> None:
    old = tmp_path / "old"
    shutil.copytree(ckpts["nvdcp"], old)
    md = pickle.loads((old / ".metadata").read_bytes())
    vars(md).pop(DIGEST_ATTR)  # as saved before digests existed
    (old / ".metadata").write_bytes(pickle.dumps(md))
    _changed_copy(tmp_path / "b")
    doc = invoke("inspect", old, "--diff", tmp_path / "b", "--json").json()
    assert doc["sources"] == {"a": "headers", "b": "recorded"}
    assert doc["changed"] == ["extra", "model.head.weight"] and len(doc["unchanged"]) == 6
    # golden v1 checkpoints (written before digests): against themselves, and across codecs
    ran = invoke("inspect", GOLDEN / "zstd", "--diff", GOLDEN / "zstd")
    assert ran.exit_code == 0 and "item headers read" in ran.stdout and "identical" in ran.stdout
    doc = invoke("inspect", GOLDEN / "zstd", "--diff", GOLDEN / "none", "--json").json()
    assert doc["changed"] == [] and len(doc["unknown"]) == 8
    assert all("another codec" in why for why in doc["reasons"].values())


def test_diff_against_stock_and_bad_arguments(ckpts: dict[str, Path], tmp_path: Path) -> None:
    doc = invoke("inspect", ckpts["nvdcp"], "--diff", ckpts["stock"], "--json").json()
    assert doc["sources"]["b"] == "headers" and doc["changed"] == [] and doc["added"] == doc["removed"] == []
    assert doc["unknown"] and all("stock" in doc["reasons"][f] for f in doc["unknown"])
    ran = invoke("inspect", ckpts["nvdcp"], "--diff", tmp_path)
    assert ran.exit_code == 3 and "no committed checkpoint" in ran.stderr
    ran = invoke("inspect", ckpts["nvdcp"], "--diff", ckpts["stock"], "--shards")
    assert ran.exit_code == 2 and "--shards" in ran.stderr
    ran = invoke("inspect", ckpts["nvdcp"], "--diff-option", "a=b")
    assert ran.exit_code == 2 and "--diff-option" in ran.stderr
    ran = invoke("inspect", ckpts["nvdcp"], "--from-headers")
    assert ran.exit_code == 2 and "--from-headers" in ran.stderr
    ran = invoke("inspect", ckpts["nvdcp"], "--diff", ckpts["nvdcp"], "--from-headers", "--json")
    assert ran.exit_code == 0 and ran.json()["sources"] == {"a": "headers", "b": "headers"} and ran.json()["identical"]


def test_verify_and_inspect_report_digests(ckpts: dict[str, Path], tmp_path: Path) -> None:
    ran = invoke("verify", ckpts["nvdcp"])
    assert ran.exit_code == 0 and "save digests" in ran.stdout
    assert invoke("verify", ckpts["nvdcp"], "--json").json()["digests"] == "checked"
    ran = invoke("verify", GOLDEN / "zstd")
    assert ran.exit_code == 0 and "save digests" not in ran.stdout and "no save digests recorded" in ran.stderr
    assert invoke("verify", GOLDEN / "zstd", "--json").json()["digests"] == "absent"
    assert invoke("inspect", ckpts["nvdcp"], "--json").json()["digests"]["status"] == "recorded"
    assert "digests      recorded: 9 digests" in invoke("inspect", ckpts["nvdcp"]).stdout
    # a tampered digest: the item is damaged, kind "digest"
    path = tmp_path / "ck"
    shutil.copytree(ckpts["nvdcp"], path)
    md = pickle.loads((path / ".metadata").read_bytes())
    from nvdcp.format.digest import digest_record, pack_digests, unpack_digests

    values = list(unpack_digests(getattr(md, DIGEST_ATTR)["digests"]))
    victim = next(i for i, ix in enumerate(md.storage_data) if ix.fqn == "model.ids")
    values[victim] += 1
    setattr(md, DIGEST_ATTR, digest_record(pack_digests(values)))
    (path / ".metadata").write_bytes(pickle.dumps(md))
    ran = invoke("verify", path, "--json")
    assert ran.exit_code == 1
    [bad] = ran.json()["damaged"]
    assert bad["kind"] == "digest" and "model.ids" in bad["item"]

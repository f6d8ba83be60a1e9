"""Delta checkpoint chains through everything that is not a load: pruning and deleting keep what
a kept checkpoint depends on; verify checks the whole chain (and reports a damaged, missing or
replaced base as damage); inspect shows the base and each item's delta/full choice; convert makes
a standalone checkpoint (nvdcp and stock) that loads with the chain gone. Local files and S3."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import nvdcp
from nvdcp.dcp import descriptor
from nvdcp.errors import MissingBaseError, NvdcpError
from nvdcp.manage import (
    CheckpointInUseError,
    checkpoint_base,
    checkpoint_path,
    checkpoint_problem,
    delete_checkpoint,
    dependents,
    latest_checkpoint,
    list_checkpoints,
    prune_checkpoints,
)
from nvdcp.verify import verify_checkpoint
from tests.cli.conftest import flip_byte, invoke
from tests.cli.states import bit_equal


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {
        "w": torch.randn(128, 96, generator=g) * 0.02,  # small updates: stored as a delta
        "h": (torch.randn(64, 80, generator=g) * 0.02).bfloat16(),
        "ids": torch.arange(4000),  # unchanged: the XOR is all zeros
        "noise": torch.randn(3000, generator=g),  # new values each step: stored whole
        "step": torch.tensor(0),
    }


def _step(sd: dict[str, Any], i: int) -> None:
    g = torch.Generator().manual_seed(100 + i)
    sd["w"].add_(torch.randn(sd["w"].shape, generator=g) * 1e-5)
    sd["h"].add_((torch.randn(sd["h"].shape, generator=g) * 1e-4).bfloat16())
    sd["noise"] = torch.randn(3000, generator=g)
    sd["step"] = torch.tensor(i + 1)


def _chain(root: str, saves: int, full_every: int = 3) -> list[tuple[str, dict[str, Any]]]:
    """``saves`` checkpoints under ``root`` (steps 0..saves-1), one policy: full every ``full_every``."""
    policy = nvdcp.DeltaPolicy(full_every=full_every)
    sd = _state()
    out = []
    for i in range(saves):
        path = checkpoint_path(root, i)
        dcp.save(sd, storage_writer=nvdcp.NvcompWriter(path, delta=policy, thread_count=2), no_dist=True)
        out.append((path, {k: v.clone() for k, v in sd.items()}))
        _step(sd, i)
    return out


def _load(path: str, expected: dict[str, Any], reader: Any = None) -> None:
    out = {k: torch.zeros_like(v) for k, v in expected.items()}
    dcp.load(out, storage_reader=reader or nvdcp.NvcompReader(path), no_dist=True)
    for k, v in expected.items():
        assert bit_equal(out[k], v), (path, k)


def _load_error(path: str, expected: dict[str, Any]) -> str:
    """The error a load of ``path`` fails with, in words (dcp.load wraps it per rank)."""
    with pytest.raises((CheckpointException, NvdcpError)) as info:  # CheckpointException: a BaseException
        _load(path, expected)
    exc = info.value
    failures = getattr(exc, "failures", {}) or {}
    return " ".join([str(exc), repr(exc), *(f"{type(e).__name__}: {e}" for e in failures.values())])


def _is_delta_checkpoint(path: str) -> bool:
    md = nvdcp.NvcompReader(path).read_metadata()
    return any(descriptor.is_delta(info) for info in md.storage_data.values())


@pytest.fixture
def chain(tmp_path: Path) -> tuple[str, list[tuple[str, dict[str, Any]]]]:
    """steps 0 (whole), 1 (delta of 0), 2 (delta of 1)."""
    root = str(tmp_path / "run")
    saves = _chain(root, 3)
    assert [_is_delta_checkpoint(p) for p, _ in saves] == [False, True, True]
    return root, saves


# -- manage ------------------------------------------------------------------------------------
def test_prune_keeps_the_bases_of_kept_deltas(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    saves = _chain(root, 3)
    # step 2 is a delta of 1, a delta of 0: keeping the last one keeps all three
    assert prune_checkpoints(root, 1) == []
    assert len(list_checkpoints(root)) == 3
    saves += _chain_more(root, saves[-1][1])
    # 3 is whole again, 4 a delta of it: keeping 4 keeps 3; 0, 1, 2 go
    infos = list_checkpoints(root, bases=True)
    assert [c.base is not None for c in infos] == [False, True, True, False, True]
    assert infos[4].base == checkpoint_path(root, 3)
    assert [c.step for c in prune_checkpoints(root, 1, dry_run=True)] == [0, 1, 2]
    assert [c.step for c in prune_checkpoints(root, 1)] == [0, 1, 2]
    assert [c.step for c in list_checkpoints(root)] == [3, 4]
    _load(saves[4][0], saves[4][1])


def _chain_more(root: str, state: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Steps 3 (whole) and 4 (delta of 3), as a job resumed from step 2 with a new policy would."""
    policy = nvdcp.DeltaPolicy(full_every=2)
    sd = {k: v.clone() for k, v in state.items()}
    out = []
    for i in (3, 4):
        _step(sd, i)
        path = checkpoint_path(root, i)
        dcp.save(sd, storage_writer=nvdcp.NvcompWriter(path, delta=policy, thread_count=2), no_dist=True)
        out.append((path, {k: v.clone() for k, v in sd.items()}))
    assert [_is_delta_checkpoint(p) for p, _ in out] == [False, True]
    return out


def test_delete_refuses_a_base_unless_forced(chain: tuple[str, list[tuple[str, dict[str, Any]]]]) -> None:
    root, saves = chain
    (p0, _), (p1, s1), (p2, s2) = saves
    assert dependents(p0) == [p1, p2] and dependents(p1) == [p2] and dependents(p2) == []
    assert checkpoint_base(p2) == p1 and checkpoint_base(p0) is None
    with pytest.raises(CheckpointInUseError, match="step_00000002") as info:
        delete_checkpoint(p1)
    assert info.value.dependents == [p2]
    assert os.path.isfile(os.path.join(p1, ".metadata"))  # nothing touched
    delete_checkpoint(p0, force=True)
    assert not os.path.exists(p0)
    # the dependents no longer load, with a clear error, and are not usable latest checkpoints
    error = _load_error(p1, s1)
    assert "MissingBaseError" in error and "restore that checkpoint" in error
    problem = checkpoint_problem(p2)
    assert problem is not None and "its base is unusable" in problem and "is gone" in problem
    with pytest.raises(MissingBaseError):
        checkpoint_base(p1)
    assert latest_checkpoint(root) is None
    assert latest_checkpoint(root, verify=False) is not None
    # a checkpoint nothing depends on deletes as before
    delete_checkpoint(p2)
    assert [c.step for c in list_checkpoints(root)] == [1]
    del s2


# -- verify ------------------------------------------------------------------------------------
def test_verify_checks_the_whole_chain(chain: tuple[str, list[tuple[str, dict[str, Any]]]]) -> None:
    _, saves = chain
    (p0, _), (p1, _), (p2, _) = saves
    report = verify_checkpoint(p2)
    assert report.ok and report.base is not None and report.base.depth == 2
    assert report.base_found == p1 and [r.url for r in report.chain] == [
        nvdcp.NvcompReader(p).storage.url for p in (p1, p0)]
    assert report.delta_items >= 3 and report.chain[-1].delta_items == 0

    ran = invoke("verify", p2)
    assert ran.exit_code == 0, ran.stdout + ran.stderr
    assert "chain OK: 3 checkpoints" in ran.stdout and "stored as deltas against" in ran.stdout
    doc = invoke("verify", p2, "--json").json()
    assert doc["ok"] and doc["base"]["depth"] == 2 and doc["base"]["found"] == p1
    assert len(doc["chain"]) == 2 and all(r["ok"] for r in doc["chain"]) and doc["delta_items"] >= 3


def test_verify_reports_a_damaged_base(chain: tuple[str, list[tuple[str, dict[str, Any]]]]) -> None:
    _, saves = chain
    (p0, _), _, (p2, _) = saves
    flip_byte(p0, "noise", -1)  # a payload byte of the whole base
    ran = invoke("verify", p2, "--json")
    assert ran.exit_code == 1
    doc = ran.json()
    assert not doc["ok"] and doc["damaged"] == []  # the delta's own records are intact
    assert doc["chain"][0]["ok"] and not doc["chain"][1]["ok"]
    assert doc["chain"][1]["damaged"][0]["item"].startswith("'noise'")
    ran = invoke("verify", p2)
    assert ran.exit_code == 1 and "DAMAGED base" in ran.stdout and "chain DAMAGED" in ran.stdout


def test_verify_checks_each_delta_item_against_its_base_items_header(
    chain: tuple[str, list[tuple[str, dict[str, Any]]]],
) -> None:
    # chain=False: the delta alone, with each delta item's base digest checked against the base
    # item's header (read alone); a damaged header there is this checkpoint's damage too
    _, saves = chain
    _, (p1, _), (p2, _) = saves
    report = verify_checkpoint(p2, chain=False)
    assert report.ok and report.chain == [] and report.base_found == p1
    flip_byte(p1, "w", 20)  # a byte of the base item's header
    report = verify_checkpoint(p2, chain=False)
    assert not report.ok and [d.item.split()[0] for d in report.damaged] == ["'w'"]
    assert "its base item is unreadable" in report.damaged[0].error


def test_verify_reports_a_missing_or_replaced_base(chain: tuple[str, list[tuple[str, dict[str, Any]]]]) -> None:
    _, saves = chain
    (p0, _), (p1, _), (p2, s2) = saves
    shutil.rmtree(p1)
    ran = invoke("verify", p2, "--json")
    assert ran.exit_code == 1, ran.stderr
    doc = ran.json()
    assert doc["base"]["found"] is None and doc["chain"] == []
    (damage,) = doc["damaged"]
    assert damage["kind"] == "MissingBaseError" and "restore that checkpoint" in damage["error"]
    assert doc["items"] == len(s2)  # its own records were still checked
    ran = invoke("verify", p2)
    assert ran.exit_code == 1 and "(not found)" in ran.stdout

    # another save where the base was: not the base of this delta
    dcp.save(_state(), storage_writer=nvdcp.NvcompWriter(p1), no_dist=True)
    report = verify_checkpoint(p2)
    assert not report.ok and report.damaged[0].kind == "BaseMismatchError"
    assert "replaced" in report.damaged[0].error
    error = _load_error(p2, s2)
    assert "BaseMismatchError" in error and "overwritten" in error
    del p0


# -- inspect -----------------------------------------------------------------------------------
def test_inspect_shows_the_base_and_each_items_choice(chain: tuple[str, list[tuple[str, dict[str, Any]]]]) -> None:
    _, saves = chain
    (p0, _), (p1, _), (p2, _) = saves
    doc = invoke("inspect", p2, "--json").json()
    base = doc["base"]
    assert base["found"] == p1 and base["depth"] == 2 and base["relative"] == "../step_00000001"
    assert base["save_id"] == nvdcp.NvcompReader(p1).read_metadata().storage_meta.save_id
    kinds = {i["fqn"]: i["stored_as"] for i in doc["items"]}
    assert kinds["w"] == kinds["h"] == kinds["ids"] == "delta" and kinds["noise"] == "full"
    shard = next(i for i in doc["items"] if i["fqn"] == "w")["shards"][0]
    assert shard["delta"] is True and isinstance(shard["base_digest"], int)
    totals = doc["totals"]
    assert 3 <= totals["delta_items"] < totals["items"] and 0 < totals["delta_bytes"] < totals["stored_bytes"]

    ran = invoke("inspect", p2)
    assert ran.exit_code == 0, ran.stderr
    assert "delta        against save" in ran.stdout and "chain depth 2" in ran.stdout
    assert "items stored as deltas" in ran.stdout
    row = next(line for line in ran.stdout.splitlines() if line.startswith("noise"))
    assert " full " in row

    whole = invoke("inspect", p0, "--json").json()
    assert whole["base"] is None and whole["totals"]["delta_items"] == 0

    shutil.rmtree(p0)
    ran = invoke("inspect", p1)
    assert ran.exit_code == 0 and "NOT FOUND" in ran.stdout and "cannot be loaded" in ran.stderr


# -- convert -----------------------------------------------------------------------------------
@pytest.mark.parametrize("to", ["nvdcp", "stock"])
def test_convert_materializes_a_delta(chain: tuple[str, list[tuple[str, dict[str, Any]]]], tmp_path: Path,
                                      to: str) -> None:
    root, saves = chain
    p2, s2 = saves[2]
    dst = str(tmp_path / f"standalone_{to}")
    ran = invoke("convert", p2, dst, "--to", to, "--json")
    assert ran.exit_code == 0, ran.stderr
    doc = ran.json()
    assert doc["source_base"] == saves[1][0] and doc["delta_items"] >= 3
    shutil.rmtree(root)  # the whole chain is gone
    if to == "nvdcp":
        md = nvdcp.NvcompReader(dst).read_metadata()
        assert "nvdcp_delta" not in vars(md)
        assert not any(descriptor.is_delta(info) for info in md.storage_data.values())
        _load(dst, s2)
        assert verify_checkpoint(dst).ok
    else:
        _load(dst, s2, dcp.FileSystemReader(dst))


def test_convert_of_a_delta_without_its_base_fails_cleanly(
    chain: tuple[str, list[tuple[str, dict[str, Any]]]], tmp_path: Path,
) -> None:
    _, saves = chain
    shutil.rmtree(saves[0][0])
    dst = tmp_path / "out"
    ran = invoke("convert", saves[2][0], dst)
    assert ran.exit_code == 3 and "restore that checkpoint" in ran.stderr
    assert not (dst / ".metadata").exists()
    # nor can it be converted onto its own base
    ran = invoke("convert", saves[1][0], saves[0][0])
    assert ran.exit_code == 3


def test_convert_refuses_to_write_over_its_own_base(chain: tuple[str, list[tuple[str, dict[str, Any]]]]) -> None:
    _, saves = chain
    ran = invoke("convert", saves[2][0], saves[0][0], "--overwrite")
    assert ran.exit_code == 3 and "base chain" in ran.stderr
    _load(saves[2][0], saves[2][1])


# -- S3 ----------------------------------------------------------------------------------------
@pytest.mark.s3
def test_delta_chain_on_s3(s3env: Any, tmp_path: Path) -> None:
    root = s3env.url("run")
    saves = _chain(root, 3)
    (p0, _), (p1, _), (p2, s2) = saves
    assert _is_delta_checkpoint(p2)

    ran = invoke("verify", p2, "--json")
    assert ran.exit_code == 0, ran.stdout + ran.stderr
    doc = ran.json()
    assert doc["base"]["found"] == p1 and len(doc["chain"]) == 2
    doc = invoke("inspect", p2, "--json").json()
    assert doc["base"]["found"] == p1 and doc["totals"]["delta_items"] >= 3

    assert prune_checkpoints(root, 1) == []
    with pytest.raises(CheckpointInUseError):
        delete_checkpoint(p0)

    local = str(tmp_path / "standalone")
    assert invoke("convert", p2, local).exit_code == 0

    # the base goes out of band: verify names it, a load fails clearly, the copy still loads
    for key in s3env.keys("run/step_00000001/"):
        s3env.client.delete_object(Bucket=s3env.bucket, Key=key)
    ran = invoke("verify", p2, "--json")
    assert ran.exit_code == 1 and ran.json()["damaged"][0]["kind"] == "MissingBaseError"
    assert "restore that checkpoint" in _load_error(p2, s2)
    _load(local, s2)

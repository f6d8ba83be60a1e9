"""Checkpoint management on a real S3 endpoint (the moto server on loopback): checkpoints
saved by NvcompWriter under an ``s3://`` prefix are listed, the latest usable one found with an
uncommitted one present, and old ones pruned."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import nvdcp
from nvdcp.manage import checkpoint_path, latest_checkpoint, list_checkpoints, prune_checkpoints
from nvdcp.storage import Storage, open_storage
from tests.s3.s3_testkit import S3Env, moto_s3, s3env  # noqa: F401  (fixtures)

pytestmark = pytest.mark.s3


def _needs_listing(url: str) -> None:
    storage = open_storage(url)
    if getattr(type(storage), "list_children", Storage.list_children) is Storage.list_children:
        pytest.skip(f"{type(storage).__name__}.list_children is not implemented yet")


def _save(url: str, step: int) -> None:
    sd: dict[str, Any] = {"w": torch.full((256, 16), float(step)), "step": torch.tensor(step)}
    dcp.save(sd, storage_writer=nvdcp.NvcompWriter(url))


def test_latest_and_prune_under_an_s3_prefix(s3env: S3Env) -> None:
    root = s3env.url("run1")
    _needs_listing(root)
    for step in (10, 20, 30):
        _save(checkpoint_path(root, step), step)
    # step 30 never committed: drop its .metadata
    s3env.client.delete_object(Bucket=s3env.bucket, Key="run1/step_00000030/.metadata")
    s3env.client.put_object(Bucket=s3env.bucket, Key="run1/notes/readme.txt", Body=b"not a checkpoint")
    assert [(c.step, c.complete) for c in list_checkpoints(root)] == [(10, True), (20, True), (30, False)]
    latest = latest_checkpoint(root)
    assert latest is not None and latest.path == f"{root}/step_00000020"
    out = {"w": torch.zeros(256, 16), "step": torch.tensor(0)}
    dcp.load(out, storage_reader=nvdcp.NvcompReader(latest.path))
    assert int(out["step"]) == 20
    assert [c.step for c in prune_checkpoints(root, 1)] == [10]
    keys = s3env.keys("run1/")
    assert not any(k.startswith("run1/step_00000010/") for k in keys)
    assert any(k.startswith("run1/step_00000030/") for k in keys)  # maybe in progress: kept
    assert "run1/notes/readme.txt" in keys

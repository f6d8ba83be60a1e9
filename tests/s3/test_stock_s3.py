"""Stock DCP and mixed checkpoints on S3 (the moto server on loopback): NvcompReader reads them
bit-exactly through both S3 backends, ``is_nvdcp_checkpoint`` tells them apart, and the
FsspecWriter/FsspecReader-style keyword arguments (s3fs options) work as drop-ins."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._extension import ZStandard
from torch.distributed.checkpoint.api import CheckpointException

import nvdcp
from tests.dcp.helpers import failure_of
from tests.dcp.test_stock_read import assert_same, load_target, make_mixed, stock_state
from tests.s3.s3_testkit import S3Env

pytestmark = [pytest.mark.s3, pytest.mark.timeout(120)]


def _upload(s3env: S3Env, local: Path, prefix: str) -> str:
    for f in sorted(local.iterdir()):
        s3env.client.put_object(Bucket=s3env.bucket, Key=f"{prefix}/{f.name}", Body=f.read_bytes())
    return s3env.url(prefix)


def _options(s3env: S3Env, backend: str) -> dict[str, Any]:
    if backend == "fsspec":
        return {"backend": "fsspec", "endpoint_url": s3env.endpoint}
    return {"retry_backoff_s": 0.01, "retry_backoff_max_s": 0.1}


@pytest.mark.parametrize("backend", ["boto3", "fsspec"])
def test_stock_checkpoint_on_s3_loads_bit_exact(s3env: S3Env, tmp_path: Path, backend: str) -> None:
    sd = stock_state()
    dcp.save(sd, storage_writer=FileSystemWriter(tmp_path / "plain", thread_count=2))
    dcp.save(sd, storage_writer=FileSystemWriter(tmp_path / "zstd", _extensions=[ZStandard()]))
    opts = _options(s3env, backend)
    for name in ("plain", "zstd"):
        url = _upload(s3env, tmp_path / name, f"stock/{name}")
        assert nvdcp.is_nvdcp_checkpoint(url, storage_options=opts) is False
        for threads in (1, 3):
            target = load_target(sd)
            dcp.load(target, storage_reader=nvdcp.NvcompReader(url, thread_count=threads, storage_options=opts))
            assert_same(target, sd)


def test_mixed_checkpoint_on_s3(s3env: S3Env, tmp_path: Path) -> None:
    sd = stock_state()
    dcp.save(sd, storage_writer=nvdcp.NvcompWriter(tmp_path / "nv", codec="zstd"))
    dcp.save(sd, storage_writer=FileSystemWriter(tmp_path / "stock"))
    make_mixed(tmp_path / "nv", tmp_path / "stock", tmp_path / "mixed", {"model.w", "ids", "extra.note"})
    url = _upload(s3env, tmp_path / "mixed", "mixed")
    opts = _options(s3env, "boto3")
    assert nvdcp.is_nvdcp_checkpoint(url, storage_options=opts) is True
    target = load_target(sd)
    dcp.load(target, storage_reader=nvdcp.NvcompReader(url, storage_options=opts))
    assert_same(target, sd)


def test_damaged_stock_blob_on_s3_is_named(s3env: S3Env, tmp_path: Path) -> None:
    sd = {"a": torch.arange(1000, dtype=torch.float32), "b": torch.ones(10)}
    dcp.save(sd, storage_writer=FileSystemWriter(tmp_path / "c"))
    f = tmp_path / "c" / "__0_0.distcp"
    data = bytearray(f.read_bytes())
    data[:64] = b"\xff" * 64  # the first item's zip header
    f.write_bytes(bytes(data))
    url = _upload(s3env, tmp_path / "c", "damaged")
    with pytest.raises(CheckpointException) as info:
        dcp.load(load_target(sd), storage_reader=nvdcp.NvcompReader(url, storage_options=_options(s3env, "boto3")))
    err = failure_of(info.value)
    assert isinstance(err, nvdcp.CorruptCheckpointError) and "__0_0.distcp @ 0 item" in str(err), err


def test_no_metadata_on_s3(s3env: S3Env) -> None:
    with pytest.raises(nvdcp.IncompleteCheckpointError):
        nvdcp.is_nvdcp_checkpoint(s3env.url("nothing/here"), storage_options=_options(s3env, "boto3"))


def test_fsspec_style_keyword_arguments_on_s3(s3env: S3Env) -> None:
    """``FsspecWriter(url, **s3fs_options)`` / ``FsspecReader(url, **s3fs_options)``: the same
    keywords reach s3fs through nvdcp's fsspec backend."""
    sd = stock_state()
    url = s3env.url("kw/ckpt")
    writer = nvdcp.NvcompWriter(url, True, True, 2, endpoint_url=s3env.endpoint)
    assert writer.storage_options == {"endpoint_url": s3env.endpoint, "backend": "fsspec"}
    dcp.save(sd, storage_writer=writer)
    assert nvdcp.is_nvdcp_checkpoint(url, storage_options=_options(s3env, "boto3"))
    target = load_target(sd)
    dcp.load(target, storage_reader=nvdcp.NvcompReader(url, endpoint_url=s3env.endpoint))
    assert_same(target, sd)
    # overwrite=False: refused with what stock raises (a RuntimeError), naming the location
    with pytest.raises(CheckpointException) as info:
        dcp.save(sd, storage_writer=nvdcp.NvcompWriter(url, overwrite=False, endpoint_url=s3env.endpoint))
    err = failure_of(info.value)
    assert isinstance(err, RuntimeError) and "Checkpoint already exists" in str(err) and "kw/ckpt" in str(err)

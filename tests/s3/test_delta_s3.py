"""Delta checkpoints on S3 (a moto server on loopback): a chain saved with a DeltaPolicy, a resumed
job deltas against a checkpoint read back from the bucket, everything loads bit-exactly; a
deleted base is named."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import nvdcp
from nvdcp.dcp import descriptor
from tests.conftest import bit_equal, weights_like
from tests.dcp.helpers import empty_like_sd, failure_of
from tests.s3.s3_testkit import TEST_MIN_PART, S3Env, moto_min_part_size

pytestmark = [pytest.mark.s3, pytest.mark.timeout(120)]

OPTS: dict[str, Any] = dict(part_size=TEST_MIN_PART, min_part_size=TEST_MIN_PART, retry_backoff_s=0.01,
                            retry_backoff_max_s=0.1)


@pytest.fixture(autouse=True)
def _small_parts_need_lowered_moto() -> None:
    if moto_min_part_size() > TEST_MIN_PART:
        pytest.skip("moto was imported before S3_UPLOAD_PART_MIN_SIZE was set")


def _state(step: int) -> dict[str, Any]:
    sd: dict[str, Any] = {
        "w": weights_like((256, 200), seed=1),
        "b16": weights_like((64, 100), torch.bfloat16, seed=2),
        "ids": torch.arange(5000, dtype=torch.int64),
        "extra": {"step": step},
    }
    for s in range(1, step + 1):
        g = torch.Generator().manual_seed(s)
        sd["w"] += torch.randn(256, 200, generator=g) * 1e-5
        sd["ids"][s * 10 : s * 10 + 3] += 1
    return sd


def _load(url: str, step: int) -> dict[str, Any]:
    sd = empty_like_sd(_state(step))
    dcp.load(sd, storage_reader=nvdcp.NvcompReader(url, storage_options=OPTS))
    return sd


def _same(got: dict[str, Any], want: dict[str, Any]) -> None:
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert bit_equal(got[k], v), k
        else:
            assert got[k] == v, k


def test_delta_chain_on_s3(s3env: S3Env) -> None:
    policy = nvdcp.DeltaPolicy(full_every=8)
    urls = [s3env.url(f"run/step{s}") for s in range(4)]
    for step in range(2):
        dcp.save(_state(step), storage_writer=nvdcp.NvcompWriter(urls[step], storage_options=OPTS, delta=policy,
                                                                 thread_count=2))
    md = nvdcp.NvcompReader(urls[1], storage_options=OPTS).read_metadata()
    record = md.nvdcp_delta
    assert record["depth"] == 1 and record["base"] == urls[0] and record["relative"] == "../step0"
    assert {"w", "ids"} <= {ix.fqn for ix, info in md.storage_data.items() if descriptor.is_delta(info)}
    # a restarted job: a fresh policy resumed from step1 (a delta), its bases read back from S3
    fresh = nvdcp.DeltaPolicy(full_every=8)
    fresh.resume_from(urls[1], storage_options=OPTS)
    dcp.save(_state(2), storage_writer=nvdcp.NvcompWriter(urls[2], storage_options=OPTS, delta=fresh))
    assert nvdcp.NvcompReader(urls[2], storage_options=OPTS).read_metadata().nvdcp_delta["depth"] == 2
    for step in range(3):
        _same(_load(urls[step], step), _state(step))
    # the base of the base deleted: the chain's load names it
    s3env.client.delete_objects(Bucket=s3env.bucket, Delete={"Objects": [
        {"Key": k} for k in s3env.keys("run/step0/")]})
    with pytest.raises(CheckpointException) as info:
        _load(urls[2], 2)
    err = failure_of(info.value)
    assert isinstance(err, nvdcp.MissingBaseError) and "step0" in str(err), repr(err)

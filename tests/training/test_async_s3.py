"""``dcp.async_save`` to a real S3 endpoint (the moto server on loopback): the staged state is
uploaded in the background while training changes the live tensors, and loads back bit-exactly."""

from __future__ import annotations

import pytest
import torch.distributed.checkpoint as dcp

import nvdcp
from nvdcp.dcp.stager import NvcompStager
from tests.dcp.test_stager import _assert_same, _mutate, _state, _target
from tests.s3.s3_testkit import S3Env, moto_s3, s3env  # noqa: F401  (fixtures)

pytestmark = pytest.mark.s3


@pytest.mark.parametrize("stager", [None, "copy", "compress"])
def test_async_save_to_s3_saves_the_staged_state(s3env: S3Env, stager: str | None) -> None:
    url = s3env.url(f"async-{stager}")
    async_stager = NvcompStager(cpu_mode=stager) if stager else None  # None: the writer stages
    sd, want = _state(), _state()
    for step in range(2):  # the second save reuses the stager's buffers
        fut = dcp.async_save(sd, storage_writer=nvdcp.NvcompWriter(f"{url}/{step}"), async_stager=async_stager)
        _mutate(sd)  # the next training step, while the upload runs
        fut.result()
        out = _target()
        dcp.load(out, storage_reader=nvdcp.NvcompReader(f"{url}/{step}"))
        _assert_same(out, want)
        _mutate(want)  # what the live state held when the next save started
    assert any(k.startswith(f"async-{stager}/1/") for k in s3env.keys(f"async-{stager}/"))
    if async_stager is not None:
        async_stager.close()

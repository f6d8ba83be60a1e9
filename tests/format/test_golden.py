"""Committed checkpoints from format v1 decode bit-exactly on every run (tests/golden/make_golden.py)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import nvdcp
from tests.golden.make_golden import CODECS, digest, golden_state, golden_target

GOLDEN = Path(__file__).parents[1] / "golden" / "v1"


@pytest.mark.parametrize("codec", CODECS)
def test_golden_checkpoint_decodes(codec: str) -> None:
    expected = json.loads((GOLDEN / "expected.json").read_text())
    sd = golden_target()
    dcp.load(sd, storage_reader=nvdcp.NvcompReader(GOLDEN / codec))
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            assert digest(v) == expected[k], k
    sd["extra"].seek(0)
    assert hashlib.sha256(sd["extra"].read()).hexdigest() == expected["extra"]
    assert sd["step"] == 42


def test_golden_state_is_still_what_was_committed() -> None:
    expected = json.loads((GOLDEN / "expected.json").read_text())
    for k, v in golden_state().items():
        if isinstance(v, torch.Tensor):
            assert digest(v) == expected[k], k


@pytest.mark.parametrize("codec", CODECS)
def test_golden_files_pass_verification(codec: str) -> None:
    report = nvdcp.verify_checkpoint(GOLDEN / codec)
    assert report.ok, report.damaged


def test_gpu_written_checkpoint_loads_on_the_cpu() -> None:
    """Written on the H200 with the default codec (GDeflate planes by nvCOMP); decoded here by
    libnvcomp_cpu when this machine has no GPU."""
    expected = json.loads((GOLDEN / "expected.json").read_text())
    sd = golden_target()
    from nvdcp.gpu.config import GpuConfig

    dcp.load(sd, storage_reader=nvdcp.NvcompReader(GOLDEN / "gpu_auto", gpu=GpuConfig(decode_device="cpu")))
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            assert digest(v) == expected[k], k
    md = nvdcp.NvcompReader(GOLDEN / "gpu_auto").read_metadata()
    codecs = {info.transform_descriptors[0] for info in md.storage_data.values()}
    assert "nvdcp.gdeflate/1" in codecs


def test_gpu_only_codec_without_gpu_is_refused_by_name() -> None:
    from torch.distributed.checkpoint.api import CheckpointException

    from nvdcp.gpu import gpu_available

    if gpu_available():
        pytest.skip("this machine can decode ANS")
    with pytest.raises(CheckpointException) as info:
        dcp.load(golden_target(), storage_reader=nvdcp.NvcompReader(GOLDEN / "gpu_ans"))
    from tests.dcp.helpers import failure_of

    err = failure_of(info.value)
    assert isinstance(err, nvdcp.CodecUnavailableError)
    assert "'ans'" in str(err) and "model." in str(err)

"""Delta checkpoints through ``dcp.async_save``: the writer stages raw host copies, the background
save XORs them with their base and compresses them; the chain loads bit-exact."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import nvdcp
from nvdcp.dcp import descriptor
from nvdcp.dcp.stager import shared_stager
from tests.conftest import bit_equal, weights_like


def _is_delta(path: Path) -> dict[str, bool]:
    md = nvdcp.NvcompReader(path).read_metadata()
    return {ix.fqn: descriptor.is_delta(info) for ix, info in md.storage_data.items()}


def test_async_save_chain_of_deltas_loads_bit_exact(tmp_path: Path) -> None:
    policy = nvdcp.DeltaPolicy(full_every=3)
    sd = {"w": weights_like((512, 256)), "b": weights_like((4096,), torch.bfloat16, seed=1), "step": torch.tensor(0)}
    saved = []
    for i in range(4):
        fut = dcp.async_save(sd, storage_writer=nvdcp.NvcompWriter(tmp_path / f"s{i}", delta=policy))
        expected = {k: v.clone() for k, v in sd.items()}  # what the save must hold
        for v in sd.values():  # the next step changes the state while the save runs
            v.add_(torch.ones_like(v) * 1e-3 if v.is_floating_point() else torch.ones_like(v))
        (fut.upload_completion if hasattr(fut, "upload_completion") else fut).result()
        saved.append(expected)
    kinds = [_is_delta(tmp_path / f"s{i}") for i in range(4)]
    assert not any(kinds[0].values()) and not any(kinds[3].values())  # full every 3 saves
    assert kinds[1]["w"] and kinds[2]["b"]
    for i, expected in enumerate(saved):
        out = {k: torch.zeros_like(v) for k, v in expected.items()}
        dcp.load(out, storage_reader=nvdcp.NvcompReader(tmp_path / f"s{i}"))
        for k in expected:
            assert bit_equal(out[k], expected[k]), (i, k)


def test_delta_writer_stages_raw_copies_other_writers_compress() -> None:
    writer = nvdcp.NvcompWriter("unused_delta", delta=nvdcp.DeltaPolicy())
    plain = nvdcp.NvcompWriter("unused_plain")
    assert shared_stager(writer.encoding, writer.gpu, "copy").gpu_mode == "copy"
    assert shared_stager(plain.encoding, plain.gpu).gpu_mode == "compress"


def test_a_delta_policy_refuses_to_be_pickled_for_another_process() -> None:
    writer = nvdcp.NvcompWriter("unused_pickle", delta=nvdcp.DeltaPolicy())
    with pytest.raises(TypeError, match="THREAD mode"):
        pickle.dumps(writer)
    pickle.dumps(nvdcp.NvcompWriter("unused_pickle"))  # without a policy it still travels

"""The commands with nvCOMP on a GPU: GPU-only codecs through convert, inspect, verify, bench."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli.conftest import invoke, load_nvdcp, records
from tests.cli.states import assert_same, blank_like, make_state

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("codec", ["ans", "bitcomp"])
def test_gpu_only_codec_round_trip(ckpts: dict[str, Path], tmp_path: Path, codec: str) -> None:
    out, back = tmp_path / codec, tmp_path / "back"
    ran = invoke("convert", ckpts["stock"], out, "--codec", codec)
    assert ran.exit_code == 0, ran.stderr
    doc = invoke("inspect", out, "--json").json()
    weight = next(i for i in doc["items"] if i["fqn"] == "model.embed.weight")
    assert weight["codecs"] == [codec] and weight["shards"][0]["descriptor"] == f"nvdcp.{codec}/1"
    ran = invoke("verify", out, "--json")
    assert ran.exit_code == 0, ran.stdout
    assert_same(load_nvdcp(out), make_state())  # the reader decodes on the GPU
    assert invoke("convert", out, back, "--to", "stock").exit_code == 0
    assert all(r.transform_descriptors is None for r in records(back).values())
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    sd = blank_like(make_state())
    dcp.load(sd, storage_reader=FileSystemReader(back))
    assert_same(sd, make_state())


def test_bench_runs_nvcomp_codecs(ckpts: dict[str, Path], tmp_path: Path) -> None:
    ran = invoke("bench", ckpts["nvdcp"], "--gpu", "--codec", "gdeflate", "--codec", "ans", "--json",
                 "--plot", tmp_path / "gpu.png")
    assert ran.exit_code == 0, ran.stderr
    rows = {(r["codec"], r["device"], r["dtype"]): r for r in ran.json()["results"]}
    assert ("gdeflate", "cuda", "float32") in rows and ("ans", "cuda", "bfloat16") in rows
    assert ("gdeflate", "cpu", "float32") in rows and not any(k[:2] == ("ans", "cpu") for k in rows)
    assert all(r["encode_gbps"] and r["decode_gbps"] for r in rows.values())

"""Bit-exact save/load round trips over dtypes, shapes, strides, codecs and byte items."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import ALL_DTYPES, bit_equal, random_tensor, weights_like
from tests.dcp.helpers import data_files, empty_like_sd, load, save

SHAPES = [(), (0,), (1,), (7,), (3, 0, 2), (33, 65), (70000,)]


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype_round_trips(tmp_path: Path, dtype: torch.dtype) -> None:
    sd = {f"t{i}": random_tensor(dtype, shape, seed=i) for i, shape in enumerate(SHAPES)}
    save(sd, tmp_path)
    out = empty_like_sd(sd)
    load(out, tmp_path)
    for k in sd:
        assert bit_equal(out[k], sd[k]), k


@pytest.mark.parametrize("codec", ["auto", "zstd", "gdeflate", "none"])
def test_every_cpu_codec_round_trips(tmp_path: Path, codec: str) -> None:
    sd = {
        "w32": weights_like((300, 257)),
        "w16": weights_like((300, 257), torch.bfloat16, seed=1),
        "h": weights_like((1000,), torch.float16, seed=2),
        "ids": torch.arange(5000),
        "mask": torch.rand(999) > 0.3,
    }
    save(sd, tmp_path, codec=codec)
    out = empty_like_sd(sd)
    load(out, tmp_path)
    for k in sd:
        assert bit_equal(out[k], sd[k]), k


def test_non_contiguous_views_store_only_the_view(tmp_path: Path) -> None:
    base = weights_like((512, 512))
    sd = {
        "strided": base[:, ::4],
        "transposed": base[:8].t(),
        "slice": base[100:101],
        "expanded": torch.arange(3.0).expand(4, 3),
        "conj": torch.randn(5, dtype=torch.complex64).conj(),
    }
    save(sd, tmp_path, codec="none")
    stored = sum((tmp_path / n).stat().st_size for n in data_files(tmp_path))
    assert stored < base.numel() * 4 / 2  # the 1 MiB base is not written in full
    out = empty_like_sd(sd)
    load(out, tmp_path)
    for k in sd:
        assert bit_equal(out[k], sd[k].resolve_conj()), k


def test_byte_items_and_nested_state(tmp_path: Path) -> None:
    sd = {
        "model": {"w": weights_like((10, 10))},
        "optim": {"param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": [0]}], "step": 7},
        "blob": io.BytesIO(b"\x00\x01 arbitrary bytes" * 1000),
        "note": "hello",
    }
    save(sd, tmp_path)
    groups = [{"lr": 0.0, "betas": (0.0, 0.0), "params": [9]}]
    out = {"model": {"w": torch.zeros(10, 10)}, "optim": {"param_groups": groups, "step": 0},
           "blob": io.BytesIO(), "note": None}
    load(out, tmp_path)
    assert torch.equal(out["model"]["w"], sd["model"]["w"])
    assert out["optim"] == sd["optim"]
    assert out["note"] == "hello"
    out["blob"].seek(0)
    assert out["blob"].read() == sd["blob"].getvalue()


@pytest.mark.parametrize("threads", [1, 3])
def test_thread_count_files(tmp_path: Path, threads: int) -> None:
    sd = {f"p{i}": weights_like((100, i + 1), seed=i) for i in range(10)}
    save(sd, tmp_path, thread_count=threads, sync_files=False)
    assert len(data_files(tmp_path)) == threads
    out = empty_like_sd(sd)
    load(out, tmp_path, thread_count=2)
    for k in sd:
        assert bit_equal(out[k], sd[k])


def test_compression_pays_on_weights(tmp_path: Path) -> None:
    sd = {"w": weights_like((1 << 20,), torch.bfloat16)}
    writer = save(sd, tmp_path)
    assert writer.last_report is not None
    assert writer.last_report.ratio > 1.4


def test_load_into_other_dtype_device_layout_fails_loudly_on_shape(tmp_path: Path) -> None:
    save({"w": torch.ones(4, 4)}, tmp_path)
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises((CheckpointException, ValueError, RuntimeError)):
        load({"w": torch.zeros(5, 4)}, tmp_path)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    dtype=st.sampled_from(ALL_DTYPES),
    shape=st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple),
    codec=st.sampled_from(["auto", "zstd", "gdeflate", "none"]),
    step=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_property_round_trip(tmp_path_factory: pytest.TempPathFactory, dtype: torch.dtype,
                             shape: tuple[int, ...], codec: str, step: int, seed: int) -> None:
    path = tmp_path_factory.mktemp("prop")
    full = random_tensor(dtype, shape, seed=seed)
    view = full[..., ::step] if full.dim() else full
    sd = {"x": view}
    save(sd, path, codec=codec, sync_files=False, chunk_bytes=1024)
    out = empty_like_sd(sd)
    load(out, path)
    assert bit_equal(out["x"], view.contiguous())

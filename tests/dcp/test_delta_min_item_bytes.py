"""Items under ``min_item_bytes`` are stored whole in delta saves and not kept in the cache (the
rest of the suite sets ``$NVDCP_DELTA_MIN_ITEM_BYTES=0``; these tests use the default)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import nvdcp
from nvdcp.dcp import descriptor
from nvdcp.pipeline.delta import DEFAULT_MIN_ITEM_BYTES, MIN_ITEM_BYTES_ENV
from tests.conftest import bit_equal, weights_like
from tests.dcp.helpers import empty_like_sd, load, save

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _default_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MIN_ITEM_BYTES_ENV, raising=False)


def _state() -> dict[str, torch.Tensor]:
    return {
        "big": weights_like((256, 128), seed=1),  # 128 KiB
        "edge": weights_like((DEFAULT_MIN_ITEM_BYTES // 4,), seed=2),  # exactly the threshold
        "small": weights_like((64, 64), seed=3),  # 16 KiB
    }


def _step(sd: dict[str, torch.Tensor]) -> None:
    for k, v in sd.items():
        v.add_(torch.randn(v.shape, generator=torch.Generator().manual_seed(len(k))) * 1e-5)


def _delta_fqns(path: Path) -> set[str]:
    md = nvdcp.NvcompReader(path).read_metadata()
    return {ix.fqn for ix, info in md.storage_data.items() if descriptor.is_delta(info)}


def _chain(tmp_path: Path, policy: nvdcp.DeltaPolicy) -> tuple[Path, dict[str, torch.Tensor]]:
    sd = _state()
    save(sd, tmp_path / "s0", delta=policy)
    _step(sd)
    save(sd, tmp_path / "s1", delta=policy)
    return tmp_path / "s1", {k: v.clone() for k, v in sd.items()}


def test_items_under_the_threshold_are_stored_whole_and_not_kept(tmp_path: Path) -> None:
    policy = nvdcp.DeltaPolicy(full_every=4)
    assert policy.min_item_bytes == DEFAULT_MIN_ITEM_BYTES
    path, want = _chain(tmp_path, policy)
    assert _delta_fqns(path) == {"big", "edge"}
    kept = {ix.fqn for ix in policy.cache.entries}
    assert kept == {"big", "edge"}  # the small item's bytes take no cache memory
    assert policy.cache.used == (want["big"].numel() + want["edge"].numel()) * 4
    out: dict[str, Any] = empty_like_sd(want)
    load(out, path)
    for k in want:
        assert bit_equal(out[k], want[k]), k


def test_an_explicit_threshold_wins_over_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MIN_ITEM_BYTES_ENV, str(1 << 30))
    assert nvdcp.DeltaPolicy().min_item_bytes == 1 << 30
    path, _ = _chain(tmp_path, nvdcp.DeltaPolicy(full_every=4, min_item_bytes=0))
    assert _delta_fqns(path) == {"big", "edge", "small"}


def test_the_environment_sets_the_default_of_writers_given_a_base(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sd = _state()
    save(sd, tmp_path / "a")
    _step(sd)
    monkeypatch.setenv(MIN_ITEM_BYTES_ENV, str(200 << 10))
    save(sd, tmp_path / "b", base=tmp_path / "a")
    assert _delta_fqns(tmp_path / "b") == set()  # every item is under 200 KiB
    monkeypatch.delenv(MIN_ITEM_BYTES_ENV)
    save(sd, tmp_path / "c", base=tmp_path / "a")
    assert _delta_fqns(tmp_path / "c") == {"big", "edge"}


@pytest.mark.parametrize("value", ["-1", "64k", "1.5"])
def test_a_bad_environment_value_is_named(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(MIN_ITEM_BYTES_ENV, value)
    with pytest.raises(ValueError, match=MIN_ITEM_BYTES_ENV):
        nvdcp.DeltaPolicy()


def test_a_negative_threshold_is_refused() -> None:
    with pytest.raises(ValueError, match="min_item_bytes must be >= 0, got -1"):
        nvdcp.DeltaPolicy(min_item_bytes=-1)

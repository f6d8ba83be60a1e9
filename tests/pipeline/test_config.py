"""EncodeConfig: validated on construction, frozen, hashable (it keys the shared encoders)."""

from __future__ import annotations

import dataclasses

import pytest

import nvdcp
from nvdcp import cores
from nvdcp.cores import usable_cores
from nvdcp.format.header import DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES, MIN_CHUNK_BYTES
from nvdcp.pipeline.config import EncodeConfig


def test_defaults() -> None:
    cfg = EncodeConfig()
    assert cfg.codec == "auto"
    assert cfg.chunk_bytes == DEFAULT_CHUNK_BYTES
    assert cfg.codec_threads is None
    assert cfg.gpu_only is False


@pytest.mark.parametrize("codec", ["auto", "zstd", "gdeflate", "none", "ans", "bitcomp"])
def test_known_codecs_are_accepted(codec: str) -> None:
    assert EncodeConfig(codec=codec).codec == codec


@pytest.mark.parametrize("codec", ["lz4", "ZSTD", "", "Auto", None, 1])
def test_unknown_codec_is_rejected(codec: object) -> None:
    with pytest.raises(nvdcp.UnknownCodecError) as info:
        EncodeConfig(codec=codec)  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError)
    assert "known codecs" in str(info.value)


def test_unknown_codec_message_names_it() -> None:
    with pytest.raises(ValueError, match="'lz4'"):
        EncodeConfig(codec="lz4")


@pytest.mark.parametrize("chunk_bytes", [MIN_CHUNK_BYTES - 1, MAX_CHUNK_BYTES + 1, 0, -4096])
def test_chunk_bytes_out_of_range(chunk_bytes: int) -> None:
    with pytest.raises(ValueError, match="chunk_bytes") as info:
        EncodeConfig(chunk_bytes=chunk_bytes)
    assert str(chunk_bytes) in str(info.value)


def test_chunk_bytes_bounds_are_the_spec() -> None:
    assert (MIN_CHUNK_BYTES, MAX_CHUNK_BYTES) == (1024, 65536)
    with pytest.raises(ValueError, match="chunk_bytes"):
        EncodeConfig(chunk_bytes=1023)
    with pytest.raises(ValueError, match="chunk_bytes"):
        EncodeConfig(chunk_bytes=65537)


@pytest.mark.parametrize("chunk_bytes", [1024, 3000, 4096, 65536])
def test_chunk_bytes_in_range(chunk_bytes: int) -> None:
    assert EncodeConfig(chunk_bytes=chunk_bytes).chunk_bytes == chunk_bytes


@pytest.mark.parametrize("threads", [0, -1])
def test_codec_threads_below_one(threads: int) -> None:
    with pytest.raises(ValueError, match="codec_threads"):
        EncodeConfig(codec_threads=threads)


def test_threads_default_is_the_ranks_cores() -> None:
    assert EncodeConfig().threads == usable_cores()


def test_threads_default_shares_the_cores_with_local_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranks on this host's cores: each sizes its codec pool for half of them."""
    alone = usable_cores()
    if alone < 2 or cores.pinned_alone():
        pytest.skip("one core, or this process pinned to its own cores: nothing to share")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    usable_cores.cache_clear()
    try:
        assert EncodeConfig().threads <= -(-alone // 2)
    finally:
        usable_cores.cache_clear()


def test_threads_explicit() -> None:
    assert EncodeConfig(codec_threads=3).threads == 3
    assert EncodeConfig(codec_threads=1).threads == 1


def test_frozen() -> None:
    cfg = EncodeConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.codec = "zstd"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.chunk_bytes = 4096  # type: ignore[misc]


def test_hashable_and_equal_by_value() -> None:
    a = EncodeConfig(codec="zstd", chunk_bytes=4096, codec_threads=2)
    b = EncodeConfig(codec="zstd", chunk_bytes=4096, codec_threads=2)
    c = EncodeConfig(codec="zstd", chunk_bytes=8192, codec_threads=2)
    assert a == b and hash(a) == hash(b)
    assert a != c
    assert len({a, b, c}) == 2


def test_replace_validates_again() -> None:
    cfg = EncodeConfig(codec="zstd")
    with pytest.raises(ValueError, match="chunk_bytes"):
        dataclasses.replace(cfg, chunk_bytes=10)
    with pytest.raises(nvdcp.UnknownCodecError):
        dataclasses.replace(cfg, codec="nope")


@pytest.mark.parametrize(("codec", "gpu_only"), [("auto", False), ("zstd", False), ("gdeflate", False),
                                                 ("none", False), ("ans", True), ("bitcomp", True)])
def test_gpu_only(codec: str, gpu_only: bool) -> None:
    assert EncodeConfig(codec=codec).gpu_only is gpu_only

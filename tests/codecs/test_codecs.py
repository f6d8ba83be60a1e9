"""Every CPU codec round-trips chunks bit-exactly and rejects garbage with ValueError."""

from __future__ import annotations

import os

import pytest

from nvdcp.codecs import codec_id, codec_names, cpu_codec
from nvdcp.errors import CodecUnavailableError, UnknownCodecError

CPU_CODECS = ["none", "zstd", "gdeflate"]
SAMPLES = {
    "empty": b"",
    "one": b"x",
    "zeros": bytes(65536),
    "random": os.urandom(65536),
    "text": (b"nvdcp compresses checkpoints " * 3000)[:65536],
    "odd": os.urandom(12345),
}


@pytest.mark.parametrize("name", CPU_CODECS)
@pytest.mark.parametrize("sample", sorted(SAMPLES))
def test_round_trip(name: str, sample: str) -> None:
    codec = cpu_codec(name)
    data = SAMPLES[sample]
    encoded = codec.encode(data)
    out = bytearray(len(data))
    codec.decode(encoded, memoryview(out))
    assert bytes(out) == data


@pytest.mark.parametrize("name", ["zstd", "gdeflate"])
def test_compresses_redundant_data(name: str) -> None:
    assert len(cpu_codec(name).encode(SAMPLES["zeros"])) < 1024


def test_zstd_chunks_are_standard_frames() -> None:
    import zstandard

    data = SAMPLES["text"]
    assert zstandard.ZstdDecompressor().decompress(cpu_codec("zstd").encode(data)) == data


# Not gdeflate: NVIDIA's CPU decoder aborts the process on a malformed stream (an uncaught C++
# exception), so the container never hands it a chunk whose CRC32C did not match
# (tests/dcp/test_errors.py shows corrupt gdeflate chunks are caught there).
@pytest.mark.parametrize("name", ["zstd", "none"])
def test_garbage_raises_value_error(name: str) -> None:
    codec = cpu_codec(name)
    out = bytearray(65536)
    with pytest.raises(ValueError):
        codec.decode(os.urandom(1000), memoryview(out))


@pytest.mark.parametrize("name", ["zstd"])
def test_wrong_size_raises(name: str) -> None:
    codec = cpu_codec(name)
    encoded = codec.encode(SAMPLES["text"])
    out = bytearray(len(SAMPLES["text"]) - 1)
    with pytest.raises(ValueError):
        codec.decode(encoded, memoryview(out))


def test_registry() -> None:
    assert {"none", "zstd", "gdeflate", "ans", "bitcomp"} <= set(codec_names())
    assert codec_id("zstd") == 1 and codec_id("gdeflate") == 2
    with pytest.raises(UnknownCodecError, match="unknown codec 'lzma'"):
        codec_id("lzma")


@pytest.mark.parametrize("name", ["ans", "bitcomp"])
def test_gpu_only_codecs_have_no_cpu_implementation(name: str) -> None:
    with pytest.raises(CodecUnavailableError, match=name):
        cpu_codec(name)

"""Every CPU codec round-trips chunks bit-exactly and rejects garbage with ValueError."""

from __future__ import annotations

import os

import pytest

from nvdcp import codecs
from nvdcp.codecs import GPU_ONLY, Codec, codec_class, codec_id, codec_name, codec_names, cpu_codec
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


#: The stored ids are an on-disk format: this table must never change, only grow.
FROZEN_IDS = {"none": 0, "zstd": 1, "gdeflate": 2, "ans": 16, "bitcomp": 17}
NVCOMP = {"none": None, "zstd": "Zstd", "gdeflate": "GDeflate", "ans": "ANS", "bitcomp": "Bitcomp"}


def test_registry_lists_exactly_the_codecs_with_frozen_ids() -> None:
    assert codec_names() == sorted(FROZEN_IDS)
    assert {name: codec_id(name) for name in codec_names()} == FROZEN_IDS
    assert GPU_ONLY == frozenset({"ans", "bitcomp"})


@pytest.mark.parametrize("name", sorted(FROZEN_IDS))
def test_lookups_by_name_and_id_agree(name: str) -> None:
    cid = FROZEN_IDS[name]
    cls = codec_class(name)
    assert codec_class(cid) is cls
    assert issubclass(cls, Codec)
    assert cls.name == name and cls.codec_id == cid
    assert codec_name(cid) == name and codec_id(name) == cid
    assert cls.__module__ == f"nvdcp.codecs.{name}"  # one file per codec


@pytest.mark.parametrize("name", sorted(FROZEN_IDS))
def test_class_attributes_are_consistent(name: str) -> None:
    cls = codec_class(name)
    assert cls.cpu_decodable == (name not in GPU_ONLY)
    assert cls.nvcomp_algorithm == NVCOMP[name]
    assert cls.typed == (name in ("ans", "bitcomp"))
    assert cls.typed == bool(cls.nvcomp_data_types)
    assert set(cls.nvcomp_data_types) <= {"<f2", "<f4", "<f8"}
    for gone in ("version", "cpu_encodable", "encode_batch"):
        assert not hasattr(cls, gone), gone


@pytest.mark.parametrize("name", sorted(GPU_ONLY))
def test_gpu_only_codec_classes_refuse_to_run(name: str) -> None:
    codec = codec_class(name)()
    with pytest.raises(CodecUnavailableError, match=f"codec '{name}' has no CPU implementation; it needs an NVIDIA GPU with nvCOMP"):
        codec.encode(b"abc")
    with pytest.raises(CodecUnavailableError, match="NVIDIA GPU with nvCOMP"):
        codec.decode(b"abc", memoryview(bytearray(3)))
    with pytest.raises(CodecUnavailableError, match=f"codec '{name}' has no CPU implementation"):
        cpu_codec(name)


def test_cpu_codec_is_cached_instance_of_registered_class() -> None:
    for name in ("none", "zstd", "gdeflate"):
        assert cpu_codec(name) is cpu_codec(name)
        assert type(cpu_codec(name)) is codec_class(name)


def test_unknown_names_and_ids() -> None:
    known = "known codecs: auto, ans, bitcomp, gdeflate, none, zstd"
    for lookup in (codec_class, codec_id, cpu_codec):
        with pytest.raises(UnknownCodecError, match=f"unknown codec 'lzma'; {known}"):
            lookup("lzma")
    for cid in (3, 15, 18, 255, -1):
        with pytest.raises(UnknownCodecError, match=f"unknown codec id {cid}$"):
            codec_class(cid)
        with pytest.raises(UnknownCodecError, match=f"unknown codec id {cid}$"):
            codec_name(cid)
    assert issubclass(UnknownCodecError, ValueError)


def test_register_refuses_taken_names_and_ids() -> None:
    class Clash(codecs.NoneCodec):
        name = "clash"

    with pytest.raises(ValueError, match="codec id 0 is taken by 'none'"):
        codecs._register(Clash)

    class SameName(codecs.NoneCodec):
        codec_id = 200

    with pytest.raises(ValueError, match="codec name 'none' is taken"):
        codecs._register(SameName)

    class TooBig(codecs.NoneCodec):
        name = "big"
        codec_id = 256

    with pytest.raises(ValueError, match="not in 0-255"):
        codecs._register(TooBig)
    assert codec_names() == sorted(FROZEN_IDS)


def test_nvcomp_codecs_use_the_registry() -> None:
    torch = pytest.importorskip("torch")
    from nvdcp.gpu import nvcomp_codecs

    t = nvcomp_codecs.typed_data_type
    for name in ("none", "zstd", "gdeflate"):
        assert t(name, torch.bfloat16) is None
    assert [t("ans", d) for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, None)] \
        == ["<f2", "<f2", "<f4", "|u1", "|u1", "|u1"]
    assert [t("bitcomp", d) for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8)] \
        == ["<f2", "<f2", "<f4", "<f8", "|u1"]
    with pytest.raises(ValueError, match="does not run through nvCOMP"):
        nvcomp_codecs.CodecCache(65536, 0).get("none", None)

"""Codec registry: names and stored ids map to :class:`~nvdcp.codecs.base.Codec` instances.

CPU implementations live here, one file each. GPU (nvCOMP) implementations of the same ids live
in :mod:`nvdcp.gpu`; the ids and bitstreams are shared, which is what makes checkpoints portable.
"""

from __future__ import annotations

import functools

from nvdcp.codecs.base import Buffer, Codec
from nvdcp.errors import CodecUnavailableError, FormatVersionError, UnknownCodecError

#: Stored id -> (name, newest bitstream version this build reads, decodable without a GPU).
#: ANS and Bitcomp have no CPU decoder anywhere; they exist only in nvCOMP's GPU library.
CODEC_TABLE: dict[int, tuple[str, int, bool]] = {
    0: ("none", 1, True),
    1: ("zstd", 1, True),
    2: ("gdeflate", 1, True),
    16: ("ans", 1, False),
    17: ("bitcomp", 1, False),
}
_BY_NAME = {name: cid for cid, (name, _, _) in CODEC_TABLE.items()}
GPU_ONLY = frozenset(name for name, _, cpu in CODEC_TABLE.values() if not cpu)


def codec_names() -> list[str]:
    """Every codec name this build knows (some may need a GPU)."""
    return sorted(_BY_NAME)


def codec_id(name: str) -> int:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise UnknownCodecError(
            f"unknown codec {name!r}; known codecs: {', '.join(['auto', *codec_names()])}"
        ) from None


def codec_name(cid: int) -> str:
    try:
        return CODEC_TABLE[cid][0]
    except KeyError:
        raise UnknownCodecError(f"unknown codec id {cid}") from None


@functools.cache
def cpu_codec(name: str) -> Codec:
    """The CPU implementation of codec ``name``.

    Raises:
        UnknownCodecError: no codec has that name.
        CodecUnavailableError: the codec has no CPU implementation (ANS, Bitcomp) or its
            library is missing here.
    """
    codec_id(name)
    if name == "none":
        from nvdcp.codecs.none import NoneCodec

        return NoneCodec()
    if name == "zstd":
        from nvdcp.codecs.zstd import ZstdCodec

        return ZstdCodec()
    if name == "gdeflate":
        from nvdcp.codecs.gdeflate import GDeflateCodec, _library

        _library()  # fail here, with the install hint, rather than on the first chunk
        return GDeflateCodec()
    raise CodecUnavailableError(
        f"codec {name!r} has no CPU implementation; it needs an NVIDIA GPU with nvCOMP"
    )


def check_version(cid: int, version: int) -> None:
    """Refuse a bitstream version newer than this build reads."""
    name, newest, _ = CODEC_TABLE.get(cid, (None, 0, False))
    if name is None:
        raise UnknownCodecError(f"unknown codec id {cid}")
    if version > newest:
        raise FormatVersionError(
            f"codec {name!r} bitstream version {version} is newer than this nvdcp reads ({newest}); "
            "upgrade nvdcp"
        )


__all__ = ["Buffer", "Codec", "CODEC_TABLE", "GPU_ONLY", "codec_id", "codec_name", "codec_names", "cpu_codec"]

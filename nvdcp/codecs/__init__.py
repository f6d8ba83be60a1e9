"""Codec registry: names and stored ids map to :class:`~nvdcp.codecs.base.Codec` classes.

Every codec is a class in its own module here, and its class attributes are its identity (name,
stored id, CPU decodability, nvCOMP algorithm); the registry is built from those classes, as
numcodecs does. ``none``, ``zstd`` and ``gdeflate`` have CPU implementations; ``ans`` and
``bitcomp`` exist only in nvCOMP's GPU library, which :mod:`nvdcp.gpu` drives for every id. The
ids and bitstreams are shared, which is what makes checkpoints portable.
"""

from __future__ import annotations

import functools

from nvdcp.codecs.ans import AnsCodec
from nvdcp.codecs.base import Buffer, Codec
from nvdcp.codecs.bitcomp import BitcompCodec
from nvdcp.codecs.gdeflate import GDeflateCodec
from nvdcp.codecs.none import NoneCodec
from nvdcp.codecs.zstd import ZstdCodec
from nvdcp.errors import UnknownCodecError

_BY_ID: dict[int, type[Codec]] = {}
_BY_NAME: dict[str, type[Codec]] = {}


def _register(cls: type[Codec]) -> type[Codec]:
    """Add ``cls`` to the registry; its name and id must be new (ids are an on-disk format)."""
    if not (isinstance(cls, type) and issubclass(cls, Codec)):
        raise TypeError(f"{cls!r} is not a Codec subclass")
    if not isinstance(cls.codec_id, int) or not 0 <= cls.codec_id <= 255:
        raise ValueError(f"codec {cls.name!r}: id {cls.codec_id!r} is not in 0-255")
    if cls.codec_id in _BY_ID:
        raise ValueError(f"codec id {cls.codec_id} is taken by {_BY_ID[cls.codec_id].name!r}")
    if cls.name in _BY_NAME or cls.name == "auto":
        raise ValueError(f"codec name {cls.name!r} is taken")
    _BY_ID[cls.codec_id] = cls
    _BY_NAME[cls.name] = cls
    return cls


for _cls in (NoneCodec, ZstdCodec, GDeflateCodec, AnsCodec, BitcompCodec):
    _register(_cls)
del _cls

#: Names of the codecs that have no CPU decoder anywhere (nvCOMP's GPU library only).
GPU_ONLY = frozenset(name for name, cls in _BY_NAME.items() if not cls.cpu_decodable)


def codec_names() -> list[str]:
    """Every codec name this build knows (some may need a GPU)."""
    return sorted(_BY_NAME)


def codec_class(name_or_id: str | int) -> type[Codec]:
    """The codec class registered under a name or a stored id.

    Raises:
        UnknownCodecError: no codec has that name or id.
    """
    if isinstance(name_or_id, str):
        try:
            return _BY_NAME[name_or_id]
        except KeyError:
            raise UnknownCodecError(
                f"unknown codec {name_or_id!r}; known codecs: {', '.join(['auto', *codec_names()])}"
            ) from None
    try:
        return _BY_ID[name_or_id]
    except KeyError:
        raise UnknownCodecError(f"unknown codec id {name_or_id}") from None


def codec_id(name: str) -> int:
    if not isinstance(name, str):
        raise UnknownCodecError(
            f"unknown codec {name!r}; known codecs: {', '.join(['auto', *codec_names()])}"
        )
    return codec_class(name).codec_id


def codec_name(cid: int) -> str:
    if isinstance(cid, str):
        raise UnknownCodecError(f"unknown codec id {cid}")
    return codec_class(cid).name


@functools.cache
def cpu_codec(name: str) -> Codec:
    """The CPU implementation of codec ``name`` (one shared instance per name).

    Raises:
        UnknownCodecError: no codec has that name.
        CodecUnavailableError: the codec has no CPU implementation (ANS, Bitcomp) or its
            library is missing here.
    """
    cls = _BY_ID[codec_id(name)]
    cls.check_available()
    return cls()


__all__ = [
    "GPU_ONLY",
    "Buffer",
    "Codec",
    "codec_class",
    "codec_id",
    "codec_name",
    "codec_names",
    "cpu_codec",
]

"""How items are encoded: one frozen, self-validating config shared by writer, stager and converter."""

from __future__ import annotations

from dataclasses import dataclass

from nvdcp.codecs import GPU_ONLY
from nvdcp.cores import usable_cores
from nvdcp.format.header import DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES, MIN_CHUNK_BYTES
from nvdcp.pipeline.policy import validate_codec_choice


@dataclass(frozen=True)
class EncodeConfig:
    """The encoding choices of a save (the format's bounds come from :mod:`nvdcp.format.header`).

    Args:
        codec: ``"auto"`` (per-dtype choice, always decodable without a GPU) or a codec name
            (``"zstd"``, ``"gdeflate"``, ``"none"``; ``"ans"``/``"bitcomp"`` need a GPU to save
            and to load).
        chunk_bytes: uncompressed bytes per independently compressed chunk (1 KiB..64 KiB).
        codec_threads: CPU threads compressing chunks (``None``: the cores this rank may use,
            :func:`nvdcp.cores.usable_cores`).

    Raises:
        UnknownCodecError: ``codec`` names no codec (a ``ValueError``).
        ValueError: ``chunk_bytes`` or ``codec_threads`` out of range.
    """

    codec: str = "auto"
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    codec_threads: int | None = None

    def __post_init__(self) -> None:
        validate_codec_choice(self.codec)
        if not MIN_CHUNK_BYTES <= self.chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be within 1 KiB..64 KiB, got {self.chunk_bytes}")
        if self.codec_threads is not None and self.codec_threads < 1:
            raise ValueError(f"codec_threads must be >= 1, got {self.codec_threads}")

    @property
    def threads(self) -> int:
        """CPU codec threads to run (``codec_threads`` or every core)."""
        return self.codec_threads or usable_cores()

    @property
    def gpu_only(self) -> bool:
        """True when the chosen codec compresses only on a GPU (ANS, Bitcomp)."""
        return self.codec in GPU_ONLY

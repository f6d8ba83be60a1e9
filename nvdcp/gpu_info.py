"""What this machine offers for the GPU path, asked without creating any CUDA context."""

from __future__ import annotations

import functools
from importlib import metadata


@functools.cache
def nvcomp_version() -> str | None:
    """Version of the installed nvCOMP library wheel (the GPU path calls its C API), or None."""
    for dist in ("nvidia-libnvcomp-cu12", "nvidia-libnvcomp-cu13", "nvidia-nvcomp-cu12", "nvidia-nvcomp-cu13"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None

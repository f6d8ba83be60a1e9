"""What this machine offers for the GPU path, asked without creating any CUDA context."""

from __future__ import annotations

import functools
from importlib import metadata


@functools.cache
def nvcomp_version() -> str | None:
    """Version of the installed nvCOMP Python wheel, or None."""
    for dist in ("nvidia-nvcomp-cu12", "nvidia-nvcomp-cu13"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None

"""The GPU path: byte planes with torch and chunk codecs with nvCOMP, on the tensor's device.

Same container format and codec ids as the CPU path (:mod:`nvdcp.pipeline.cpu`): a chunk written
here decodes there and the reverse, for every codec that has both implementations.
Nothing in this package creates a CUDA context at import time.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def nvcomp_importable() -> bool:
    try:
        import nvidia.nvcomp  # noqa: F401
    except ImportError:
        return False
    return True


def gpu_available() -> bool:
    """True when CUDA works here and nvCOMP's Python package is installed."""
    return torch.cuda.is_available() and nvcomp_importable()

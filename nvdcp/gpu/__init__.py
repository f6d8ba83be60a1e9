"""The GPU path: byte planes with torch and chunk codecs with nvCOMP, on the tensor's device.

Same container format and codec ids as the CPU path (:mod:`nvdcp.pipeline.cpu`): a chunk written
here decodes there and the reverse, for every codec that has both implementations.
Nothing in this package creates a CUDA context at import time.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def nvcomp_loadable() -> bool:
    """Whether nvCOMP's library (``libnvcomp.so.6`` of the ``nvidia-libnvcomp-cu12`` wheel, called
    through its C API: :mod:`nvdcp.gpu.nvcomp_batch`) loads here. Loading it needs no GPU."""
    from nvdcp.errors import CodecUnavailableError
    from nvdcp.gpu.nvcomp_batch import library

    try:
        library()
    except (CodecUnavailableError, OSError):
        return False
    return True


def gpu_available() -> bool:
    """True when CUDA works here and nvCOMP's library loads."""
    return torch.cuda.is_available() and nvcomp_loadable()

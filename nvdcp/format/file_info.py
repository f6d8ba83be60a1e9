"""The JSON info block of a data file header (docs/FORMAT.md, "Data file header")."""

from __future__ import annotations

import time
from typing import Any


def file_info(rank: int, save_id: str, **extra: Any) -> dict[str, Any]:
    """Who wrote a data file and when: nvdcp, torch and nvCOMP versions, rank, save id, time;
    ``extra`` adds fields (``nvdcp convert`` records ``converted_from``)."""
    import torch

    from nvdcp import __version__
    from nvdcp.gpu_info import nvcomp_version

    return {
        "nvdcp": __version__,
        "torch": torch.__version__,
        "nvcomp": nvcomp_version(),
        "rank": rank,
        "save_id": save_id,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **extra,
    }


__all__ = ["file_info"]

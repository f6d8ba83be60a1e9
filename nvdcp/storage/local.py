"""Local (POSIX) file system backend: real files, fsync, temp-file-and-rename commits."""

from __future__ import annotations

import builtins
import errno
import os
import uuid
from collections.abc import Iterable, Sequence

from nvdcp.errors import (
    MissingDataFileError,
    NotACheckpointDirectoryError,
    StorageError,
    TruncatedCheckpointError,
)
from nvdcp.storage.base import Buffer, Storage, WriteStream, check_name


def _storage_error(exc: OSError, what: str, path: str | None = None) -> StorageError:
    """The one place OSErrors become :class:`StorageError`: errno kept, the path named."""
    reason = "disk full" if exc.errno == errno.ENOSPC else (exc.strerror or str(exc))
    err = StorageError(exc.errno, f"{what}: {reason}")
    err.filename = getattr(exc, "filename", None) or path
    return err


_IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024)


def _scatter_read(fd: int, path: str, offset: int, buffers: Sequence[memoryview]) -> None:
    """Fill ``buffers`` in order from ``offset`` with as few ``preadv`` calls as IOV_MAX allows."""
    pending = [b for b in buffers if len(b)]
    pos, i = offset, 0
    while i < len(pending):
        n = os.preadv(fd, pending[i : i + _IOV_MAX], pos)
        if n == 0:
            raise TruncatedCheckpointError(f"{path}: file ends at offset {pos}, before the item does")
        pos += n
        while i < len(pending) and n >= len(pending[i]):
            n -= len(pending[i])
            i += 1
        if n:
            pending[i] = pending[i][n:]


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _LocalWriteStream(WriteStream):
    def __init__(self, path: str, sync: bool) -> None:
        self.path = path
        self.sync = sync
        try:
            self._file = open(path, "wb", buffering=0)  # noqa: SIM115 - closed in commit/abort
        except OSError as exc:
            raise _storage_error(exc, f"cannot create {path}", path) from exc
        self._pos = 0

    def write(self, data: Buffer) -> None:
        view = memoryview(data).cast("B")
        try:
            while view:
                n = self._file.write(view)
                view = view[n:]
                self._pos += n
        except OSError as exc:
            raise _storage_error(exc, f"writing {self.path}", self.path) from exc

    def tell(self) -> int:
        return self._pos

    def writelines(self, parts: Iterable[Buffer]) -> None:
        # One writev per IOV_MAX buffers instead of a write per chunk: a checkpoint has
        # ~16k chunks per GB, and per-chunk syscalls cost more than the copies.
        views = [v for v in (memoryview(p).cast("B") for p in parts) if len(v)]
        i = 0
        try:
            while i < len(views):
                n = os.writev(self._file.fileno(), views[i : i + _IOV_MAX])
                self._pos += n
                while i < len(views) and n >= len(views[i]):
                    n -= len(views[i])
                    i += 1
                if n:
                    views[i] = views[i][n:]
        except OSError as exc:
            raise _storage_error(exc, f"writing {self.path}", self.path) from exc

    def commit(self) -> None:
        try:
            if self.sync:
                os.fsync(self._file.fileno())
            self._file.close()
        except OSError as exc:
            raise _storage_error(exc, f"committing {self.path}", self.path) from exc

    def abort(self) -> None:
        if not self._file.closed:
            self._file.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class LocalStorage(Storage):
    """A directory on a local or network file system.

    ``sync=True`` fsyncs every data file at commit and ``.metadata`` and the directory at the
    atomic write, so a committed checkpoint survives a power cut.
    """

    def __init__(self, path: str | os.PathLike[str], sync: bool = True) -> None:
        self.root = os.path.abspath(os.fspath(path))
        self.url = self.root
        self.sync = sync
        if os.path.exists(self.root) and not os.path.isdir(self.root):
            raise NotACheckpointDirectoryError(
                errno.ENOTDIR, f"{self.root} is a file, not a checkpoint directory"
            )

    def _path(self, name: str) -> str:
        path = os.path.join(self.root, check_name(name, self.url))
        # A symlink inside the root must not lead outside it.
        if os.path.islink(path):
            real = os.path.realpath(path)
            if os.path.commonpath([real, os.path.realpath(self.root)]) != os.path.realpath(self.root):
                raise MissingDataFileError(
                    errno.ENOENT, f"{path} is a symlink pointing outside the checkpoint ({real})"
                )
        return path

    def prepare(self) -> None:
        try:
            os.makedirs(self.root, exist_ok=True)
        except FileExistsError as exc:
            raise NotACheckpointDirectoryError(
                errno.ENOTDIR, f"{self.root} is a file, not a checkpoint directory"
            ) from exc
        except OSError as exc:
            raise _storage_error(exc, f"cannot create {self.root}", self.root) from exc

    def create(self, name: str) -> WriteStream:
        return _LocalWriteStream(self._path(name), self.sync)

    def write_atomic(self, name: str, data: bytes) -> None:
        final = self._path(name)
        tmp = f"{final}.{uuid.uuid4().hex[:8]}.tmp"
        stream = _LocalWriteStream(tmp, self.sync)
        try:
            stream.write(data)
            stream.commit()
            try:
                os.replace(tmp, final)
                if self.sync:
                    _fsync_dir(self.root)
            except OSError as exc:
                raise _storage_error(exc, f"committing {final}", final) from exc
        except BaseException:
            stream.abort()
            raise

    def _open_for_read(self, name: str) -> tuple[str, int]:
        path = self._path(name)
        try:
            return path, os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise MissingDataFileError(errno.ENOENT, f"{path}: data file is missing") from None
        except OSError as exc:
            raise _storage_error(exc, f"cannot open {path}", path) from exc

    def read_range(self, name: str, offset: int, length: int) -> Buffer:
        path, fd = self._open_for_read(name)
        try:
            # .metadata may be hostile: check the range against the file before allocating it.
            size = os.fstat(fd).st_size
            if offset + length > size:
                raise TruncatedCheckpointError(
                    f"{path}: wanted {length} bytes at offset {offset}, file ends after {max(0, size - offset)}"
                )
            buf = bytearray(length)
            _scatter_read(fd, path, offset, [memoryview(buf)])
            return buf
        except OSError as exc:
            raise _storage_error(exc, f"reading {path}", path) from exc
        finally:
            os.close(fd)

    def read_into(self, name: str, offset: int, buffers: Sequence[memoryview]) -> None:
        path, fd = self._open_for_read(name)
        try:
            _scatter_read(fd, path, offset, buffers)
        except OSError as exc:
            raise _storage_error(exc, f"reading {path}", path) from exc
        finally:
            os.close(fd)

    def read(self, name: str) -> bytes:
        path = self._path(name)
        try:
            with open(path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise MissingDataFileError(errno.ENOENT, f"{path} does not exist") from None
        except OSError as exc:
            raise _storage_error(exc, f"reading {path}", path) from exc

    def size(self, name: str) -> int:
        path = self._path(name)
        try:
            return os.path.getsize(path)
        except FileNotFoundError:
            raise MissingDataFileError(errno.ENOENT, f"{path}: data file is missing") from None
        except OSError as exc:
            raise _storage_error(exc, f"cannot stat {path}", path) from exc

    def exists(self, name: str) -> bool:
        return os.path.exists(self._path(name))

    def list(self) -> list[str]:
        try:
            return sorted(os.listdir(self.root))
        except FileNotFoundError:
            return []

    def list_sizes(self) -> dict[str, int]:
        """Regular files directly in the directory and their sizes (one scan; symlinks are left
        to :meth:`size`, which refuses those leading out of the root)."""
        sizes: dict[str, int] = {}
        try:
            with os.scandir(self.root) as entries:
                for entry in entries:
                    try:
                        if entry.is_file(follow_symlinks=False):
                            sizes[entry.name] = entry.stat(follow_symlinks=False).st_size
                    except FileNotFoundError:
                        continue  # deleted while we listed
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise _storage_error(exc, f"cannot list {self.root}", self.root) from exc
        return sizes

    def list_children(self) -> builtins.list[str]:
        try:
            return sorted(n for n in os.listdir(self.root) if os.path.isdir(os.path.join(self.root, n)))
        except FileNotFoundError:
            return []

    def delete(self, names: Iterable[str]) -> None:
        for name in names:
            path = self._path(name)
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise _storage_error(exc, f"cannot delete {path}", path) from exc

"""Local (POSIX) file system backend: real files, fsync, temp-file-and-rename commits."""

from __future__ import annotations

import builtins
import ctypes
import errno
import functools
import os
import threading
import uuid
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from nvdcp.cores import usable_cores
from nvdcp.errors import (
    MissingDataFileError,
    NotACheckpointDirectoryError,
    StorageError,
    TruncatedCheckpointError,
)
from nvdcp.storage.base import Buffer, OpenRoom, Storage, WriteStream, check_name, read_buffer
from nvdcp.storage.spans import ChunkSpans, Gather


def _storage_error(exc: OSError, what: str, path: str | None = None) -> StorageError:
    """The one place OSErrors become :class:`StorageError`: errno kept, the path named."""
    reason = "disk full" if exc.errno == errno.ENOSPC else (exc.strerror or str(exc))
    err = StorageError(exc.errno, f"{what}: {reason}")
    err.filename = getattr(exc, "filename", None) or path
    return err


_IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024)

#: Reads and writes of at least this many bytes are split into slices of at least
#: :data:`PARALLEL_SLICE_BYTES` issued from :data:`IO_THREADS` threads at their offsets: one
#: thread reads /dev/shm at ~4.4 GB/s and eight at ~27 (benchmarks/results/host_probe_*_h200.json);
#: the system calls release the GIL. (Writes to one file serialize on the inode lock in tmpfs,
#: ext4 and XFS buffered I/O; they still gain where the file system allows them in parallel.)
PARALLEL_MIN_BYTES = 8 << 20
PARALLEL_SLICE_BYTES = 4 << 20
IO_THREADS = max(1, min(8, usable_cores()))

_io_pool: ThreadPoolExecutor | None = None
_io_pool_lock = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    global _io_pool
    with _io_pool_lock:
        if _io_pool is None:
            _io_pool = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="nvdcp-local-io")
        return _io_pool


def _split(views: Sequence[memoryview], total: int) -> list[tuple[int, list[memoryview]]]:
    """``views`` (laid out back to back) cut into up to ``IO_THREADS`` runs of similar size;
    each run: its byte offset from the first view's start, and its (sub)views."""
    pieces = max(1, min(IO_THREADS, total // PARALLEL_SLICE_BYTES))
    step = -(-total // pieces)
    runs: list[tuple[int, list[memoryview]]] = []
    cur: list[memoryview] = []
    start = pos = 0
    room = step
    for v in views:
        while len(v):
            take = min(room, len(v))
            cur.append(v[:take])
            v = v[take:]
            pos += take
            room -= take
            if room == 0:
                runs.append((start, cur))
                cur, start, room = [], pos, step
    if cur:
        runs.append((start, cur))
    return runs


def _in_parallel(tasks: list[Callable[[], None]]) -> None:
    """Run ``tasks`` (the first on this thread, the rest on the I/O pool); raise the first error
    once every task has finished (nothing touches the buffers after this returns)."""
    futures: list[Future[None]] = [_pool().submit(t) for t in tasks[1:]]
    first: BaseException | None = None
    try:
        tasks[0]()
    except BaseException as exc:  # noqa: BLE001 - re-raised below, after the others finished
        first = exc
    for fut in futures:
        try:
            fut.result()
        except BaseException as exc:  # noqa: BLE001
            first = first or exc
    if first is not None:
        raise first


def _preadv_all(fd: int, path: str, offset: int, buffers: Sequence[memoryview]) -> None:
    pending = [b for b in buffers if len(b)]
    pos, i = offset, 0
    while i < len(pending):
        n = os.preadv(fd, pending[i : i + _IOV_MAX], pos)
        if n == 0:
            raise TruncatedCheckpointError(f"{path}: file ends at offset {pos}, before the item does")
        pos += n
        i = _consume(pending, i, n)


def _pwritev_all(fd: int, offset: int, views: Sequence[memoryview]) -> None:
    pending = [v for v in views if len(v)]
    pos, i = offset, 0
    while i < len(pending):
        n = os.pwritev(fd, pending[i : i + _IOV_MAX], pos)
        pos += n
        i = _consume(pending, i, n)


def _libc_vectored(name: str) -> Any:
    """libc's ``pwritev`` or ``preadv`` through ctypes (the GIL released during the call), or None."""
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64]
    fn.restype = ctypes.c_ssize_t
    return fn


_PWRITEV = _libc_vectored("pwritev")
_PREADV = _libc_vectored("preadv")


def _libc_sync_file_range() -> Any:
    """Linux's ``sync_file_range`` through ctypes, or None (other systems: fsync alone)."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _libc_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2  # start writeback of the range's dirty pages; do not wait for it
#: A data file written with ``sync`` starts the writeback of every this many new bytes as it
#: goes, so the disk writes while the next items compress and the fsync at commit finds less
#: left. On the CPU machine's disk, 225 MiB written in 1 MiB pieces with 1.1 ms of work between
#: them took 0.67 s, fsync included, against 0.77 s without (medians of 4, alternating; a one-off script).
WRITEBACK_BYTES = 8 << 20


def _iovecs(head: Buffer | None, spans: ChunkSpans) -> tuple[np.ndarray, list[np.ndarray]]:
    """``struct iovec`` rows (address, length) for ``head`` (if any) and every chunk of
    ``spans``, built with numpy (no object per chunk), and the arrays whose memory they point into."""
    keep: list[np.ndarray] = []
    rows = [np.zeros((0, 2), dtype=np.uint64)]
    if head is not None:
        keep.append(np.frombuffer(head, dtype=np.uint8))
        rows.append(np.array([[keep[0].ctypes.data, keep[0].size]], dtype=np.uint64))
    for buffer, starts, sizes in spans.parts():
        arr = np.frombuffer(buffer, dtype=np.uint8)
        if len(starts) and int(starts[-1] + sizes[-1]) > arr.size:
            raise ValueError(f"chunk span ends at {int(starts[-1] + sizes[-1])}, past its {arr.size}-byte buffer")
        keep.append(arr)
        iov = np.empty((len(sizes), 2), dtype=np.uint64)
        iov[:, 0] = arr.ctypes.data + starts
        iov[:, 1] = sizes
        rows.append(iov)
    iov = np.concatenate(rows)
    return np.ascontiguousarray(iov[iov[:, 1] > 0]), keep


def _gather_iovecs(gather: Gather) -> tuple[np.ndarray, list[np.ndarray]]:
    """``struct iovec`` rows for every non-empty piece of ``gather``, built with numpy, and the
    arrays whose memory they point into."""
    keep = [np.frombuffer(b, dtype=np.uint8) for b in gather.buffers]
    bases = np.fromiter((a.ctypes.data for a in keep), dtype=np.uint64, count=len(keep))
    ends = gather.starts + gather.sizes
    for i, arr in enumerate(keep):
        mine = gather.which == i
        if mine.any() and int(ends[mine].max()) > arr.size:
            raise ValueError(f"piece ends at {int(ends[mine].max())}, past its {arr.size}-byte buffer")
    nonempty = gather.sizes > 0
    iov = np.empty((int(nonempty.sum()), 2), dtype=np.uint64)
    iov[:, 0] = bases[gather.which[nonempty]] + gather.starts[nonempty].astype(np.uint64)
    iov[:, 1] = gather.sizes[nonempty]
    return iov, keep


def _pwritev_rows(fd: int, offset: int, iov: np.ndarray) -> None:
    """Write iovec rows ``iov`` (modified in place after a short write) at ``offset``."""
    assert _PWRITEV is not None
    _vectored_rows(_PWRITEV, fd, offset, iov, None)


def _preadv_rows(fd: int, path: str, offset: int, iov: np.ndarray) -> None:
    """Fill iovec rows ``iov`` (modified in place after a short read) from ``offset``."""
    assert _PREADV is not None
    _vectored_rows(_PREADV, fd, offset, iov, path)


def _vectored_rows(fn: Any, fd: int, offset: int, iov: np.ndarray, read_path: str | None) -> None:
    """``pwritev``/``preadv`` over every row of ``iov``, IOV_MAX rows a call, resuming after a
    short call inside the row where it stopped; a read that hits the end of the file raises
    :class:`TruncatedCheckpointError` naming ``read_path``."""
    ends = np.cumsum(iov[:, 1], dtype=np.int64)
    done, i, n = 0, 0, len(iov)
    while i < n:
        count = min(_IOV_MAX, n - i)
        wrote = fn(fd, iov.ctypes.data + i * iov.strides[0], count, offset + done)
        if wrote < 0:
            err = ctypes.get_errno()
            if err == errno.EINTR:
                continue
            raise OSError(err, os.strerror(err))
        if wrote == 0 and read_path is not None:
            raise TruncatedCheckpointError(f"{read_path}: file ends at offset {offset + done}, before the item does")
        done += wrote
        i = int(np.searchsorted(ends, done, side="right"))
        if i < n:  # a short write can stop inside a chunk: its rest stays pending
            left = int(ends[i]) - done
            if left < int(iov[i, 1]):
                iov[i, 0] += np.uint64(int(iov[i, 1]) - left)
                iov[i, 1] = left


def _split_rows(iov: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """iovec rows cut at chunk boundaries into up to ``IO_THREADS`` runs of similar size; each
    run: its byte offset from the first row's start, and its rows."""
    ends = np.cumsum(iov[:, 1], dtype=np.int64)
    total = int(ends[-1]) if len(ends) else 0
    pieces = max(1, min(IO_THREADS, total // PARALLEL_SLICE_BYTES))
    cuts = np.searchsorted(ends, np.arange(1, pieces) * (-(-total // pieces)), side="left") + 1
    bounds = [0, *sorted(set(int(c) for c in cuts if 0 < c < len(iov))), len(iov)]
    return [(int(ends[a - 1]) if a else 0, iov[a:b].copy()) for a, b in zip(bounds, bounds[1:])]


def _consume(pending: list[memoryview], i: int, n: int) -> int:
    """Drop ``n`` bytes that a vectored call moved from ``pending[i:]`` (a short call can stop
    inside a buffer: its rest stays pending); returns the first buffer not done."""
    while i < len(pending) and n >= len(pending[i]):
        n -= len(pending[i])
        i += 1
    if n:
        pending[i] = pending[i][n:]
    return i


def _scatter_read(fd: int, path: str, offset: int, buffers: Sequence[memoryview]) -> None:
    """Fill ``buffers`` in order from ``offset``: as few ``preadv`` calls as IOV_MAX allows, from
    several threads at once when there are at least :data:`PARALLEL_MIN_BYTES`. Spans
    (:class:`ChunkSpans`, the GPU reader's staging slots) go through iovec rows built by numpy:
    no Python object per chunk."""
    if isinstance(buffers, ChunkSpans) and _PREADV is not None:
        iov, keep = _iovecs(None, buffers)
        total = int(iov[:, 1].sum())
        if total < PARALLEL_MIN_BYTES or IO_THREADS < 2:
            _preadv_rows(fd, path, offset, iov)
        else:
            _in_parallel([functools.partial(_preadv_rows, fd, path, offset + at, rows) for at, rows in _split_rows(iov)])
        del keep  # the buffers the rows point into lived until every call returned
        return
    total = sum(len(b) for b in buffers)
    if total < PARALLEL_MIN_BYTES or IO_THREADS < 2:
        _preadv_all(fd, path, offset, buffers)
        return
    views = [b if b.format == "B" and b.ndim == 1 else b.cast("B") for b in buffers]
    _in_parallel([functools.partial(_preadv_all, fd, path, offset + at, run) for at, run in _split(views, total)])


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _LocalWriteStream(WriteStream):
    """Appends at a position it tracks itself (``pwrite``: the file offset is never used), so
    large buffers go out as slices written from several threads at their offsets, and room left
    by :meth:`skip` is filled in later (a record's header, after its chunks)."""

    fills_in = True

    def __init__(self, path: str, sync: bool) -> None:
        self.path = path
        self.sync = sync
        try:
            self._file = open(path, "wb", buffering=0)  # noqa: SIM115 - closed in commit/abort
        except OSError as exc:
            raise _storage_error(exc, f"cannot create {path}", path) from exc
        self._pos = 0
        self._written_back = 0  # bytes whose writeback was started (WRITEBACK_BYTES)
        self._room = OpenRoom(path)

    def _start_writeback(self) -> None:
        """Start the writeback of what was written since the last call, once it is
        ``WRITEBACK_BYTES`` or more (files written with ``sync`` only: they are fsync'd anyway).
        A failure here is not reported: the fsync at commit reports any write error."""
        pending = self._pos - self._written_back
        if not self.sync or _SYNC_FILE_RANGE is None or pending < WRITEBACK_BYTES:
            return
        _SYNC_FILE_RANGE(self._file.fileno(), self._written_back, pending, _SYNC_FILE_RANGE_WRITE)
        self._written_back = self._pos

    def write(self, data: Buffer) -> None:
        self.writelines([data])

    def tell(self) -> int:
        return self._pos

    def writelines(self, parts: Iterable[Buffer]) -> None:
        # One pwritev per IOV_MAX buffers instead of a write per chunk: a checkpoint has
        # ~16k chunks per GB, and per-chunk syscalls cost more than the copies. At least
        # PARALLEL_MIN_BYTES go out as slices from several threads (see _split).
        views = [v for v in (memoryview(p).cast("B") for p in parts) if len(v)]
        total = sum(len(v) for v in views)
        fd = self._file.fileno()
        try:
            if total < PARALLEL_MIN_BYTES or IO_THREADS < 2:
                _pwritev_all(fd, self._pos, views)
            else:
                pos = self._pos
                _in_parallel([functools.partial(_pwritev_all, fd, pos + at, run) for at, run in _split(views, total)])
        except OSError as exc:
            raise _storage_error(exc, f"writing {self.path}", self.path) from exc
        self._pos += total
        self._start_writeback()

    def write_gather(self, gather: Gather) -> None:
        if _PWRITEV is None:
            super().write_gather(gather)
            return
        iov, keep = _gather_iovecs(gather)
        try:
            _pwritev_rows(self._file.fileno(), self._pos, iov)
        except OSError as exc:
            raise _storage_error(exc, f"writing {self.path}", self.path) from exc
        finally:
            del keep  # the buffers the rows point into lived until the call returned
        self._pos += int(iov[:, 1].sum())
        self._start_writeback()

    def write_spans(self, head: Buffer, spans: ChunkSpans, parallel: bool = True) -> None:
        if _PWRITEV is None:
            super().write_spans(head, spans, parallel)
            return
        iov, keep = _iovecs(head, spans)
        total = int(iov[:, 1].sum())
        fd = self._file.fileno()
        try:
            if not parallel or total < PARALLEL_MIN_BYTES or IO_THREADS < 2:
                _pwritev_rows(fd, self._pos, iov)
            else:
                pos = self._pos
                _in_parallel([functools.partial(_pwritev_rows, fd, pos + at, rows) for at, rows in _split_rows(iov)])
        except OSError as exc:
            raise _storage_error(exc, f"writing {self.path}", self.path) from exc
        finally:
            del keep  # the buffers the rows point into lived until every call returned
        self._pos += total
        self._start_writeback()

    def skip(self, nbytes: int) -> int:
        at = self._pos
        self._room.leave(at, nbytes)
        self._pos += nbytes
        return at

    def write_at(self, offset: int, data: Buffer) -> None:
        view = memoryview(data).cast("B")
        self._room.fill(offset, len(view))
        try:
            _pwritev_all(self._file.fileno(), offset, [view])
        except OSError as exc:
            raise _storage_error(exc, f"writing {self.path}", self.path) from exc

    def commit(self) -> None:
        self._room.check_closed()
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
        # Data file paths checked for reading: a load reads each file many times (a run of
        # records at a time), and the symlink check was 5% of its read threads' stack samples
        # for 20,000 small items (cpu_pipeline_bench --profile small-load, CPU machine).
        self._read_paths: dict[str, str] = {}
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
        path = self._read_paths.get(name)
        if path is None:
            path = self._read_paths[name] = self._path(name)
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
            buf = read_buffer(length)
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

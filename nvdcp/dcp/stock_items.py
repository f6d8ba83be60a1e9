"""Stock DCP compatibility: the items torch's ``FileSystemWriter`` / ``FsspecWriter`` store, and
the stock constructor arguments :class:`~nvdcp.NvcompWriter` / :class:`~nvdcp.NvcompReader` accept.

A stock record (``_StorageInfo`` without an ``nvdcp.<codec>/<v>`` descriptor) holds either the
``torch.save`` of one tensor chunk or a byte item's bytes as the planner produced them, possibly
passed through torch's stream transforms (``_extensions``, e.g. ``ZStandard``), which the
record's ``transform_descriptors`` list. Used by :class:`~nvdcp.NvcompReader` (``dcp.load`` of
stock and mixed checkpoints) and by ``nvdcp convert`` (:class:`nvdcp.convert.Source`).

Stock items carry no checksum. What is checked: the record lies inside its file, the blob loads
with ``torch.load(weights_only=True)`` (no code runs) as a tensor, and its dtype and shape are the
ones ``.metadata`` records; any failure is a :class:`~nvdcp.errors.CorruptCheckpointError` naming
the file, the offset and the item.

How bytes move (benchmarks/stock_read_bench.py compares this with ``FileSystemReader``):

- a large item whose destination is known (the whole chunk, contiguous, same dtype: a load
  without resharding) goes straight into the destination tensor: ``torch.load`` with
  ``map_location="meta"`` checks the blob and says where the tensor's bytes start, and they are
  read there (``preadv`` from a local file, one copy from a fetched or decompressed record). No
  intermediate tensor, no second copy; stock reads into a new tensor and copies it;
- otherwise ``torch.load`` reads the tensor from the file (``preadv`` into the new tensor's
  memory, zip headers from two cached blocks), or from the fetched record without copying it;
- small local records (the common case of many small items) are read whole in one system call
  into a ``BytesIO``, with their data files kept open across consecutive items (:class:`OpenFiles`).
"""

from __future__ import annotations

import contextlib
import io
import os
import threading
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageReaderTransforms

from nvdcp.dcp.descriptor import PREFIX
from nvdcp.errors import CodecUnavailableError, CorruptCheckpointError, TruncatedCheckpointError
from nvdcp.pipeline.tensors import tensor_nbytes
from nvdcp.storage import Storage
from nvdcp.storage.base import Buffer
from nvdcp.storage.local import LocalStorage

_PREADV = getattr(os, "preadv", None)


def is_nvdcp_record(info: object) -> bool:
    """Whether a ``.metadata`` storage record names an nvdcp item (an ``nvdcp.`` descriptor)."""
    descs = getattr(info, "transform_descriptors", None) or ()
    return any(isinstance(d, str) and d.startswith(PREFIX) for d in descs)


#: Records up to this size are read whole, in one system call.
WHOLE_RECORD_BYTES = 64 << 10
#: Records at least this big are read straight into their destination when it allows (below,
#: parsing the archive twice costs more than the copy it saves).
DIRECT_MIN_BYTES = 1 << 20
#: ``torch.load`` reads a zip's headers with ~20 small reads near the record's start and end;
#: :class:`_RangeFile` serves them from (at most two) cached blocks of this size.
_BLOCK = 16 << 10


class _SeekableRecord(io.RawIOBase):
    """A record of ``_length`` bytes as a seekable, read-only stream: the position and seeking
    shared by :class:`_RangeFile` and :class:`_BufferFile` (each reads its own way)."""

    _length: int
    _pos: int

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        if base + pos < 0:
            raise ValueError(f"negative seek position {base + pos}")
        self._pos = base + pos
        return self._pos


class _RangeFile(_SeekableRecord):
    """Bytes ``[offset, offset + length)`` of an open file as a seekable stream of their own.

    Large reads (the tensor's bytes) use ``preadv`` straight into the caller's buffer
    (``torch.load`` hands it the new tensor's memory); small ones (zip headers, the pickle) come
    from two cached blocks, so a record costs about three system calls. No file position is
    shared: threads can read one file at once.
    """

    def __init__(self, fd: int, offset: int, length: int) -> None:
        super().__init__()
        self._fd, self._start, self._length, self._pos = fd, offset, length, 0
        self._blocks: list[tuple[int, bytes]] = []

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        pos = self._pos
        n = min(len(view), self._length - pos)
        if n <= 0:
            return 0
        if n < _BLOCK:
            for start, data in self._blocks:
                if start <= pos and pos + n <= start + len(data):
                    break
            else:
                # Anchor the block so it also covers what follows, up to the record's end.
                start = max(0, min(pos, self._length - _BLOCK))
                data = os.pread(self._fd, min(_BLOCK, self._length - start), self._start + start)
                self._blocks = [*self._blocks[-1:], (start, data)]
                if pos + n > start + len(data):  # the file is shorter than its record
                    n = max(0, start + len(data) - pos)
            view[:n] = data[pos - start : pos - start + n]
            self._pos += n
            return n
        got = 0
        while got < n:  # one preadv may return less than asked for a large read
            part = view[got:n]
            if _PREADV is not None:
                k = _PREADV(self._fd, [part], self._start + pos + got)
            else:  # pragma: no cover - platforms without preadv
                data = os.pread(self._fd, len(part), self._start + pos + got)
                k = len(data)
                part[:k] = data
            if k == 0:
                break
            got += k
        self._pos += got
        return got


class _BufferFile(_SeekableRecord):
    """A fetched record as a seekable stream, without copying it first (``io.BytesIO`` would)."""

    def __init__(self, data: Buffer) -> None:
        super().__init__()
        self._data = memoryview(data).cast("B")
        self._length, self._pos = len(self._data), 0

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        chunk = self._data[self._pos : self._pos + len(view)]
        view[: len(chunk)] = chunk
        self._pos += len(chunk)
        return len(chunk)


def _in_memory(record: Buffer) -> io.BytesIO | _BufferFile:
    """A fetched record as a stream: ``BytesIO`` (its ``readinto`` is C, and torch.load makes
    ~20 small reads) for ``bytes``, which it shares without copying, and for small records;
    large buffers of other kinds without copying them first."""
    if isinstance(record, bytes):
        return io.BytesIO(record)
    if len(record) <= WHOLE_RECORD_BYTES:
        return io.BytesIO(bytes(record))
    return _BufferFile(record)


class OpenFiles:
    """Data files of a local checkpoint, each opened once and kept open until :meth:`close`
    (or the ``with`` block ends): consecutive items of one file cost no ``open`` each."""

    def __init__(self, storage: LocalStorage) -> None:
        self.storage = storage
        self._open: dict[str, tuple[str, int, int]] = {}

    def get(self, name: str) -> tuple[str, int, int]:
        """``(path, fd, size)`` of data file ``name``."""
        found = self._open.get(name)
        if found is None:
            path, fd = self.storage._open_for_read(name)
            try:
                size = os.fstat(fd).st_size
            except BaseException:
                os.close(fd)
                raise
            found = self._open[name] = (path, fd, size)
        return found

    def close(self) -> None:
        while self._open:
            _, (_, fd, _) = self._open.popitem()
            os.close(fd)

    def __enter__(self) -> OpenFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StockItemReader:
    """Reads stock items by byte range: undoes the record's stream transforms, ``torch.load``\\ s
    tensors (``weights_only=True``, on the CPU) and checks them against ``.metadata``.

    Args:
        extension_registry: torch's ``ExtensionRegistry`` resolving the records' transform
            descriptors (``FileSystemReader``'s ``_extension_registry``); default: torch's own
            (``ZStandard``).
    """

    def __init__(self, extension_registry: Any = None) -> None:
        self.transforms = _StorageReaderTransforms(extension_registry)

    def read(
        self,
        storage: Storage,
        name: str,
        offset: int,
        length: int,
        descriptors: Sequence[str] | None,
        dtype: torch.dtype | None,
        shape: tuple[int, ...] | None,
        where: str,
        into: torch.Tensor | None = None,
        files: OpenFiles | None = None,
    ) -> torch.Tensor | Buffer:
        """One item: a CPU tensor of ``dtype`` and ``shape``, or (``dtype`` None) the byte
        item's bytes. ``where`` names the item in errors (file, offset, item).

        ``into``: where the whole item goes (its load destination). When it can (a contiguous
        CPU tensor of the item's dtype and shape, of at least :data:`DIRECT_MIN_BYTES`), the
        reader copies the tensor's bytes straight into it (from the file, or from the record
        once its transforms are undone) and returns ``into`` itself: no intermediate tensor, no
        second copy. Otherwise, or when the blob is not the simple layout it expects, it loads
        as usual.

        ``files``: local data files kept open across calls (:class:`OpenFiles`); default: the
        file is opened for this item only.
        """
        descs = tuple(descriptors or ())
        if dtype is not None and shape is not None and not descs:
            needed = tensor_nbytes(shape, dtype)
            if length < needed:
                raise CorruptCheckpointError(
                    f"{where}: record of {length} bytes cannot hold a {dtype} {list(shape)} tensor ({needed} bytes)"
                )
        stream: Any
        with contextlib.ExitStack() as stack:
            if isinstance(storage, LocalStorage):
                if files is None:
                    files = stack.enter_context(OpenFiles(storage))
                path, fd, size = files.get(name)
                if offset + length > size:
                    raise TruncatedCheckpointError(
                        f"{where}: wanted {length} bytes at offset {offset}, {path} ends after {max(0, size - offset)}"
                    )
                if dtype is not None and not descs and length > WHOLE_RECORD_BYTES:
                    # torch.load (or the direct path) reads what it needs from the file itself
                    stream = _RangeFile(fd, offset, length)
                    if into is not None and _fillable(into, dtype, shape) and _fill(stream, into, length, where):
                        return into
                    stream.seek(0)
                    return _load_tensor(stream, dtype, shape, where)
                record: Buffer = os.pread(fd, length, offset)
                if len(record) != length:
                    raise TruncatedCheckpointError(f"{where}: {path} ends {len(record)} bytes into the record")
            else:
                record = _fetch(storage, name, offset, length, where)
        if descs:
            record = self._untransformed(record, descs, where)
        if dtype is None:
            _refuse_nvdcp_record(record, where)
            return record
        stream = _in_memory(record)
        size = len(record)
        if into is not None and _fillable(into, dtype, shape) and _fill(stream, into, size, where):
            return into
        stream.seek(0)
        return _load_tensor(stream, dtype, shape, where)

    def _untransformed(self, record: Buffer, descs: tuple[str, ...], where: str) -> bytes:
        """The record with its stream transforms undone, all in memory."""
        try:
            stream = self.transforms.transform_load_stream(None, descs, _in_memory(record))  # type: ignore[arg-type]
            out = stream.read()
            return out if isinstance(out, bytes) else bytes(out)
        except ValueError as exc:
            if "no module named" in str(exc).lower():
                raise CodecUnavailableError(f"{where}: cannot undo transforms {list(descs)}: {exc}") from exc
            raise CorruptCheckpointError(f"{where}: cannot undo transforms {list(descs)}: {exc}") from exc
        except Exception as exc:  # a damaged stream raises whatever its decompressor raises
            raise CorruptCheckpointError(f"{where}: cannot undo transforms {list(descs)}: {exc}") from exc


def _refuse_nvdcp_record(record: Buffer, where: str) -> None:
    """A stock bytes item reaches the planner unchecked; one that is a whole, valid nvdcp item
    record means ``.metadata`` lost the item's nvdcp descriptor: refuse it rather than hand the
    planner compressed bytes (tensor items are refused by ``torch.load`` already)."""
    from nvdcp.format.header import ITEM_MAGIC, parse_item_header

    view = memoryview(record)
    if bytes(view[: len(ITEM_MAGIC)]) != ITEM_MAGIC:
        return
    try:
        header = parse_item_header(view, where)
    except CorruptCheckpointError:
        return  # not a record of ours after all: user bytes that happen to start alike
    if header.header_bytes + header.stored_nbytes == len(view):
        raise CorruptCheckpointError(
            f"{where}: holds an nvdcp item record, but .metadata gives it no nvdcp descriptor "
            "(a damaged or edited .metadata)"
        )


def _fetch(storage: Storage, name: str, offset: int, length: int, where: str) -> Buffer:
    try:
        return storage.read_range(name, offset, length)
    except TruncatedCheckpointError as exc:
        raise TruncatedCheckpointError(f"{where}: {exc}") from exc


def _fillable(into: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...] | None) -> bool:
    return (
        shape is not None and into.device.type == "cpu" and into.dtype == dtype and tuple(into.shape) == tuple(shape)
        and into.numel() * into.element_size() >= DIRECT_MIN_BYTES and into.is_contiguous() and not into.requires_grad
    )


def _fill(stream: io.BytesIO | _RangeFile | _BufferFile, into: torch.Tensor, length: int, where: str) -> bool:
    """Read a ``torch.save``'d tensor's bytes straight into ``into``, or return False (nothing
    written) when the blob is not one contiguous little-endian tensor whose bytes lie inside the
    record (the caller then loads it the usual way, which names what is wrong).

    ``torch.load(map_location="meta", weights_only=True)`` checks and rebuilds the tensor's
    metadata without reading its bytes and records where its storage starts in the archive
    (``_checkpoint_offset``); the archive's ``byteorder`` record must be this machine's.
    """
    import sys

    try:
        meta = torch.load(stream, map_location="meta", weights_only=True)  # type: ignore[arg-type]
        if not isinstance(meta, torch.Tensor) or meta.dtype != into.dtype or meta.shape != into.shape:
            return False
        start = getattr(meta.untyped_storage(), "_checkpoint_offset", None)
        if type(start) is not int or start < 0 or not meta.is_contiguous() or meta.storage_offset() < 0:
            return False
        stream.seek(0)
        archive_reader: Any = torch._C.PyTorchFileReader
        archive = archive_reader(stream)
        if not archive.has_record("byteorder") or archive.get_record("byteorder") != sys.byteorder.encode():
            return False
        nbytes = into.numel() * into.element_size()
        skip = int(meta.storage_offset()) * into.element_size()
        first = start + skip
        if first + nbytes > length or skip + nbytes > meta.untyped_storage().nbytes():
            return False
        dest = memoryview(into.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
    except Exception:  # a damaged blob, an older torch without _checkpoint_offset...
        return False
    if nbytes:
        stream.seek(first)
        got = 0
        while got < nbytes:
            k = stream.readinto(dest[got:])
            if not k:
                raise TruncatedCheckpointError(f"{where}: the tensor's bytes end after {got} of {nbytes}")
            got += k
    return True


def _load_tensor(stream: Any, dtype: torch.dtype, shape: tuple[int, ...] | None, where: str) -> torch.Tensor:
    try:
        tensor = torch.load(stream, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch.load raises many types on bad input
        raise CorruptCheckpointError(f"{where}: not a torch.save'd tensor: {exc}") from exc
    if not isinstance(tensor, torch.Tensor):
        raise CorruptCheckpointError(f"{where}: holds {type(tensor).__name__}, .metadata says a {dtype} tensor")
    if tensor.dtype != dtype or (shape is not None and tuple(tensor.shape) != tuple(shape)):
        want = f"{dtype} {list(shape)}" if shape is not None else str(dtype)
        raise CorruptCheckpointError(
            f"{where}: holds a {tensor.dtype} {list(tensor.shape)} tensor, .metadata says {want}"
        )
    return tensor


# -- stock constructor arguments -----------------------------------------------------------------
_warned: set[str] = set()
_warned_lock = threading.Lock()


def warn_once(key: str, message: str) -> None:
    """``warnings.warn(message)`` the first time ``key`` comes up in this process."""
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(message, UserWarning, stacklevel=4)


def merge_fsspec_kwargs(
    owner: str, path: str, storage_options: dict[str, Any] | None, fsspec_kwargs: dict[str, Any]
) -> dict[str, Any]:
    """``storage_options`` plus the ``**kwargs`` that ``FsspecWriter``/``FsspecReader`` pass to
    fsspec. They are fsspec options, so an ``s3://`` URL given some goes through s3fs
    (``backend="fsspec"``) unless a ``backend`` is named. nvdcp serves local paths itself, not
    through fsspec: there they are ignored, with a warning."""
    options = dict(storage_options or {})
    if not fsspec_kwargs:
        return options
    if "://" not in path or path.startswith("file://"):
        warn_once(
            f"{owner}.local_kwargs",
            f"{owner}: fsspec options {sorted(fsspec_kwargs)} are ignored for the local path {path!r} "
            "(nvdcp reads and writes local files itself, not through fsspec)",
        )
        return options
    both = sorted(set(options) & set(fsspec_kwargs))
    if both:
        raise TypeError(f"{owner}: {both} given both in storage_options and as keyword arguments")
    options.update(fsspec_kwargs)
    if path.startswith("s3://"):
        # They are s3fs options, as FsspecWriter would pass them: serve s3:// through fsspec
        # too, unless the caller picked a backend.
        options.setdefault("backend", "fsspec")
    return options


__all__ = ["OpenFiles", "StockItemReader", "is_nvdcp_record", "merge_fsspec_kwargs", "warn_once"]

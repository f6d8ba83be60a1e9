"""One conformance suite for every storage backend (nvdcp/storage/base.py's contract).

Backends: local directory, native boto3 S3 on a moto server and on a SeaweedFS server, fsspec
``memory://``, and fsspec ``s3://`` through s3fs on the moto server. Every test runs against each.
SeaweedFS enforces S3's 5 MiB minimum part, so its streams are written with 5 MiB parts and
a larger payload (still several parts).
"""

from __future__ import annotations

import dataclasses
import functools
import pickle
import uuid
from collections.abc import Callable

import numpy as np
import pytest

from nvdcp.errors import CorruptCheckpointError, MissingDataFileError, TruncatedCheckpointError
from nvdcp.storage import Storage, open_storage
from tests.s3.s3_testkit import TEST_MIN_PART, S3Env, moto_min_part_size

DATA = np.random.default_rng(0).bytes(5 * TEST_MIN_PART + 1234)  # several parts of the S3 stream


@functools.cache
def _payload(part: int) -> bytes:
    """Several parts of a stream whose parts are ``part`` bytes."""
    return DATA if part == TEST_MIN_PART else np.random.default_rng(1).bytes(2 * part + 1234)


@dataclasses.dataclass
class Backend:
    name: str
    make: Callable[[], Storage]
    atomic_streams: bool  # a stream's object is invisible until commit
    part: int = TEST_MIN_PART  # multipart part size (S3 streams); writes straddle it

    @property
    def data(self) -> bytes:
        return _payload(self.part)


def _local(request: pytest.FixtureRequest) -> Backend:
    root = request.getfixturevalue("tmp_path") / "ckpt"
    return Backend("local", lambda: open_storage(root, sync=False), atomic_streams=False)


def _boto3(request: pytest.FixtureRequest) -> Backend:
    env: S3Env = request.getfixturevalue("s3env")
    if moto_min_part_size() > TEST_MIN_PART:
        pytest.skip("moto was imported before S3_UPLOAD_PART_MIN_SIZE was set")
    opts = dict(
        part_size=TEST_MIN_PART, min_part_size=TEST_MIN_PART, part_growth_every=2, max_inflight_parts=2,
        max_concurrency=4, read_part_size=64 * 1024, coalesce_gap=4096, retry_backoff_s=0.01,
    )
    return Backend("s3-boto3", lambda: open_storage(env.url("conf/ckpt"), **opts), atomic_streams=True)


def _seaweedfs(request: pytest.FixtureRequest) -> Backend:
    env: S3Env = request.getfixturevalue("seaweed_env")
    part = env.min_part
    opts = dict(
        part_size=part, min_part_size=part, part_growth_every=2, max_inflight_parts=2, max_concurrency=4,
        read_part_size=1 << 20, coalesce_gap=4096, retry_backoff_s=0.01,
    )
    return Backend("s3-seaweedfs", lambda: open_storage(env.url("conf/ckpt"), **opts), atomic_streams=True, part=part)


def _memory(request: pytest.FixtureRequest) -> Backend:
    url = f"memory://nvdcp-conformance/{uuid.uuid4().hex}"
    return Backend("fsspec-memory", lambda: open_storage(url), atomic_streams=False)


def _s3fs(request: pytest.FixtureRequest) -> Backend:
    pytest.importorskip("s3fs")
    env: S3Env = request.getfixturevalue("s3env")
    opts = {"backend": "fsspec", "endpoint_url": env.endpoint, "coalesce_gap": 4096}
    return Backend("fsspec-s3fs", lambda: open_storage(env.url("conf/ckpt"), **opts), atomic_streams=True)


@pytest.fixture(
    params=[
        pytest.param(_local, id="local"),
        pytest.param(_boto3, id="s3-boto3", marks=pytest.mark.s3),
        pytest.param(_seaweedfs, id="s3-seaweedfs", marks=pytest.mark.s3),
        pytest.param(_memory, id="fsspec-memory"),
        pytest.param(_s3fs, id="fsspec-s3fs", marks=pytest.mark.s3),
    ]
)
def backend(request: pytest.FixtureRequest) -> Backend:
    return request.param(request)


@pytest.fixture
def store(backend: Backend) -> Storage:
    s = backend.make()
    s.prepare()
    return s


@pytest.fixture
def data(backend: Backend) -> bytes:
    return backend.data


def _write(store: Storage, name: str, data: bytes, pieces: tuple[int, ...] = (1, 1000, TEST_MIN_PART + 7)) -> None:
    stream = store.create(name)
    pos = 0
    for n in pieces:
        stream.write(memoryview(data)[pos : pos + n])
        pos += min(n, len(data) - pos)
        assert stream.tell() == pos
    stream.write(data[pos:])
    assert stream.tell() == len(data)
    stream.commit()


def _straddling(backend: Backend) -> tuple[int, ...]:
    """Small writes, then one that straddles the first part boundary."""
    return (1, 1000, backend.part + 7)


def test_stream_roundtrip(backend: Backend, store: Storage, data: bytes) -> None:
    _write(store, "data_0.nvdcp", data, _straddling(backend))
    assert bytes(store.read("data_0.nvdcp")) == data
    assert store.size("data_0.nvdcp") == len(data)
    assert store.exists("data_0.nvdcp")
    assert store.list() == ["data_0.nvdcp"]


@pytest.mark.parametrize("size", [0, 1, 100, "one part"])
def test_small_objects_roundtrip(backend: Backend, store: Storage, data: bytes, size: int | str) -> None:
    n = backend.part if size == "one part" else int(size)
    _write(store, "small", data[:n], pieces=())
    assert bytes(store.read("small")) == data[:n]
    assert store.size("small") == n


def test_read_range_and_ranges(backend: Backend, store: Storage, data: bytes) -> None:
    _write(store, "f", data, _straddling(backend))
    n = len(data)
    assert bytes(store.read_range("f", 0, n)) == data
    assert bytes(store.read_range("f", 17, 4000)) == data[17:4017]
    ranges = [(n - 10, 10), (5, 100), (105, 50), (90, 40), (n // 2, n // 3), (7, 0), (0, 1)]
    got = store.read_ranges("f", ranges)
    assert [bytes(b) for b in got] == [data[o : o + k] for o, k in ranges]


def test_truncated_reads_raise(store: Storage) -> None:
    _write(store, "f", DATA[:5000], pieces=())
    with pytest.raises(TruncatedCheckpointError):
        store.read_range("f", 4000, 2000)  # runs past the end
    with pytest.raises(TruncatedCheckpointError):
        store.read_range("f", 10_000, 10)  # starts past the end
    with pytest.raises(TruncatedCheckpointError):
        store.read_ranges("f", [(0, 10), (4990, 11)])


def test_missing_object_raises(store: Storage) -> None:
    for op in (lambda: store.read("nope"), lambda: store.read_range("nope", 0, 10), lambda: store.size("nope")):
        with pytest.raises(MissingDataFileError) as info:
            op()
        assert isinstance(info.value, FileNotFoundError)
        assert "nope" in str(info.value) and store.url.rstrip("/").split("://")[-1] in str(info.value)
    assert not store.exists("nope")


def test_write_atomic_replaces(store: Storage) -> None:
    store.write_atomic(".metadata", b"old")
    store.write_atomic(".metadata", b"new contents")
    assert bytes(store.read(".metadata")) == b"new contents"
    assert store.list() == [".metadata"]  # no temporary leftovers


def test_abort_discards(store: Storage, data: bytes) -> None:
    stream = store.create("aborted")
    stream.write(data)
    stream.abort()
    stream.abort()  # safe twice
    assert not store.exists("aborted")
    assert "aborted" not in store.list()


def test_write_after_commit_raises(store: Storage) -> None:
    stream = store.create("done")
    stream.write(b"abc")
    stream.commit()
    with pytest.raises(ValueError):
        stream.write(b"more")
    assert bytes(store.read("done")) == b"abc"


def test_stream_invisible_until_commit(backend: Backend, store: Storage, data: bytes) -> None:
    if not backend.atomic_streams:
        pytest.skip(f"{backend.name} writes in place (the writer never reuses a data file name)")
    stream = store.create("pending")
    stream.write(data)
    assert not store.exists("pending") and "pending" not in store.list()
    stream.commit()
    assert store.exists("pending")


def test_list_and_delete(store: Storage) -> None:
    assert store.list() == []
    for name in ("b", "a", "c.nvdcp"):
        store.write_atomic(name, name.encode())
    assert store.list() == ["a", "b", "c.nvdcp"]
    store.delete(["a", "c.nvdcp", "never-existed"])
    assert store.list() == ["b"]
    store.delete([])
    store.delete(["b"])
    assert store.list() == []  # SeaweedFS keeps the emptied directory: it must not list as an object


@pytest.mark.parametrize("name", ["../escape", "a/b", "", "..", "/abs"])
def test_refuses_unsafe_names(store: Storage, name: str) -> None:
    with pytest.raises(CorruptCheckpointError):
        store.create(name)
    with pytest.raises(CorruptCheckpointError):
        store.read(name)


def test_second_instance_and_pickle_see_the_same_objects(backend: Backend, store: Storage) -> None:
    store.write_atomic("x", b"payload")
    other = backend.make()
    assert other.exists("x") and bytes(other.read("x")) == b"payload"
    clone = pickle.loads(pickle.dumps(store))
    assert clone.url == store.url and bytes(clone.read_range("x", 3, 4)) == b"load"
    clone.prepare()  # idempotent


def test_replaced_object_reads_new_bytes(store: Storage) -> None:
    _write(store, "f", DATA[:3000], pieces=())
    assert bytes(store.read_range("f", 100, 50)) == DATA[100:150]
    _write(store, "f", DATA[5000:8000], pieces=())
    assert bytes(store.read_range("f", 100, 50)) == DATA[5100:5150]
    store.write_atomic("f", b"z" * 200)
    assert bytes(store.read_range("f", 100, 50)) == b"z" * 50


@pytest.mark.parametrize("where", ["first part", "straddling a part boundary", "whole object in one part"])
def test_room_left_is_filled_in_later(backend: Backend, store: Storage, data: bytes, where: str) -> None:
    """A streamed record's header is written after its chunks, into room left for it: the
    object holds the bytes in place, wherever the room falls (an upload keeps back the parts
    under unfilled room and sends them once it is filled)."""
    stream = store.create("filled")
    if not stream.fills_in:
        stream.abort()
        pytest.skip(f"{backend.name} writes its bytes in order only")
    size = 100 if where == "whole object in one part" else len(data)
    body = data[:size]
    lo = {"first part": 10, "straddling a part boundary": backend.part - 50, "whole object in one part": 3}[where]
    hi = lo + (100 if where != "whole object in one part" else 20)
    stream.write(body[:lo])
    assert stream.skip(hi - lo) == lo
    stream.write(body[hi:])
    with pytest.raises(ValueError, match="filled in|room"):
        stream.commit()  # room still open
    stream.write_at(lo + 5, body[lo + 5 : hi])  # the room in two pieces, out of order
    stream.write_at(lo, body[lo : lo + 5])
    with pytest.raises(ValueError):
        stream.write_at(0, body[:4])  # bytes already written, not room
    stream.commit()
    assert bytes(store.read("filled")) == body


def test_a_failed_upload_with_room_open_leaves_nothing(backend: Backend, store: Storage, data: bytes) -> None:
    """Aborting while a part is kept back for its room leaves no object."""
    stream = store.create("open-room")
    if not stream.fills_in:
        stream.abort()
        pytest.skip(f"{backend.name} writes its bytes in order only")
    stream.write(data[:10])
    stream.skip(100)
    stream.write(data[110:])
    stream.abort()
    assert not store.exists("open-room")

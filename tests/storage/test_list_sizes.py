"""``Storage.list_sizes``: one listing with sizes, on every backend of the conformance suite."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nvdcp.storage import Storage, open_storage
from tests.storage.test_conformance import Backend, backend, store  # noqa: F401  (fixtures)


def test_list_sizes_matches_size_of_every_object(store: Storage) -> None:
    for name, n in (("empty", 0), ("one", 1), ("__0_ab_0.nvdcp", 1000), (".metadata", 17)):
        store.write_atomic(name, b"x" * n)
    sizes = store.list_sizes()
    assert sizes == {"empty": 0, "one": 1, "__0_ab_0.nvdcp": 1000, ".metadata": 17}
    assert all(store.size(name) == n for name, n in sizes.items())
    store.delete(["one"])
    assert store.list_sizes() == {"empty": 0, "__0_ab_0.nvdcp": 1000, ".metadata": 17}
    store.delete(["empty", "__0_ab_0.nvdcp", ".metadata"])
    assert store.list_sizes() == {}  # SeaweedFS's emptied directory is no object either


def test_list_sizes_sees_a_replaced_object(store: Storage) -> None:
    store.write_atomic("a", b"12345")
    assert store.list_sizes() == {"a": 5}
    store.write_atomic("a", b"12")
    assert store.list_sizes() == {"a": 2}


def test_list_sizes_of_a_missing_root_is_empty(backend: Backend) -> None:  # noqa: F811
    assert backend.make().list_sizes() == {}


def test_local_listing_leaves_out_directories_and_symlinks(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "data").write_bytes(b"abc")
    (root / "sub").mkdir()
    (tmp_path / "outside").write_bytes(b"secret!")
    os.symlink(tmp_path / "outside", root / "link")
    assert open_storage(root, sync=False).list_sizes() == {"data": 3}


def test_default_is_no_listing() -> None:
    """A backend without a listing says so (callers then ask ``size`` per object)."""
    minimal = type("Minimal", (Storage,), {m: lambda *a, **k: None for m in Storage.__abstractmethods__})
    assert minimal().list_sizes() is None


@pytest.mark.parametrize("url", ["memory://nvdcp-list-sizes"])
def test_fsspec_listing_ignores_sub_directories(url: str) -> None:
    s = open_storage(url)
    s.prepare()
    s.write_atomic("a", b"1234")
    s.fs.pipe_file(f"{s.root}/sub/b", b"12")  # type: ignore[attr-defined]
    assert s.list_sizes() == {"a": 4}

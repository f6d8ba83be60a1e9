"""The commit check (``SaveGuard.check_data_files``) through one listing: still exact.

Many data files are checked from one ``list_sizes`` listing; a file the listing lacks or sizes
differently is asked again with ``size`` before the save fails, so every missing, short or long
file is still caught and named, and a listing that lags a write never fails a save.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.checkpoint.filesystem import _StorageInfo

import nvdcp
from nvdcp.dcp.save_guard import SaveGuard
from nvdcp.storage import open_storage
from nvdcp.storage.local import LocalStorage

FILES = 12
ITEMS_PER_FILE = 5
ITEM = 100


class CountingStorage(LocalStorage):
    """Local storage counting listings and size requests; ``listing`` replaces what it lists."""

    def __init__(self, root: Path, listing: Any = "real") -> None:
        super().__init__(root, sync=False)
        self.listing = listing
        self.size_calls: list[str] = []
        self.list_calls = 0

    def size(self, name: str) -> int:
        self.size_calls.append(name)
        return super().size(name)

    def list_sizes(self) -> dict[str, int] | None:
        self.list_calls += 1
        if self.listing == "real":
            return super().list_sizes()
        if isinstance(self.listing, Exception):
            raise self.listing
        return self.listing


def names() -> list[str]:
    return [f"__{r}_0123456789ab_0.nvdcp" for r in range(FILES)]


def records() -> dict[tuple[str, int], _StorageInfo]:
    """ITEMS_PER_FILE records per file, not in file order (the check takes each file's end)."""
    out = {}
    for name in names():
        for k in reversed(range(ITEMS_PER_FILE)):
            out[(name, k)] = _StorageInfo(name, 64 + k * ITEM, ITEM, ("nvdcp.zstd/1",))
    return out


END = 64 + ITEMS_PER_FILE * ITEM


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "ckpt"
    root.mkdir()
    for name in names():
        (root / name).write_bytes(b"x" * END)
    (root / "__9_ffffffffffff_0.nvdcp").write_bytes(b"old save")  # not referenced: not checked
    return root


def test_whole_files_pass_with_one_listing_and_no_size_requests(root: Path) -> None:
    storage = CountingStorage(root)
    SaveGuard(storage).check_data_files(records())
    assert storage.list_calls == 1 and storage.size_calls == []


@pytest.mark.parametrize(
    ("damage", "error"),
    [("delete", nvdcp.MissingDataFileError), ("truncate", nvdcp.TruncatedCheckpointError),
     ("extend", nvdcp.CorruptCheckpointError)],
)
def test_a_damaged_file_among_many_is_caught_and_named(root: Path, damage: str, error: type) -> None:
    victim = root / names()[7]
    if damage == "delete":
        victim.unlink()
    elif damage == "truncate":
        os.truncate(victim, END - 1)
    else:
        with open(victim, "ab") as f:
            f.write(b"x")
    storage = CountingStorage(root)
    with pytest.raises(error, match=".metadata not written") as info:
        SaveGuard(storage).check_data_files(records())
    assert victim.name in str(info.value)
    assert storage.size_calls == [victim.name]  # only the file the listing disagreed on


def test_a_listing_that_lags_costs_requests_not_the_save(root: Path) -> None:
    stale = {n: END for n in names()[:5]} | {names()[5]: END - 3}  # six files late or stale
    storage = CountingStorage(root, listing=stale)
    SaveGuard(storage).check_data_files(records())
    assert sorted(storage.size_calls) == sorted(names()[5:])


@pytest.mark.parametrize("listing", [None, OSError(13, "listing denied")], ids=["no-listing", "listing-fails"])
def test_without_a_listing_every_file_is_asked(root: Path, listing: Any) -> None:
    storage = CountingStorage(root, listing=listing)
    SaveGuard(storage).check_data_files(records())
    assert sorted(storage.size_calls) == sorted(names())
    (root / names()[3]).unlink()
    with pytest.raises(nvdcp.MissingDataFileError, match=names()[3]):
        SaveGuard(storage).check_data_files(records())


def test_one_file_is_asked_directly(root: Path) -> None:
    storage = CountingStorage(root)
    one = {k: v for k, v in records().items() if v.relative_path == names()[0]}
    SaveGuard(storage).check_data_files(one)
    assert storage.list_calls == 0 and storage.size_calls == [names()[0]]


def test_symlinks_are_left_to_size(root: Path, tmp_path: Path) -> None:
    """The listing leaves symlinks out; ``size`` follows one inside the root, refuses one leading out."""
    inside = root / names()[2]
    os.rename(inside, root / "real.bin")
    os.symlink(root / "real.bin", inside)
    storage = CountingStorage(root)
    SaveGuard(storage).check_data_files(records())
    assert storage.size_calls == [inside.name]
    os.unlink(inside)
    (tmp_path / "outside").write_bytes(b"x" * END)
    os.symlink(tmp_path / "outside", inside)
    with pytest.raises(nvdcp.MissingDataFileError, match="is gone"):  # as a missing file
        SaveGuard(storage).check_data_files(records())


def test_fsspec_memory_listing_catches_a_short_file() -> None:
    storage = open_storage("memory://nvdcp-commit-check")
    storage.prepare()
    for name in names():
        storage.write_atomic(name, b"x" * END)
    SaveGuard(storage).check_data_files(records())
    storage.write_atomic(names()[-1], b"x" * (END - 1))
    with pytest.raises(nvdcp.TruncatedCheckpointError, match=names()[-1]):
        SaveGuard(storage).check_data_files(records())
    storage.delete(storage.list())


def test_a_multi_file_save_commits_through_the_listing(tmp_path: Path) -> None:
    """A real save with four data files per rank goes through the listing and loads back."""
    import torch
    import torch.distributed.checkpoint as dcp

    state = {f"w{i}": torch.full((64,), float(i)) for i in range(8)}
    dcp.save(state, storage_writer=nvdcp.NvcompWriter(tmp_path / "c", thread_count=4))
    assert len(list((tmp_path / "c").glob("*.nvdcp"))) == 4
    back = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(back, storage_reader=nvdcp.NvcompReader(tmp_path / "c"))
    assert all(torch.equal(back[k], state[k]) for k in state)


def test_records_of_a_file_need_not_be_together(root: Path) -> None:
    """Each file's end is the furthest of its records wherever they sit (here: files interleaved)."""
    interleaved = dict(sorted(records().items(), key=lambda kv: (kv[0][1], kv[0][0])))
    storage = CountingStorage(root)
    SaveGuard(storage).check_data_files(interleaved)
    assert storage.size_calls == []
    os.truncate(root / names()[4], END - ITEM)  # its last item gone: only that record reaches further
    with pytest.raises(nvdcp.TruncatedCheckpointError, match=names()[4]):
        SaveGuard(storage).check_data_files(interleaved)


def test_metadata_pickles_to_the_same_bytes_as_pickle_dumps() -> None:
    """``dump_metadata`` skips ``_StorageInfo.__getstate__``'s dict copy: the bytes stay pickle's,
    records with a None field (left out by torch) included, at every protocol."""
    import pickle

    import torch
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    from nvdcp.dcp.commit import dump_metadata

    chunks = [ChunkStorageMetadata(torch.Size([2 * r, 0]), torch.Size([2, 3])) for r in range(4)]
    sdm: dict[str, object] = {
        "w": TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([8, 3]), chunks),
        "b": BytesStorageMetadata(),
    }
    records: dict[MetadataIndex, _StorageInfo] = {
        MetadataIndex("w", c.offsets, i): _StorageInfo(f"__{i}_ab_0.nvdcp", 64, 24, ("nvdcp.zstd/1",))
        for i, c in enumerate(chunks)
    }
    records[MetadataIndex("b")] = _StorageInfo("__0_ab_0.distcp", 88, 5)  # no descriptors: None left out
    metadata = Metadata(sdm, storage_data=records)  # type: ignore[arg-type]
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        assert dump_metadata(metadata, protocol) == pickle.dumps(metadata, protocol), protocol
    assert pickle.loads(dump_metadata(metadata, pickle.HIGHEST_PROTOCOL)).storage_data == records


def test_equal_sizes_names_and_descriptors_are_pickled_once(tmp_path: Path) -> None:
    """``share_equal_values`` before pickling: the loaded ``.metadata`` compares equal to DCP's,
    is smaller, and holds each equal size, file name and descriptor tuple once; no
    ``TensorProperties`` is shared (a planner may change one item's)."""
    import pickle

    import torch
    import torch.distributed.checkpoint as dcp

    import nvdcp
    from nvdcp.dcp.commit import share_equal_values
    from nvdcp.dcp.metadata_io import load_metadata
    from nvdcp.storage import open_storage

    state = {f"layer{i}.w": torch.full((8, 4), float(i)) for i in range(50)}
    state["bias"] = torch.ones(3)
    dcp.save(state, storage_writer=nvdcp.NvcompWriter(tmp_path))
    loaded = load_metadata(open_storage(str(tmp_path)))
    offsets = {id(ix.offset) for ix in loaded.storage_data if ix.fqn != "bias"}
    assert len(offsets) == 1  # every weight's offset is (0, 0): equal values, one object
    chunk_sizes = {id(md.chunks[0].sizes) for fqn, md in loaded.state_dict_metadata.items() if fqn != "bias"}
    assert len(chunk_sizes) == 1
    assert len({id(info.relative_path) for info in loaded.storage_data.values()}) == 1
    assert len({id(info.transform_descriptors) for info in loaded.storage_data.values()}) == 1
    properties = [md.properties for md in loaded.state_dict_metadata.values()]
    assert len({id(p) for p in properties}) == len(properties)

    # The same Metadata without sharing: equal when loaded, and a larger pickle.
    unshared = pickle.loads(pickle.dumps(loaded))
    for md in unshared.state_dict_metadata.values():
        md.size = torch.Size(list(md.size))
        for chunk in md.chunks:
            chunk.offsets, chunk.sizes = torch.Size(list(chunk.offsets)), torch.Size(list(chunk.sizes))
    plain = pickle.dumps(unshared, pickle.HIGHEST_PROTOCOL)
    share_equal_values(unshared)
    shared = pickle.dumps(unshared, pickle.HIGHEST_PROTOCOL)
    assert len(shared) < len(plain)
    again = pickle.loads(shared)
    assert again.state_dict_metadata == loaded.state_dict_metadata
    assert again.storage_data == loaded.storage_data
    assert {ix: hash(ix) for ix in again.storage_data} == {ix: hash(ix) for ix in loaded.storage_data}
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(dest, storage_reader=nvdcp.NvcompReader(tmp_path))
    assert all(torch.equal(dest[k], v) for k, v in state.items())

"""Delta checkpoints (docs/FORMAT.md, "Delta checkpoints"), single process on the CPU: chains round
trip bit-exactly, the policy schedule, explicit bases, resuming, the host cache, items that change
shape or do not pay, errors that name the broken base, and saves that fail half-way."""

from __future__ import annotations

import dataclasses
import errno
import gc
import os
import pickle
import shutil
import struct
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

import nvdcp
from nvdcp.dcp import delta as delta_module
from nvdcp.dcp import descriptor
from nvdcp.dcp.delta import DeltaSave
from nvdcp.format.delta import DELTA_ATTR
from nvdcp.format.digest import DIGEST_ATTR
from nvdcp.format.header import checksum, parse_item_header
from nvdcp.pipeline.config import EncodeConfig
from nvdcp.pipeline.encoder import ItemEncoder
from nvdcp.testing import faults as F
from tests.conftest import bit_equal, random_tensor, weights_like
from tests.dcp.helpers import empty_like_sd, failure_of, item_span, load, save

pytestmark = pytest.mark.timeout(120)

SENTINEL = 7


# -- state --------------------------------------------------------------------------------------
def _state() -> dict[str, Any]:
    return {
        "w": weights_like((256, 300), seed=1),
        "b16": weights_like((64, 100), torch.bfloat16, seed=2),
        "ids": torch.arange(5000, dtype=torch.int64),
        "empty": torch.empty(0, 3),
        "obj": {"step": 0, "note": "a BYTE_IO item"},
    }


def _train(sd: dict[str, Any], step: int) -> None:
    """One step of 'training': small updates, as between two checkpoints of a real job."""
    g = torch.Generator().manual_seed(100 + step)
    sd["w"].add_(torch.randn(sd["w"].shape, generator=g) * 1e-4)
    sd["b16"].add_((torch.randn(sd["b16"].shape, generator=g) * 1e-3).bfloat16())
    sd["ids"][step * 7 : step * 7 + 5] += 1
    sd["obj"] = {"step": step, "note": "a BYTE_IO item"}


def _snapshot(sd: dict[str, Any]) -> dict[str, Any]:
    return {k: v.clone() if isinstance(v, torch.Tensor) else dict(v) if isinstance(v, dict) else v for k, v in sd.items()}


def _sentinel_like(sd: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            out[k] = torch.full(v.shape, SENTINEL, dtype=v.dtype) if v.dtype != torch.bool else torch.ones(v.shape, dtype=torch.bool)
        elif isinstance(v, dict):
            out[k] = _sentinel_like(v)  # DCP flattens nested dicts: one item per leaf
        else:
            out[k] = "untouched"
    return out


def _assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert set(got) == set(want)
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert bit_equal(got[k], v), k
        else:
            assert got[k] == v, k


def _load_check(path: Path, want: dict[str, Any], **kw: Any) -> None:
    out = empty_like_sd(want)
    load(out, path, **kw)
    _assert_same(out, want)


def _metadata(path: Path) -> Any:
    return nvdcp.NvcompReader(path).read_metadata()


def _record(path: Path) -> dict[str, Any] | None:
    return getattr(_metadata(path), DELTA_ATTR, None)


def _depth(path: Path) -> int:
    rec = _record(path)
    return 0 if rec is None else rec["depth"]


def _delta_fqns(path: Path) -> set[str]:
    return {ix.fqn for ix, info in _metadata(path).storage_data.items() if descriptor.is_delta(info)}


def _save_error(sd: dict[str, Any], path: Path, **kw: Any) -> BaseException:
    with pytest.raises((CheckpointException, nvdcp.NvdcpError, ValueError)) as info:
        save(sd, path, **kw)
    return failure_of(info.value)


def _load_error(path: Path, target: dict[str, Any]) -> BaseException:
    with pytest.raises((CheckpointException, nvdcp.NvdcpError)) as info:
        load(target, path)
    return failure_of(info.value)


def _chain(root: Path, n: int, policy: nvdcp.DeltaPolicy, sd: dict[str, Any] | None = None,
           **kw: Any) -> tuple[list[Path], list[dict[str, Any]], dict[str, Any]]:
    """``n`` saves with ``policy`` to root/s0..; the paths, what each holds, and the live state."""
    sd = sd if sd is not None else _state()
    paths, wants = [], []
    for step in range(n):
        if step:
            _train(sd, step)
        path = root / f"s{step}"
        save(sd, path, delta=policy, **kw)
        paths.append(path)
        wants.append(_snapshot(sd))
    return paths, wants, sd


class _CountReads:
    """Counts items whose base was read back from storage (not found in the host cache): in
    parallel ahead of the save (``DeltaSave.prefetch``) or one by one (``DeltaSave._read_base``).
    Counted while saving only (``NvcompReader.item_raw`` calls made by a save's writer)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.n = 0
        self.prefetched = 0
        original_read, original_prefetch = DeltaSave._read_base, DeltaSave.prefetch

        def counted(this: DeltaSave, *args: Any, **kwargs: Any) -> Any:
            if "out" not in kwargs:  # the prefetch's reads (into cache slots) are counted below
                self.n += 1
            return original_read(this, *args, **kwargs)

        def prefetching(this: DeltaSave, items: Any, *args: Any) -> None:
            cached = {ix for ix, entry in (this.cache.entries if this.cache else {}).items()
                      if this.ref is not None and entry.save_id == this.ref.save_id}
            original_prefetch(this, items, *args)
            fetched = {ix for ix, entry in (this.cache.entries if this.cache else {}).items()
                       if this.ref is not None and entry.save_id == this.ref.save_id} - cached
            self.n += len(fetched)
            self.prefetched += len(fetched)

        monkeypatch.setattr(DeltaSave, "_read_base", counted)
        monkeypatch.setattr(DeltaSave, "prefetch", prefetching)


# -- round trips and the schedule ---------------------------------------------------------------
def test_chain_round_trips_bit_exact_and_follows_full_every(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reads = _CountReads(monkeypatch)
    policy = nvdcp.DeltaPolicy(full_every=4)
    paths, wants, _ = _chain(tmp_path, 6, policy)
    assert [_depth(p) for p in paths] == [0, 1, 2, 3, 0, 1]
    assert reads.n == 0  # every base came from the host cache
    for i, path in enumerate(paths):
        rec = _record(path)
        if rec is None:
            assert _delta_fqns(path) == set()
            continue
        assert rec["version"] == 1
        assert rec["base"] == os.fspath(paths[i - 1]) and rec["relative"] == f"../s{i - 1}"
        assert rec["save_id"] == _metadata(paths[i - 1]).storage_meta.save_id
        assert rec["digests_crc"] == _metadata(paths[i - 1]).nvdcp_digests["crc"]
        deltas = _delta_fqns(path)
        assert {"w", "ids"} <= deltas, deltas
        assert not deltas & {"empty", "obj.step", "obj.note"}  # empty tensors and BYTE_IO items: whole
    # the delta pays: a delta save is well smaller than the full one
    size = [sum(i.length for i in _metadata(p).storage_data.values()) for p in paths]
    assert size[1] < 0.85 * size[0] and size[5] < 0.85 * size[4]
    assert policy.last is not None and policy.last.location == os.fspath(paths[5]) and policy.last.depth == 1
    for path, want in zip(paths, wants):
        _load_check(path, want)


def test_max_chain_bounds_the_depth(tmp_path: Path) -> None:
    paths, wants, _ = _chain(tmp_path, 6, nvdcp.DeltaPolicy(full_every=100, max_chain=2))
    assert [_depth(p) for p in paths] == [0, 1, 2, 0, 1, 2]
    _load_check(paths[2], wants[2])
    _load_check(paths[5], wants[5])


def test_full_every_one_never_deltas(tmp_path: Path) -> None:
    paths, wants, _ = _chain(tmp_path, 3, nvdcp.DeltaPolicy(full_every=1))
    assert [_record(p) for p in paths] == [None, None, None]
    assert all(not _delta_fqns(p) for p in paths)
    _load_check(paths[2], wants[2])


def test_policy_arguments_are_checked() -> None:
    for kw in ({"full_every": 0}, {"max_chain": -1}, {"cache_bytes": -1}, {"gpu_cache_bytes": -1}, {"min_gain": 1.0}):
        with pytest.raises(ValueError):
            nvdcp.DeltaPolicy(**kw)
    with pytest.raises(TypeError):
        nvdcp.NvcompWriter("/tmp/x", delta=object())  # type: ignore[arg-type]


def test_dtypes_round_trip_through_a_chain(tmp_path: Path) -> None:
    """Every element size (1, 2, 4, 8 and 16 bytes), deltas of each, bit-exact."""
    sd = {
        "f32": weights_like((100, 70), seed=1),
        "bf16": weights_like((50, 33), torch.bfloat16, seed=2),
        "f16": weights_like((50, 33), torch.float16, seed=3),
        "i64": torch.arange(3000, dtype=torch.int64) * 3,
        "i32": torch.arange(3000, dtype=torch.int32),
        "u8": torch.arange(4000, dtype=torch.int64).remainder(251).to(torch.uint8),
        "c128": torch.randn(400, dtype=torch.complex128, generator=torch.Generator().manual_seed(4)),
        "nan": random_tensor(torch.float32, (20, 20), seed=5),  # every bit pattern
        "scalar": torch.tensor(1.5),
    }
    policy = nvdcp.DeltaPolicy(full_every=8)
    paths, wants = [], []
    for step in range(3):
        for v in sd.values():
            flat = v.view(-1)
            if v.numel() > 100:
                flat[10 * step : 10 * step + 3] = flat[-3:].clone()
            else:
                flat.add_(1)
        path = tmp_path / f"s{step}"
        save(sd, path, delta=policy)
        paths.append(path)
        wants.append(_snapshot(sd))
    assert {"f32", "bf16", "f16", "i64", "i32", "u8", "c128"} <= _delta_fqns(paths[2])
    for path, want in zip(paths, wants):
        _load_check(path, want)


# -- explicit bases -----------------------------------------------------------------------------
def test_explicit_base(tmp_path: Path) -> None:
    sd = _state()
    save(sd, tmp_path / "a")
    first = _snapshot(sd)
    _train(sd, 1)
    save(sd, tmp_path / "b", base=tmp_path / "a")
    assert _record(tmp_path / "b")["depth"] == 1 and "w" in _delta_fqns(tmp_path / "b")
    second = _snapshot(sd)
    _train(sd, 2)
    save(sd, tmp_path / "c", base=tmp_path / "b")  # a base that is itself a delta
    assert _record(tmp_path / "c")["depth"] == 2 and _record(tmp_path / "c")["relative"] == "../b"
    _load_check(tmp_path / "a", first)
    _load_check(tmp_path / "b", second)
    _load_check(tmp_path / "c", _snapshot(sd))


def _chunk_bytes(path: Path, fqn: str) -> int:
    name, offset, length = item_span(path, fqn)
    with open(name, "rb") as fh:
        fh.seek(offset)
        return parse_item_header(memoryview(fh.read(length)), fqn).chunk_bytes


def test_writers_that_save_deltas_default_to_smaller_chunks_and_load_over_any_base(tmp_path: Path) -> None:
    """A writer with ``base=`` or ``delta=`` writes 32 KiB chunks (DELTA_CHUNK_BYTES), whole
    saves of a policy included; its deltas rebuild over a base of 64 KiB chunks; an explicit
    ``chunk_bytes`` wins."""
    sd = _state()
    save(sd, tmp_path / "plain")
    first = _snapshot(sd)
    _train(sd, 1)
    save(sd, tmp_path / "delta", base=tmp_path / "plain")
    assert "w" in _delta_fqns(tmp_path / "delta")
    assert _chunk_bytes(tmp_path / "plain", "w") == 64 << 10
    assert _chunk_bytes(tmp_path / "delta", "w") == delta_module.DELTA_CHUNK_BYTES == 32 << 10
    _load_check(tmp_path / "plain", first)
    _load_check(tmp_path / "delta", _snapshot(sd))

    policy = nvdcp.DeltaPolicy(full_every=4)
    save(sd, tmp_path / "whole", delta=policy)
    assert _record(tmp_path / "whole") is None and _chunk_bytes(tmp_path / "whole", "w") == 32 << 10
    _train(sd, 2)
    save(sd, tmp_path / "pinned", delta=policy, chunk_bytes=16 << 10)
    assert "w" in _delta_fqns(tmp_path / "pinned") and _chunk_bytes(tmp_path / "pinned", "w") == 16 << 10
    _load_check(tmp_path / "pinned", _snapshot(sd))
    encoder = ItemEncoder(EncodeConfig())  # a caller's encoder brings its chunk size
    try:
        _train(sd, 3)
        save(sd, tmp_path / "own_encoder", delta=policy, encoder=encoder)
    finally:
        encoder.close()
    assert "w" in _delta_fqns(tmp_path / "own_encoder") and _chunk_bytes(tmp_path / "own_encoder", "w") == 64 << 10
    _load_check(tmp_path / "own_encoder", _snapshot(sd))


def test_explicit_base_must_not_be_the_target(tmp_path: Path) -> None:
    sd = _state()
    save(sd, tmp_path / "a")
    err = _save_error(sd, tmp_path / "a", base=tmp_path / "a")
    assert isinstance(err, ValueError) and "being saved" in str(err)
    err = _save_error(sd, tmp_path / "a", base=str(tmp_path / "a") + "/")
    assert isinstance(err, ValueError)
    _load_check(tmp_path / "a", _state())  # the checkpoint there is untouched


def test_explicit_missing_base_fails_the_save(tmp_path: Path) -> None:
    err = _save_error(_state(), tmp_path / "b", base=tmp_path / "nowhere")
    assert isinstance(err, nvdcp.MissingBaseError), err
    assert str(tmp_path / "nowhere") in str(err)
    assert not (tmp_path / "b" / ".metadata").exists()


def test_explicit_base_chain_is_bounded_by_max_chain(tmp_path: Path) -> None:
    sd = _state()
    policy = nvdcp.DeltaPolicy(full_every=100, max_chain=1)
    save(sd, tmp_path / "a")
    save(sd, tmp_path / "b", base=tmp_path / "a", delta=policy)
    assert _depth(tmp_path / "b") == 1
    save(sd, tmp_path / "c", base=tmp_path / "b", delta=policy)  # would be depth 2
    assert _record(tmp_path / "c") is None and not _delta_fqns(tmp_path / "c")
    _load_check(tmp_path / "c", _snapshot(sd))


# -- resuming and the cache ---------------------------------------------------------------------
def test_resume_from_deltas_against_storage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh policy (a restarted job) resumed from a delta checkpoint: the next save deltas
    against it, its bases read back from storage through the chain (the cache is empty)."""
    paths, wants, sd = _chain(tmp_path, 2, nvdcp.DeltaPolicy(full_every=8))
    assert _depth(paths[1]) == 1
    reads = _CountReads(monkeypatch)
    fresh = nvdcp.DeltaPolicy(full_every=8)
    fresh.resume_from(paths[1])
    assert fresh.last is not None and fresh.last.depth == 1 and not fresh.cache.entries
    _train(sd, 2)
    save(sd, tmp_path / "s2", delta=fresh)
    want2 = _snapshot(sd)
    assert reads.n >= 3 and reads.prefetched >= 3  # w, b16, ids read back from storage, in parallel
    rec = _record(tmp_path / "s2")
    assert rec["depth"] == 2 and rec["save_id"] == _metadata(paths[1]).storage_meta.save_id
    assert {"w", "ids"} <= _delta_fqns(tmp_path / "s2")
    # the next save uses the cache the resumed save filled
    n = reads.n
    _train(sd, 3)
    save(sd, tmp_path / "s3", delta=fresh)
    assert reads.n == n and _depth(tmp_path / "s3") == 3
    _load_check(tmp_path / "s2", want2)
    _load_check(tmp_path / "s3", _snapshot(sd))
    _load_check(paths[1], wants[1])


def test_resume_from_nothing_is_refused(tmp_path: Path) -> None:
    with pytest.raises(nvdcp.IncompleteCheckpointError):
        nvdcp.DeltaPolicy().resume_from(tmp_path / "nothing")


def test_cache_bytes_zero_reads_bases_back_from_storage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reads = _CountReads(monkeypatch)
    policy = nvdcp.DeltaPolicy(full_every=8, cache_bytes=0)
    paths, wants, _ = _chain(tmp_path, 4, policy)
    assert [_depth(p) for p in paths] == [0, 1, 2, 3]
    assert reads.n >= 3 * 3 and not policy.cache.entries
    assert {"w", "ids"} <= _delta_fqns(paths[3])
    for path, want in zip(paths, wants):
        _load_check(path, want)


def test_small_cache_keeps_what_fits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A budget below the state's size: items beyond it are read back, all is bit-exact."""
    reads = _CountReads(monkeypatch)
    policy = nvdcp.DeltaPolicy(full_every=8, cache_bytes=100_000)  # w (307 kB) does not fit
    paths, wants, _ = _chain(tmp_path, 3, policy)
    assert reads.n >= 2 and policy.cache.used <= 100_000
    assert "w" in _delta_fqns(paths[2])
    for path, want in zip(paths, wants):
        _load_check(path, want)


def test_item_whose_delta_does_not_pay_is_stored_whole(tmp_path: Path) -> None:
    policy = nvdcp.DeltaPolicy(full_every=8)
    sd = _state()
    save(sd, tmp_path / "s0", delta=policy)
    _train(sd, 1)
    sd["w"] = weights_like((256, 300), seed=99)  # fresh values: XOR with the old ones is noise
    save(sd, tmp_path / "s1", delta=policy)
    md = _metadata(tmp_path / "s1")
    records = {ix.fqn: info for ix, info in md.storage_data.items()}
    assert not descriptor.is_delta(records["w"])
    assert records["w"].transform_descriptors == ("nvdcp.zstd/1",)
    assert descriptor.is_delta(records["ids"])  # the save is still a delta
    f, off, _ = item_span(tmp_path / "s1", "w")
    with open(f, "rb") as fh:
        fh.seek(off)
        header = parse_item_header(memoryview(fh.read(records["w"].length)), "w")
    assert header.version == 1 and not header.is_delta
    _load_check(tmp_path / "s1", _snapshot(sd))


def test_delta_that_does_not_pay_is_stored_whole_when_the_base_is_read_back(tmp_path: Path) -> None:
    """cache_bytes=0: s2's base (s1) is read back from storage and its record of w is a delta.
    w replaced by fresh values at s2: the delta is larger than w stored whole, so w must be whole."""
    policy = nvdcp.DeltaPolicy(full_every=8, cache_bytes=0)
    paths, _, sd = _chain(tmp_path, 2, policy)
    assert "w" in _delta_fqns(paths[1])
    sd["w"] = weights_like((256, 300), seed=99)
    _train(sd, 2)
    save(sd, tmp_path / "s2", delta=policy)
    save({"w": sd["w"]}, tmp_path / "whole", chunk_bytes=delta_module.DELTA_CHUNK_BYTES)  # the policy writer's chunks
    whole = next(i.length for i in _metadata(tmp_path / "whole").storage_data.values())
    got = next(i for ix, i in _metadata(tmp_path / "s2").storage_data.items() if ix.fqn == "w")
    _load_check(tmp_path / "s2", _snapshot(sd))  # correct either way: only the size is at stake
    assert got.length <= whole and not descriptor.is_delta(got), (got.length, whole)


def test_items_added_removed_and_reshaped(tmp_path: Path) -> None:
    policy = nvdcp.DeltaPolicy(full_every=8)
    sd0 = {
        "keep": weights_like((128, 100), seed=1),
        "reshaped": weights_like((64, 50), seed=2),
        "retyped": weights_like((64, 50), seed=3),
        "gone": weights_like((10, 10), seed=4),
    }
    save(sd0, tmp_path / "s0", delta=policy)
    sd1 = {
        "keep": sd0["keep"] + 1e-5,
        "reshaped": sd0["reshaped"].reshape(50, 64).clone(),  # same bytes, other shape
        "retyped": sd0["retyped"].double(),
        "new": weights_like((30, 30), seed=5),
    }
    save(sd1, tmp_path / "s1", delta=policy)
    assert _depth(tmp_path / "s1") == 1
    assert _delta_fqns(tmp_path / "s1") == {"keep"}
    _load_check(tmp_path / "s1", sd1)
    # one more save: the reshaped, retyped and new items now have a base of their own shape
    sd2 = {k: v + 1e-5 for k, v in sd1.items()}
    save(sd2, tmp_path / "s2", delta=policy)
    assert _depth(tmp_path / "s2") == 2
    assert _delta_fqns(tmp_path / "s2") == {"keep", "reshaped", "retyped", "new"}
    _load_check(tmp_path / "s2", sd2)
    _load_check(tmp_path / "s0", sd0)


def test_a_tree_of_checkpoints_moved_whole_keeps_loading(tmp_path: Path) -> None:
    paths, wants, _ = _chain(tmp_path / "run", 3, nvdcp.DeltaPolicy(full_every=8))
    shutil.move(tmp_path / "run", tmp_path / "moved")
    _load_check(tmp_path / "moved" / "s2", wants[2])  # bases found by their relative location


# -- errors name the broken base ----------------------------------------------------------------
def _two(tmp_path: Path, **kw: Any) -> tuple[Path, Path, dict[str, Any]]:
    paths, wants, _ = _chain(tmp_path, 2, nvdcp.DeltaPolicy(full_every=8), **kw)
    assert _depth(paths[1]) == 1
    return paths[0], paths[1], wants[1]


def _untouched(target: dict[str, Any], fqns: Any = None) -> None:
    for k, v in target.items():
        if fqns is not None and k not in fqns:
            continue
        if isinstance(v, torch.Tensor):
            assert v.numel() == 0 or bool((v == SENTINEL).all()), k
        elif isinstance(v, dict):
            _untouched(v)
        else:
            assert v == "untouched", k


def test_deleted_base_is_named_and_nothing_is_loaded(tmp_path: Path) -> None:
    base, delta, want = _two(tmp_path)
    shutil.rmtree(base)
    target = _sentinel_like(want)
    err = _load_error(delta, target)
    assert isinstance(err, nvdcp.MissingBaseError), repr(err)
    assert str(base) in str(err) and str(delta) in str(err) and "restore" in str(err)
    _untouched(target)


def test_deleted_base_under_checkpoint_exception(tmp_path: Path) -> None:
    """What DCP raises: a CheckpointException whose failure is the MissingBaseError."""
    base, delta, want = _two(tmp_path)
    (base / ".metadata").unlink()  # an uncommitted base counts as missing
    with pytest.raises(CheckpointException) as info:
        load(_sentinel_like(want), delta)
    assert "MissingBaseError" in str(info.value) or isinstance(failure_of(info.value), nvdcp.MissingBaseError)
    assert isinstance(failure_of(info.value), FileNotFoundError)


def test_base_of_a_base_deleted(tmp_path: Path) -> None:
    paths, wants, _ = _chain(tmp_path, 3, nvdcp.DeltaPolicy(full_every=8))
    shutil.rmtree(paths[0])
    target = _sentinel_like(wants[2])
    err = _load_error(paths[2], target)
    assert isinstance(err, nvdcp.MissingBaseError) and str(paths[0]) in str(err)
    _untouched(target)


def test_overwritten_base_is_a_mismatch(tmp_path: Path) -> None:
    base, delta, want = _two(tmp_path)
    save(_state(), base)  # another save at the base's location
    target = _sentinel_like(want)
    err = _load_error(delta, target)
    assert isinstance(err, nvdcp.BaseMismatchError), repr(err)
    assert str(base) in str(err) and "overwritten" in str(err)
    _untouched(target)


def test_corrupt_byte_in_base_is_named_and_its_item_untouched(tmp_path: Path) -> None:
    base, delta, want = _two(tmp_path)
    f, off, length = item_span(base, "w")
    data = bytearray(f.read_bytes())
    data[off + length - 100] ^= 0x10
    f.write_bytes(data)
    target = _sentinel_like(want)
    err = _load_error(delta, target)
    assert isinstance(err, nvdcp.CorruptCheckpointError) and not isinstance(err, nvdcp.DeltaBaseError), repr(err)
    assert f.name in str(err) and "'w'" in str(err) or "w" in str(err)
    assert "checksum" in str(err)
    _untouched(target, {"w"})


def test_a_load_failed_by_its_base_leaves_no_read_threads_behind(tmp_path: Path) -> None:
    """A delta item failing (here its base's chunk) ends the load with the other items' reads
    still queued: the load shuts their pool down before raising. Left to the garbage collector,
    that shutdown ran later in whatever thread collected, and a collection inside a new thread's
    start (holding threading's shutdown lock, which joining takes again) hung the process."""
    from nvdcp.testing import damage as D

    _, delta, want = D.save_delta_sample(tmp_path, "zstd")
    base = tmp_path / "base"
    f, off, length = item_span(base, "w")
    data = bytearray(f.read_bytes())
    data[off + length - 10] ^= 0x10
    f.write_bytes(data)
    before = {t for t in threading.enumerate() if t.name.startswith("nvdcp-read")}
    gc.disable()  # the collector must not be what ends the pool
    try:
        err = _load_error(delta, empty_like_sd(want))
        left = [t for t in threading.enumerate() if t.name.startswith("nvdcp-read") and t not in before]
    finally:
        gc.enable()
    assert isinstance(err, nvdcp.CorruptCheckpointError), repr(err)
    assert not left, left


def _forge_raw_record(f: Path, off: int, length: int) -> None:
    """Change one payload byte of a ``codec="none"`` record and fix its chunk and header CRCs:
    a well-formed record of other values (another digest)."""
    data = bytearray(f.read_bytes())
    header = parse_item_header(memoryview(data)[off : off + length], "forge")
    assert len(header.chunks) >= 1 and header.chunks[0][0] == header.chunk_bytes  # stored raw
    hb = header.header_bytes
    data[off + hb + 5] ^= 0x01
    chunk0 = bytes(data[off + hb : off + hb + header.chunks[0][0]])
    table = off + hb - 4 - 8 * len(header.chunks)
    struct.pack_into("<I", data, table + 4, checksum(chunk0))
    struct.pack_into("<I", data, off + hb - 4, checksum(bytes(data[off : off + hb - 4])))
    f.write_bytes(data)


def test_base_item_with_another_digest_is_a_mismatch(tmp_path: Path) -> None:
    sd = {"w": weights_like((256, 300), seed=1), "v": weights_like((100,), seed=2)}
    save(sd, tmp_path / "a", codec="none")
    sd1 = {k: v + 1e-6 for k, v in sd.items()}
    save(sd1, tmp_path / "b", base=tmp_path / "a", codec="zstd")
    assert "w" in _delta_fqns(tmp_path / "b")
    f, off, length = item_span(tmp_path / "a", "w")
    _forge_raw_record(f, off, length)
    # the forged base still loads on its own (well-formed), only the delta sees the mismatch
    out = empty_like_sd(sd)
    load(out, tmp_path / "a")
    assert not bit_equal(out["w"], sd["w"]) and bit_equal(out["v"], sd["v"])
    target = _sentinel_like(sd1)
    err = _load_error(tmp_path / "b", target)
    assert isinstance(err, nvdcp.BaseMismatchError), repr(err)
    assert "digest" in str(err) and "'w'" in str(err)
    _untouched(target, {"w"})


def test_delta_frame_that_does_not_decode_is_named(tmp_path: Path) -> None:
    """A delta record whose CRCs match but whose zstd frame does not decode to its chunk's size
    (forged: a checksum only finds accidents) fails the batched decode, and the error names it."""
    sd = {"w": weights_like((256, 300), seed=1), "v": weights_like((100,), seed=2)}
    save(sd, tmp_path / "a")
    sd1 = {k: v + 1e-3 for k, v in sd.items()}
    save(sd1, tmp_path / "b", base=tmp_path / "a")
    assert "w" in _delta_fqns(tmp_path / "b")
    f, off, length = item_span(tmp_path / "b", "w")
    data = bytearray(f.read_bytes())
    header = parse_item_header(memoryview(data)[off : off + length], "forge")
    sizes = header.chunks.sizes.tolist()
    raw_size = min(header.chunk_bytes, header.plane_nbytes)
    i = next(i for i, n in enumerate(sizes) if n < raw_size)  # a compressed chunk
    at = off + header.header_bytes + sum(sizes[:i])
    data[at + 4 : at + sizes[i]] = b"\xff" * (sizes[i] - 4)
    table = off + header.header_bytes - 4 - 8 * len(sizes)
    struct.pack_into("<I", data, table + 8 * i + 4, checksum(bytes(data[at : at + sizes[i]])))
    struct.pack_into("<I", data, off + header.header_bytes - 4, checksum(bytes(data[off : off + header.header_bytes - 4])))
    f.write_bytes(data)
    err = _load_error(tmp_path / "b", _sentinel_like(sd1))
    assert isinstance(err, nvdcp.CorruptCheckpointError), repr(err)
    assert "'w'" in str(err) and f.name in str(err), str(err)


def _two_deltas_with_base_metadata(tmp_path: Path, edit: Any) -> dict[str, Any]:
    """Items x and y saved at a, then as deltas at b; ``edit(md)`` then rewrites a's .metadata."""
    sd = {"x": weights_like((64, 64), seed=1), "y": weights_like((64, 64), seed=2)}
    save(sd, tmp_path / "a")
    save({k: v + 1e-6 for k, v in sd.items()}, tmp_path / "b", base=tmp_path / "a")
    assert _delta_fqns(tmp_path / "b") == {"x", "y"}
    meta = tmp_path / "a" / ".metadata"
    md = pickle.loads(meta.read_bytes())
    edit(md)
    meta.write_bytes(pickle.dumps(md))
    return sd


def test_base_items_swapped_in_metadata_is_a_mismatch(tmp_path: Path) -> None:
    """The base's .metadata rebuilt with two same-shaped items swapped (same save id, same
    digest record): each delta item finds a base record of another digest."""
    def swap(md: Any) -> None:
        (ix, iy) = [ix for ix in md.storage_data]
        md.storage_data[ix], md.storage_data[iy] = md.storage_data[iy], md.storage_data[ix]

    sd = _two_deltas_with_base_metadata(tmp_path, swap)
    target = _sentinel_like(sd)
    err = _load_error(tmp_path / "b", target)
    assert isinstance(err, nvdcp.BaseMismatchError), repr(err)
    assert "not the base of this delta" in str(err)
    _untouched(target)


def test_base_record_past_its_files_end_is_named_before_anything_is_allocated(tmp_path: Path) -> None:
    """A base .metadata whose record for an item runs a TiB past its data file (hostile or
    damaged): the delta load refuses it by the file's size, naming the item, instead of
    allocating a buffer for it."""
    def stretch(md: Any) -> None:
        ix = next(ix for ix in md.storage_data if ix.fqn == "y")
        md.storage_data[ix] = dataclasses.replace(md.storage_data[ix], length=1 << 40)

    sd = _two_deltas_with_base_metadata(tmp_path, stretch)
    target = _sentinel_like(sd)
    err = _load_error(tmp_path / "b", target)
    assert isinstance(err, nvdcp.TruncatedCheckpointError), repr(err)
    assert "'y'" in str(err), str(err)
    _untouched(target)


def test_delta_descriptor_without_delta_record_is_refused(tmp_path: Path) -> None:
    """A .metadata whose descriptor says whole while the record is a delta (or the reverse)."""
    _, delta, want = _two(tmp_path)
    meta = delta / ".metadata"
    md = pickle.loads(meta.read_bytes())
    for ix, info in md.storage_data.items():
        if ix.fqn == "w":
            info.transform_descriptors = ("nvdcp.zstd/1",)
    meta.write_bytes(pickle.dumps(md))
    target = _sentinel_like(want)
    err = _load_error(delta, target)
    assert isinstance(err, nvdcp.CorruptCheckpointError) and "delta" in str(err) and "w" in str(err)
    _untouched(target, {"w"})


def test_malformed_or_newer_delta_record_is_refused(tmp_path: Path) -> None:
    _, delta, want = _two(tmp_path)
    meta = delta / ".metadata"
    md = pickle.loads(meta.read_bytes())
    getattr(md, DELTA_ATTR)["version"] = 9
    meta.write_bytes(pickle.dumps(md))
    err = _load_error(delta, _sentinel_like(want))
    assert isinstance(err, nvdcp.CorruptCheckpointError) and "v9" in str(err) and "upgrade" in str(err)
    getattr(md, DELTA_ATTR)["version"] = 1
    getattr(md, DELTA_ATTR)["depth"] = 0
    meta.write_bytes(pickle.dumps(md))
    err = _load_error(delta, _sentinel_like(want))
    assert isinstance(err, nvdcp.CorruptCheckpointError) and "malformed" in str(err)


# -- crash safety -------------------------------------------------------------------------------
def _raise_enospc() -> None:
    raise OSError(errno.ENOSPC, "injected: no space left on device")


@pytest.mark.parametrize("at", ["bytes", "finish_start"])
def test_failed_delta_save_keeps_the_chain_and_the_cache_honest(tmp_path: Path, at: str) -> None:
    """A delta save that fails half-way (a storage write, or before the commit): the previous
    checkpoint and its base load bit-exactly, and the next saves of the policy make a correct
    chain (cached bytes of the failed save are never taken for the committed save's)."""
    policy = nvdcp.DeltaPolicy(full_every=8)
    paths, wants, sd = _chain(tmp_path, 2, policy, thread_count=1)
    last = policy.last
    _train(sd, 2)
    stopper = F.Stopper(after_bytes=150_000, action=_raise_enospc) if at == "bytes" else F.Stopper(
        at="finish_start", action=_raise_enospc)
    with pytest.raises((CheckpointException, OSError)):
        import torch.distributed.checkpoint as dcp

        dcp.save(sd, storage_writer=F.StoppingWriter(tmp_path / "s2", stopper=stopper, delta=policy, thread_count=1))
    assert not (tmp_path / "s2" / ".metadata").exists()
    assert policy.last == last  # nothing committed: the base stays the last good save
    _load_check(paths[0], wants[0])
    _load_check(paths[1], wants[1])
    # the state moves on; the retried save and the next one chain onto s1
    _train(sd, 3)
    save(sd, tmp_path / "s2", delta=policy, thread_count=1)
    want2 = _snapshot(sd)
    assert _depth(tmp_path / "s2") == 2 and _record(tmp_path / "s2")["base"] == os.fspath(paths[1])
    _train(sd, 4)
    save(sd, tmp_path / "s3", delta=policy, thread_count=1)
    assert _depth(tmp_path / "s3") == 3 and {"w", "ids"} <= _delta_fqns(tmp_path / "s3")
    _load_check(tmp_path / "s2", want2)
    _load_check(tmp_path / "s3", _snapshot(sd))
    _load_check(paths[1], wants[1])


def test_base_deleted_between_saves_is_saved_whole(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The policy's previous checkpoint removed out of band: the next save does not depend on it."""
    policy = nvdcp.DeltaPolicy(full_every=8, cache_bytes=0)
    paths, _, sd = _chain(tmp_path, 1, policy)
    shutil.rmtree(paths[0])
    _train(sd, 1)
    with caplog.at_level("WARNING", logger="nvdcp.dcp.delta"):
        save(sd, tmp_path / "s1", delta=policy)
    assert "gone" in caplog.text
    assert _record(tmp_path / "s1") is None and not _delta_fqns(tmp_path / "s1")
    _load_check(tmp_path / "s1", _snapshot(sd))


def test_base_overwritten_between_saves_deltas_against_what_is_there(tmp_path: Path) -> None:
    """The policy's previous checkpoint overwritten by another save: the cache (the old bytes)
    must not be used; the delta is against the checkpoint now there."""
    policy = nvdcp.DeltaPolicy(full_every=8)
    paths, _, sd = _chain(tmp_path, 1, policy)
    other = _state()
    _train(other, 5)
    save(other, paths[0])  # not through the policy
    _train(sd, 1)
    save(sd, tmp_path / "s1", delta=policy)
    rec = _record(tmp_path / "s1")
    if rec is not None:
        assert rec["save_id"] == _metadata(paths[0]).storage_meta.save_id
    _load_check(tmp_path / "s1", _snapshot(sd))


class _CountBaseParses:
    """Counts ``.metadata`` files a save's base check unpickled (``resolve_base``'s parses)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.n = 0
        original = delta_module.parse_metadata

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.n += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(delta_module, "parse_metadata", counted)


def test_the_base_check_compares_bytes_instead_of_unpickling(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A policy's next save finds its previous save's ``.metadata`` unchanged by its bytes: no
    unpickling, and the delta records the same base (save id, depth, digest record) as a parse
    would give."""
    policy = nvdcp.DeltaPolicy(full_every=8)
    paths, _, sd = _chain(tmp_path, 2, policy)
    parses = _CountBaseParses(monkeypatch)
    _train(sd, 2)
    save(sd, tmp_path / "s2", delta=policy)
    assert parses.n == 0
    rec, base = _record(tmp_path / "s2"), _metadata(paths[1])
    assert rec is not None and rec["depth"] == 2 and rec["save_id"] == base.storage_meta.save_id
    assert rec["digests_crc"] == getattr(base, DIGEST_ATTR)["crc"]
    _load_check(tmp_path / "s2", _snapshot(sd))


def test_a_base_whose_metadata_bytes_changed_is_parsed_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The previous save's ``.metadata`` replaced out of band by another pickle of the same
    checkpoint (same content, other bytes): the check parses it, the delta still records it."""
    policy = nvdcp.DeltaPolicy(full_every=8)
    paths, _, sd = _chain(tmp_path, 2, policy)
    md_path = paths[1] / ".metadata"
    metadata = pickle.loads(md_path.read_bytes())
    md_path.write_bytes(pickle.dumps(metadata, protocol=2))  # other bytes, same save
    parses = _CountBaseParses(monkeypatch)
    _train(sd, 2)
    save(sd, tmp_path / "s2", delta=policy)
    assert parses.n == 1
    rec = _record(tmp_path / "s2")
    assert rec is not None and rec["depth"] == 2 and rec["save_id"] == metadata.storage_meta.save_id
    _load_check(tmp_path / "s2", _snapshot(sd))


def test_resume_from_remembers_the_bytes_it_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paths, _, sd = _chain(tmp_path, 1, nvdcp.DeltaPolicy(full_every=8))
    fresh = nvdcp.DeltaPolicy(full_every=8)
    fresh.resume_from(paths[0])
    parses = _CountBaseParses(monkeypatch)
    _train(sd, 1)
    save(sd, tmp_path / "s1", delta=fresh)
    assert parses.n == 0 and _depth(tmp_path / "s1") == 1
    _load_check(tmp_path / "s1", _snapshot(sd))


def test_identical_delta_save_is_refused_as_stale(tmp_path: Path) -> None:
    policy = nvdcp.DeltaPolicy(full_every=8)
    sd = {"w": weights_like((256, 300), seed=1), "ids": torch.arange(5000, dtype=torch.int64)}
    save(sd, tmp_path / "s0", delta=policy, on_identical_save="error")
    err = _save_error(sd, tmp_path / "s1", delta=policy, on_identical_save="error")  # same weights again
    assert isinstance(err, nvdcp.StaleSaveError), err
    assert not (tmp_path / "s1" / ".metadata").exists()


def test_item_whose_delta_did_not_pay_is_stored_whole_without_trying_for_a_while(tmp_path: Path) -> None:
    """An item whose delta lost (fresh values each save) is stored whole at the next saves
    without a delta attempt (no second encode), then tried again, after twice as many saves
    each time it loses again; everything loads bit-exact."""
    policy = nvdcp.DeltaPolicy(full_every=16)
    sd = {"w": weights_like((256, 300), seed=1), "r": random_tensor(torch.float32, (20_000,), seed=2)}
    attempted: list[set[str]] = []
    original = DeltaSave.finish

    def spy(self: DeltaSave, ok: bool) -> None:
        attempted.append({ix.fqn for ix in self._attempted})
        original(self, ok)

    DeltaSave.finish = spy  # type: ignore[method-assign]
    try:
        saved = []
        for i in range(13):
            save(sd, tmp_path / f"s{i}", delta=policy)
            saved.append(_snapshot(sd))
            sd["w"] = sd["w"] + 1e-4 * weights_like((256, 300), seed=10 + i)
            sd["r"] = random_tensor(torch.float32, (20_000,), seed=20 + i)
    finally:
        DeltaSave.finish = original  # type: ignore[method-assign]
    assert attempted[0] == set()  # a full save tries nothing
    assert attempted[1] == {"w", "r"}  # both tried; r lost
    assert attempted[2] == attempted[3] == attempted[4] == {"w"}  # r skipped for RETRY_AFTER saves
    assert attempted[5] == {"w", "r"}  # then tried again, and lost again
    assert all(attempted[i] == {"w"} for i in range(6, 12))  # skipped twice as long
    assert attempted[12] == {"w", "r"}
    for i in range(1, 13):
        assert _delta_fqns(tmp_path / f"s{i}") == {"w"}
    for i, want in enumerate(saved):
        _load_check(tmp_path / f"s{i}", want)


def test_deltas_against_the_full_save_keep_every_load_to_two_checkpoints(tmp_path: Path) -> None:
    """against="full": every delta names the last full save (depth 1), the cache keeps that
    save's bytes (no base is read back from storage), and the chain restarts every full_every."""
    policy = nvdcp.DeltaPolicy(full_every=4, against="full")
    sd = {"w": weights_like((256, 300), seed=1), "b": weights_like((4096,), torch.bfloat16, seed=2)}
    reads = 0
    original = DeltaSave._read_base

    def counting(self: DeltaSave, *args: Any) -> Any:
        nonlocal reads
        reads += 1
        return original(self, *args)

    DeltaSave._read_base = counting  # type: ignore[method-assign]
    saved = []
    try:
        for i in range(6):
            save(sd, tmp_path / f"s{i}", delta=policy)
            saved.append(_snapshot(sd))
            sd["w"] = sd["w"] + 1e-4 * weights_like((256, 300), seed=10 + i)
            sd["b"] = sd["b"] + (1e-3 * weights_like((4096,), seed=20 + i)).to(torch.bfloat16)
    finally:
        DeltaSave._read_base = original  # type: ignore[method-assign]
    assert reads == 0
    assert [_depth(tmp_path / f"s{i}") for i in range(6)] == [0, 1, 1, 1, 0, 1]
    bases = [(_record(tmp_path / f"s{i}") or {}).get("relative") for i in range(6)]
    assert bases == [None, "../s0", "../s0", "../s0", None, "../s4"]
    for i, want in enumerate(saved):
        _load_check(tmp_path / f"s{i}", want)
    with pytest.raises(ValueError, match="against"):
        nvdcp.DeltaPolicy(against="sideways")


def test_resume_from_a_delta_against_the_full_save_finds_that_full_save(tmp_path: Path) -> None:
    policy = nvdcp.DeltaPolicy(full_every=8, against="full")
    sd = {"w": weights_like((256, 300), seed=1)}
    save(sd, tmp_path / "s0", delta=policy)
    sd["w"] = sd["w"] + 1e-4
    save(sd, tmp_path / "s1", delta=policy)
    resumed = nvdcp.DeltaPolicy(full_every=8, against="full")
    resumed.resume_from(tmp_path / "s1")
    sd["w"] = sd["w"] + 1e-4
    save(sd, tmp_path / "s2", delta=resumed)
    assert (_record(tmp_path / "s2") or {}).get("relative") == "../s0"
    _load_check(tmp_path / "s2", _snapshot(sd))


def test_the_cache_never_allocates_more_than_its_budget() -> None:
    from nvdcp.dcp.delta import BaseCache

    budget = 3 * 1000 + 100
    cache = BaseCache(budget)
    got = [cache.slot(("item", i), 1000, torch.float32, (250,), pin=False) for i in range(5)]
    assert [g is not None for g in got] == [True, True, True, False, False]
    assert cache.allocated <= budget and cache.used == 3000
    for g in got[:3]:  # slots do not overlap
        assert g is not None
        g.data.fill_(7)
    assert all(int(g.data.sum()) == 7 * 1000 for g in got[:3] if g is not None)


def test_a_gpu_budget_alone_keeps_no_host_encoded_item() -> None:
    """gpu_cache_bytes without cache_bytes: items encoded on the host (no GPU device asked) are
    not kept, and nothing is allocated (the GPU part is exercised in tests/gpu/test_delta_gpu.py)."""
    from nvdcp.dcp.delta import BaseCache

    cache = BaseCache(0, gpu_budget=1 << 20)
    assert cache.enabled
    assert cache.slot(("item", 0), 1000, torch.float32, (250,), pin=False) is None
    assert cache.slot(("item", 1), 1000, torch.float32, (250,), pin=False, device=torch.device("cpu")) is None
    assert cache.used == cache.allocated == cache.gpu_allocated == 0
    assert not BaseCache(0).enabled


@pytest.mark.parametrize("level_buffer_bytes", [0, 64 << 20])
def test_host_loads_rebuild_deltas_in_groups_of_items_with_chains_of_different_depths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, level_buffer_bytes: int,
) -> None:
    """Groups of 3 items: most items are deltas two levels deep, one was stored whole in the
    middle save (fresh values), one only exists from the middle save on (a delta one level deep).
    Each level read into fresh memory, or into the thread's reused buffer for its checkpoint
    (the groups after a thread's first reuse them)."""
    from nvdcp.dcp import reader as reader_mod

    monkeypatch.setattr(reader_mod, "DELTA_GROUP_ITEMS", 3)
    monkeypatch.setattr(reader_mod, "LEVEL_BUFFER_BYTES", level_buffer_bytes)
    policy = nvdcp.DeltaPolicy(full_every=8)
    sd: dict[str, Any] = {f"w{i}": weights_like((64, 50), seed=i) for i in range(8)}
    save(sd, tmp_path / "s0", delta=policy)
    for i in range(8):
        sd[f"w{i}"] = sd[f"w{i}"] + 1e-4
    sd["w3"] = random_tensor(torch.float32, (64, 50), seed=99)  # stored whole in s1
    sd["new"] = weights_like((300,), seed=50)
    save(sd, tmp_path / "s1", delta=policy)
    for i in range(8):
        sd[f"w{i}"] = sd[f"w{i}"] + 1e-4
    sd["new"] = sd["new"] + 1e-4
    save(sd, tmp_path / "s2", delta=policy)
    # w0: two levels deep; new: one (stored whole in s1); w3: whole in s1 and, skipped, in s2
    assert {"w0", "new"} <= _delta_fqns(tmp_path / "s2") and "w3" not in _delta_fqns(tmp_path / "s1")

    def one_by_one(*args: Any) -> None:
        raise AssertionError("an undamaged level was checked record by record")

    # each level of a group is parsed, checked and decoded together (the one-by-one checks are
    # for damaged levels, whose errors they name: the corruption tests above)
    monkeypatch.setattr(reader_mod.NvcompReader, "_check_level", one_by_one)
    _load_check(tmp_path / "s2", _snapshot(sd))


def test_host_delta_groups_leave_no_thread_idle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A load's host deltas are cut into at least two groups per reader thread, unless a group
    would then hold less than DELTA_GROUP_MIN_BYTES of records; in file order, every item once;
    the load is the same."""
    from nvdcp.dcp import reader as reader_mod

    monkeypatch.setattr(reader_mod, "DELTA_GROUP_MIN_BYTES", 1)
    policy = nvdcp.DeltaPolicy(full_every=8, min_item_bytes=0)
    sd: dict[str, Any] = {f"w{i}": weights_like((64, 200), seed=i) for i in range(12)}
    save(sd, tmp_path / "s0", delta=policy)
    sd = {k: v + 1e-4 for k, v in sd.items()}
    save(sd, tmp_path / "s1", delta=policy)
    paths, wants = [tmp_path / "s0", tmp_path / "s1"], [None, _snapshot(sd)]
    reader = nvdcp.NvcompReader(paths[1], thread_count=2)
    md = reader.read_metadata()
    reader.set_up_storage_reader(md, True)
    deltas = [ix for ix, info in md.storage_data.items() if descriptor.is_delta(info)]
    deltas.sort(key=lambda ix: (md.storage_data[ix].relative_path, md.storage_data[ix].offset))
    total = sum(md.storage_data[ix].length for ix in deltas)
    assert len(deltas) == 12
    groups = reader._delta_groups(deltas)
    assert [ix for g in groups for ix in g] == deltas
    assert len(groups) >= 4, (total, [len(g) for g in groups])  # two per thread at least
    monkeypatch.setattr(reader_mod, "DELTA_GROUP_MIN_BYTES", total)  # the minimum wins: one group
    assert reader._delta_groups(deltas) == [deltas]
    monkeypatch.setattr(reader_mod, "DELTA_GROUP_MIN_BYTES", 1)
    _load_check(paths[1], wants[1])


# -- plane codecs of the next GPU delta ---------------------------------------------------------
def test_a_delta_record_sets_its_items_next_plane_codecs(tmp_path: Path) -> None:
    """Each delta written tells the cache which codec each plane of the item's next delta gets on
    the GPU (how well each plane compressed), and the next save hands that to the encoder."""
    policy = nvdcp.DeltaPolicy(full_every=8)
    sd = _state()
    sd["still"] = weights_like((200, 100), seed=5)  # never changes: every plane of its delta is zero
    save(sd, tmp_path / "full", delta=policy)
    _train(sd, 1)
    save(sd, tmp_path / "d1", delta=policy)
    entries = {ix.fqn: e for ix, e in policy.cache.entries.items()}
    assert entries["still"].delta_codecs == ("zstd",) * 4
    # small updates of every weight: the low mantissa bytes carry entropy, the top byte does not
    w = entries["w"].delta_codecs
    assert w is not None and w[0] == "gdeflate" and w[-1] == "zstd", w
    assert entries["ids"].delta_codecs == ("zstd",) * 8  # int64 XOR: a few bytes of 40,000 changed
    # the next save's encoder inputs carry them
    handed: dict[str, Any] = {}
    original = DeltaSave.prepare

    def spy(self: DeltaSave, index: Any, tensor: torch.Tensor) -> Any:
        out = original(self, index, tensor)
        handed[index.fqn] = getattr(getattr(out, "delta", None), "plane_codecs", None)
        return out

    DeltaSave.prepare = spy  # type: ignore[method-assign]
    try:
        _train(sd, 2)
        save(sd, tmp_path / "d2", delta=policy)
    finally:
        DeltaSave.prepare = original  # type: ignore[method-assign]
    assert handed["still"] == ("zstd",) * 4 and handed["w"] == w
    assert load(_sentinel_like(sd), tmp_path / "d2") is not None

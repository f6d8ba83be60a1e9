"""Damage a saved checkpoint one byte (or one truncation) at a time and classify what a load and
``nvdcp.verify_checkpoint`` make of it. Shared by tests/reliability and
benchmarks/reliability_sweep.py (which runs many more cases)."""

from __future__ import annotations

import contextlib
import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import nvdcp
from nvdcp.format.header import FILE_FIXED_SIZE, ITEM_FIXED_SIZE, file_header_size, item_header_size
from nvdcp.testing import empty_like_sd, failure_of, random_tensor, weights_like
from nvdcp.testing.faults import same_state


def sample_state() -> dict[str, Any]:
    """Every layout: byte planes (f32, bf16, i64), one plane (bool, u8), a scalar, bytes."""
    return {
        "w": weights_like((48, 100)),
        "b16": weights_like((30, 70), torch.bfloat16, seed=1),
        "ids": torch.arange(3000, dtype=torch.int64) * 7,
        "mask": random_tensor(torch.bool, (2500,), seed=2),
        "raw": random_tensor(torch.uint8, (1500,), seed=3),
        "scalar": torch.tensor(2.5),
        "extra": {"step": 7, "note": "x" * 300},
    }


def save_sample(path: Path, codec: str) -> dict[str, Any]:
    sd = sample_state()
    # 1 KiB chunks: many chunks and a long chunk table from a small state.
    writer = nvdcp.NvcompWriter(path, codec=codec, chunk_bytes=1024, sync_files=False, codec_threads=1)
    dcp.save(sd, storage_writer=writer)
    return sd


def next_state(base: dict[str, Any]) -> dict[str, Any]:
    """The state a training step makes of ``base`` (:func:`sample_state`): floats nudged, a few
    integers changed, the rest as it was, so that a delta saved against ``base`` stores its
    float and integer items as differences."""
    nxt = dict(base)
    nxt["w"] = base["w"] + 1e-4 * weights_like(tuple(base["w"].shape), seed=11)
    nudge = 1e-2 * weights_like(tuple(base["b16"].shape), seed=12)
    nxt["b16"] = (base["b16"].float() + nudge).to(torch.bfloat16)
    ids = base["ids"].clone()
    ids[::97] += 1
    nxt["ids"] = ids
    return nxt


def save_delta_sample(root: Path, codec: str) -> tuple[Path, Path, dict[str, Any]]:
    """A full checkpoint of :func:`sample_state` at ``root/base`` and a delta against it of
    :func:`next_state` at ``root/delta`` (one ``DeltaPolicy``, small items included): the
    chain a damage case loads through. Returns both locations and the delta's state."""
    policy = nvdcp.DeltaPolicy(min_item_bytes=0)
    base_sd = sample_state()
    next_sd = next_state(base_sd)
    for sd, name in ((base_sd, "base"), (next_sd, "delta")):
        writer = nvdcp.NvcompWriter(root / name, codec=codec, chunk_bytes=1024, sync_files=False, codec_threads=1,
                                    delta=policy)
        dcp.save(sd, storage_writer=writer)
    return root / "base", root / "delta", next_sd


@dataclass
class Region:
    file: str
    start: int
    stop: int
    kind: str  # "file header", "item header", "payload"
    item: str | None = None


def regions(path: Path) -> list[Region]:
    """Every byte of every data file, classified (items are back to back after the file header)."""
    md = nvdcp.NvcompReader(path).read_metadata()
    out: list[Region] = []
    files = sorted({info.relative_path for info in md.storage_data.values()})
    for name in files:
        data = (path / name).read_bytes()
        fh = file_header_size(memoryview(data[:FILE_FIXED_SIZE]), name)
        out.append(Region(name, 0, fh, "file header"))
        records = sorted((info.offset, info.length, ix.fqn) for ix, info in md.storage_data.items()
                         if info.relative_path == name)
        expect = fh
        for off, length, fqn in records:
            assert off == expect, "items are back to back"
            hb = item_header_size(memoryview(data[off : off + ITEM_FIXED_SIZE]), name)
            out.append(Region(name, off, off + hb, "item header", fqn))
            if length > hb:
                out.append(Region(name, off + hb, off + length, "payload", fqn))
            expect = off + length
        assert expect == len(data), "no bytes outside records"
    return out


@dataclass
class Tally:
    cases: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"cases": self.cases, "outcomes": dict(self.outcomes), "failures": self.failures[:20]}


def load_outcome(path: Path, want: dict[str, Any]) -> tuple[str, BaseException | None]:
    sd = empty_like_sd(want)
    try:
        dcp.load(sd, storage_reader=nvdcp.NvcompReader(path, thread_count=1, codec_threads=1))
    except (CheckpointException, nvdcp.NvdcpError) as exc:
        err = failure_of(exc)
        return type(err).__name__, err
    return ("intact" if same_state(sd, want) else "WRONG"), None


@contextlib.contextmanager
def _flipped(f: Path, pos: int, xor: int) -> Iterator[None]:
    """Byte ``pos`` of file ``f`` xor-ed with ``xor`` inside the block, restored after it."""
    original = f.read_bytes()
    damaged = bytearray(original)
    damaged[pos] ^= xor
    f.write_bytes(damaged)
    try:
        yield
    finally:
        f.write_bytes(original)


def check_flip(path: Path, region: Region, pos: int, xor: int, want: dict[str, Any], tally: Tally) -> None:
    """Flip one byte, load and verify, restore; record the outcome and any contract breach."""
    with _flipped(path / region.file, pos, xor):
        _judge(path, region, f"{region.kind} {region.file}@{pos}^{xor:#04x}", want, tally)


def check_truncation(path: Path, file: str, length: int, want: dict[str, Any], tally: Tally,
                     all_regions: list[Region]) -> None:
    f = path / file
    original = f.read_bytes()
    f.write_bytes(original[:length])
    # The first record the cut reaches is the one a load must name.
    hit = next(r for r in all_regions if r.file == file and r.stop > length)
    try:
        _judge(path, hit, f"truncated {file} to {length}", want, tally, truncated=True)
    finally:
        f.write_bytes(original)


def check_chain_flip(load_path: Path, damaged: Path, region: Region, pos: int, xor: int, want: dict[str, Any],
                     tally: Tally, read: bool) -> None:
    """Flip one byte of a data file of checkpoint ``damaged``, a level of the chain that a load of
    ``load_path`` reads (the delta itself or its base), load and verify ``load_path``, restore.
    ``read``: whether that load reads the region's record (a base record of an item the delta
    stores whole is not read: its damage may go unseen, never into wrong tensors)."""
    f = damaged / region.file
    level = "delta" if damaged == load_path else "base"
    with _flipped(f, pos, xor):
        _judge(load_path, region, f"{level} {region.kind} {region.file}@{pos}^{xor:#04x}", want, tally,
               label=f"{level} {region.kind}", read=read, where=str(f))


def delta_items(path: Path) -> set[str]:
    """The items checkpoint ``path`` stores as differences from its base."""
    from nvdcp.dcp import descriptor

    md = nvdcp.NvcompReader(path).read_metadata()
    return {ix.fqn for ix, info in md.storage_data.items() if descriptor.is_delta(info)}


def chain_regions(delta: Path) -> list[tuple[Path, Region, bool]]:
    """Every region of the data files of ``delta`` (:func:`save_delta_sample`'s) and of its base,
    each with the checkpoint it lies in and whether a load of ``delta`` reads it (see
    :func:`check_chain_flip`)."""
    deltas = delta_items(delta)
    base = delta.parent / "base"
    out = [(delta, r, True) for r in regions(delta)]
    out += [(base, r, r.item is None or r.item in deltas) for r in regions(base)]
    return out


def _judge(path: Path, region: Region, case: str, want: dict[str, Any], tally: Tally,
           truncated: bool = False, label: str | None = None, read: bool = True, where: str | None = None) -> None:
    tally.cases += 1
    kind, err = load_outcome(path, want)
    report = nvdcp.verify_checkpoint(path, threads=1)
    damaged = [d for r in (report, *report.chain) for d in r.damaged]  # the bases' too
    label = label or region.kind
    tally.outcomes[f"{label}: load {kind}"] += 1
    tally.outcomes[f"{label}: verify {'found' if damaged else 'clean'}"] += 1
    problems = []
    if kind == "WRONG":
        problems.append("load returned wrong tensors")
    if not read:
        pass  # a record the load does not read: only wrong tensors are a breach
    elif region.kind == "file header" and not truncated:
        # Never read by load or verify (items are self-describing): tensors must come back intact.
        if kind != "intact":
            problems.append(f"file header flip broke the load: {kind}")
    else:
        if kind == "intact":
            problems.append("damage not detected at load")
        elif err is not None:
            msg = str(err)
            if (where or region.file) not in msg:
                problems.append(f"error does not name the file {where or region.file}: {msg}")
            if region.item and not truncated and repr(region.item) not in msg:
                problems.append(f"error does not name the item {region.item}: {msg}")
            if region.kind == "payload" and not truncated and "chunk" not in msg:
                problems.append(f"error does not name the chunk: {msg}")
        if not damaged:
            problems.append("verify_checkpoint found nothing")
        elif region.item and not any(repr(region.item) in d.item for d in damaged):
            problems.append(f"verify_checkpoint missed {region.item}: {damaged}")
    if problems:
        tally.failures.append(f"{case}: {'; '.join(problems)}")


def sample_positions(all_regions: list[Region], per_kind: dict[str, int], seed: int) -> list[tuple[Region, int, int]]:
    """``per_kind[k]`` random (region, position, xor) cases of each region kind ("all": every byte)."""
    rng = random.Random(seed)
    out: list[tuple[Region, int, int]] = []
    for kind, n in per_kind.items():
        spans = [(r, p) for r in all_regions if r.kind == kind for p in range(r.start, r.stop)]
        picked = spans if n < 0 or n >= len(spans) else rng.sample(spans, n)
        out += [(r, p, rng.randrange(1, 256)) for r, p in picked]
    return out


def truncation_lengths(all_regions: list[Region], n: int, seed: int) -> list[tuple[str, int]]:
    """Cuts at 0, 1, inside the file header, at every record boundary +-1, and random ones."""
    rng = random.Random(seed)
    by_file: dict[str, int] = {}
    for r in all_regions:
        by_file[r.file] = max(by_file.get(r.file, 0), r.stop)
    out: set[tuple[str, int]] = set()
    for file, size in by_file.items():
        marks = {0, 1, size - 1}
        for r in all_regions:
            if r.file == file:
                marks |= {r.start + 1, r.stop - 1}
        out |= {(file, m) for m in marks if 0 <= m < size}
        out |= {(file, rng.randrange(0, size)) for _ in range(n)}
    return sorted(out)


def check_metadata_flip(path: Path, pos: int, xor: int, want: dict[str, Any], tally: Tally) -> None:
    """Flip one byte of ``.metadata`` (no checksum of its own): any error is fine, wrong tensors not."""
    tally.cases += 1
    with _flipped(path / ".metadata", pos, xor):
        sd = empty_like_sd(want)
        try:
            nvdcp.NvcompReader(path).read_metadata()  # dcp.load turns its errors into AssertionError text
            dcp.load(sd, storage_reader=nvdcp.NvcompReader(path, thread_count=1, codec_threads=1))
            kind = "intact" if same_state(sd, want) else "WRONG"
        except (Exception, CheckpointException) as exc:
            err = failure_of(exc)
            kind = "NvdcpError" if isinstance(err, nvdcp.NvdcpError) else f"other error ({type(err).__name__})"
    tally.outcomes[f".metadata: load {kind}"] += 1
    if kind == "WRONG":
        tally.failures.append(f".metadata@{pos}^{xor:#04x}: load returned wrong tensors")


def run_cases(src: str, cases: list[tuple[str, Any, int, int]]) -> dict[str, Any]:
    """Run damage cases against a private copy of checkpoint ``src`` (a worker of the sweep).

    A case is ``("flip", region, pos, xor)``, ``("cut", file, length, 0)`` or ``("meta", None, pos, xor)``.
    """
    import shutil
    import tempfile

    work = Path(tempfile.mkdtemp(prefix="nvdcp-damage-")) / "ckpt"
    shutil.copytree(src, work)
    try:
        want = sample_state()
        all_regions = regions(work)
        tally = Tally()
        for kind, what, pos, xor in cases:
            if kind == "flip":
                check_flip(work, what, pos, xor, want, tally)
            elif kind == "cut":
                check_truncation(work, what, pos, want, tally, all_regions)
            else:
                check_metadata_flip(work, pos, xor, want, tally)
        return tally.as_dict() | {"failures": tally.failures}
    finally:
        shutil.rmtree(work.parent, ignore_errors=True)


def run_chain_cases(src: str, cases: list[tuple[str, Region, int, int, bool]]) -> dict[str, Any]:
    """Run chain damage cases against a private copy of ``src`` (the root of
    :func:`save_delta_sample`; a worker of the sweep). A case is ``(level, region, pos, xor,
    read)``: a byte of checkpoint ``level`` ("base" or "delta") flipped (:func:`check_chain_flip`)."""
    import shutil
    import tempfile

    work = Path(tempfile.mkdtemp(prefix="nvdcp-chain-damage-")) / "chain"
    shutil.copytree(src, work)  # the delta names its base by relative location: moved together
    try:
        want = next_state(sample_state())
        tally = Tally()
        for level, region, pos, xor, read in cases:
            check_chain_flip(work / "delta", work / level, region, pos, xor, want, tally, read)
        return tally.as_dict() | {"failures": tally.failures}
    finally:
        shutil.rmtree(work.parent, ignore_errors=True)

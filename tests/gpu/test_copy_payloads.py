"""The GPU decoder's staging of chunks already in memory (records read in runs): one gather copy
for every such segment of a pass, the same bytes as a copy per chunk, and a record too short for
its chunk table refused before anything is copied."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

pytest.importorskip("nvidia.nvcomp")

from nvdcp.errors import CorruptCheckpointError  # noqa: E402
from nvdcp.gpu.decoder import _copy_payloads  # noqa: E402


def _segment(rng: np.random.Generator, planes: int, blocks: int, first: int, last: int) -> Any:
    sizes = rng.integers(0, 500, planes * blocks).astype(np.int64)
    payload = rng.integers(0, 256, int(sizes.sum()), dtype=np.uint8)
    req = SimpleNamespace(payload=payload, header=SimpleNamespace(n_planes=planes), where=f"item of {blocks} blocks")
    return SimpleNamespace(req=req, first=first, last=last, sizes=sizes, slots=(last - first) * planes)


def test_payload_chunks_land_in_their_slots() -> None:
    rng = np.random.default_rng(5)
    # whole items, an empty one, and a later block range of a multi-block item
    segs = [_segment(rng, 4, 1, 0, 1), _segment(rng, 2, 3, 0, 3), _segment(rng, 4, 0, 0, 0),
            _segment(rng, 2, 5, 2, 4), _segment(rng, 1, 2, 0, 2)]
    stride = 512
    n = sum(s.slots for s in segs) + 3  # three slots of a segment read from storage, in between
    stored = np.zeros(n, dtype=np.int64)
    in_memory, k = [], 0
    for i, seg in enumerate(segs):
        if i == 2:
            k += 3
        p = seg.req.header.n_planes
        stored[k : k + seg.slots] = seg.sizes[seg.first * p : seg.last * p]
        in_memory.append((k, seg))
        k += seg.slots
    staging = np.full(n * stride, 0xEE, dtype=np.uint8)
    starts = np.arange(n, dtype=np.int64) * stride
    _copy_payloads(staging, starts, stored, in_memory)
    for k, seg in in_memory:
        p = seg.req.header.n_planes
        pos = int(seg.sizes[: seg.first * p].sum())
        for t in range(seg.slots):
            size = int(seg.sizes[seg.first * p + t])
            got = staging[starts[k + t] : starts[k + t] + size]
            assert np.array_equal(got, seg.req.payload[pos : pos + size]), (seg.req.where, t)
            assert (staging[starts[k + t] + size : starts[k + t] + stride] == 0xEE).all()  # nothing past it
            pos += size


def test_a_payload_shorter_than_its_chunks_is_refused() -> None:
    rng = np.random.default_rng(6)
    good, bad = _segment(rng, 2, 2, 0, 2), _segment(rng, 2, 2, 0, 2)
    bad.req.payload = bad.req.payload[:-1]
    bad.req.where = "item damaged"
    stored = np.concatenate([good.sizes, bad.sizes])
    staging = np.zeros(8 * 512, dtype=np.uint8)
    with pytest.raises(CorruptCheckpointError, match="item damaged: its chunks claim more bytes"):
        _copy_payloads(staging, np.arange(8, dtype=np.int64) * 512, stored, [(0, good), (4, bad)])
    assert not staging.any()  # refused before anything was copied

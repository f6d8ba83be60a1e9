"""Delta transforms (XOR, zigzag integer difference): exact inverses on every bit pattern, the
numpy (CPU path) and torch (GPU path) versions byte-identical, chains folded either way agree."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nvdcp.transform import delta as D


def _bytes(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def _edge_floats(dtype: torch.dtype) -> np.ndarray:
    vals = torch.tensor([0.0, -0.0, 1.0, -1.0, float("inf"), float("-inf"), float("nan")], dtype=torch.float32)
    t = vals.to(dtype)
    t = torch.cat([t, torch.tensor([torch.finfo(dtype).max, torch.finfo(dtype).min, torch.finfo(dtype).tiny],
                                   dtype=dtype)])
    return t.view(torch.uint8).numpy().copy()


@pytest.mark.parametrize("kind", D.KINDS)
@pytest.mark.parametrize("size", [2, 4, 8])
@pytest.mark.parametrize("native", [True, False])
def test_numpy_round_trip_on_any_bytes(kind: int, size: int, native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if not native:  # as on a machine without the native library
        monkeypatch.setattr(D, "_native", lambda symbol: None)
    raw, base = _bytes(size * 4096, 1), _bytes(size * 4096, 2)
    delta = D.encode_np(raw, base, kind, size)
    value = base.copy()
    D.apply_np(value, delta, kind, size)
    assert np.array_equal(value, raw)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_zigzag_round_trips_special_values_and_small_moves_have_zero_high_bytes(dtype: torch.dtype) -> None:
    size = dtype.itemsize
    edges = _edge_floats(dtype)
    both = np.concatenate([edges, edges[::-1].copy()])  # specials against other specials
    delta = D.encode_np(both, np.concatenate([edges, edges]), D.ZIGZAG_DIFF, size)
    value = np.concatenate([edges, edges])
    D.apply_np(value, delta, D.ZIGZAG_DIFF, size)
    assert np.array_equal(value, both)
    # one ulp up and down: the difference is +-1, zigzag 2 and 1: every other byte is zero
    x = torch.linspace(0.5, 1.5, 1000, dtype=torch.float64).to(dtype)
    xi = x.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[size])
    up = (xi + 1).view(dtype)
    d = D.encode_np(up.view(torch.uint8).numpy(), x.view(torch.uint8).numpy(), D.ZIGZAG_DIFF, size)
    assert set(d.reshape(-1, size)[:, 0].tolist()) == {2} and not d.reshape(-1, size)[:, 1:].any()


def test_kind_for_dtypes() -> None:
    assert D.kind_for(torch.float32) == D.kind_for(torch.bfloat16) == D.kind_for(torch.float64) == D.ZIGZAG_DIFF
    for dtype in (torch.int64, torch.int32, torch.bool, torch.uint8, torch.complex64, torch.float8_e4m3fn):
        assert D.kind_for(dtype) == D.XOR, dtype


@pytest.mark.parametrize("kind", D.KINDS)
@pytest.mark.parametrize("size", [2, 4, 8])
def test_torch_matches_numpy_and_a_chain_folds_top_down(kind: int, size: int) -> None:
    levels = [_bytes(size * 1000, s) for s in range(4)]  # root, then three later saves
    deltas = [D.encode_np(levels[i + 1], levels[i], kind, size) for i in range(3)]
    for i in range(3):
        got = D.encode_torch(torch.from_numpy(levels[i + 1]), torch.from_numpy(levels[i]), kind, size)
        assert np.array_equal(got.numpy(), deltas[i])
        base = torch.from_numpy(levels[i].copy())
        into = D.encode_into_base_torch(torch.from_numpy(levels[i + 1]), base, kind, size)
        assert into.data_ptr() == base.data_ptr() and np.array_equal(into.numpy(), deltas[i])
    # the GPU path's order: the top delta first, then each lower delta, then the root
    acc = torch.from_numpy(deltas[2].copy())
    D.to_difference_torch(acc, kind, size)
    D.accumulate_torch(acc, torch.from_numpy(deltas[1].copy()), kind, size, True)
    D.accumulate_torch(acc, torch.from_numpy(deltas[0].copy()), kind, size, True)
    D.accumulate_torch(acc, torch.from_numpy(levels[0].copy()), kind, size, False)
    assert np.array_equal(acc.numpy(), levels[3])


@pytest.mark.parametrize(("kind", "size"), [(D.XOR, 1), *[(k, s) for k in D.KINDS for s in (2, 4, 8)]])
@pytest.mark.parametrize("offset", [0, 1, 3])
def test_native_and_numpy_give_the_same_bytes_at_any_alignment(kind: int, size: int, offset: int) -> None:
    """The native one-pass functions (when built) against the numpy reference: same deltas, the
    same rebuilt bytes and the unchanged flag, on arrays that start at odd addresses (a record at
    any offset of a read buffer), lengths that are not a multiple of a vector."""
    if D._native("nvdcp_delta_encode") is None:
        pytest.skip("the native library is not built here")
    n = size * 1237
    raw = _bytes(n + offset, 3)[offset:]
    base = _bytes(n + offset, 4)[offset:]
    base[: n // 2] = raw[: n // 2]  # half unchanged
    want = D.encode_numpy(raw, base, kind, size)
    got, changed = D.delta_np(raw, base, kind, size)
    assert np.array_equal(got, want) and changed
    value = base.copy()
    D.apply_np(value, got, kind, size)
    assert np.array_equal(value, raw)
    reference = base.copy()
    D.apply_numpy(reference, want, kind, size)
    assert np.array_equal(reference, raw)
    same, changed = D.delta_np(raw, raw.copy(), kind, size)
    assert not changed and not same.any()


@pytest.mark.parametrize(("kind", "size", "n_planes"), [
    (D.XOR, 1, 1), (D.XOR, 4, 4), (D.XOR, 2, 1), *[(D.ZIGZAG_DIFF, s, p) for s in (2, 4, 8) for p in (1, s)],
])
@pytest.mark.parametrize("native", [True, False])
def test_delta_split_is_the_difference_split_into_planes_and_keeps_the_bytes(
    kind: int, size: int, n_planes: int, native: bool, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """delta_split (native one-pass, and its numpy fallback) writes exactly encode_numpy's
    difference, split into byte planes at each array's offset, and nothing else; keeps each raw
    array where asked, also where the keep is the array's own base; reports unchanged arrays."""
    if not native:
        monkeypatch.setattr(D, "_native_split", lambda: None)
    elif D._native_split() is None:
        pytest.skip("the native library is not built here")
    # empty, one element, a partial tile, tiles and a bit, odd addresses (offset 1 into a buffer)
    counts = [0, 1, 3, 4096, 4099, 9000]
    raws = [_bytes(c * size + 1, 10 + i)[1:] for i, c in enumerate(counts)]
    bases = [r.copy() for r in raws]
    for i, b in enumerate(bases):
        if i % 2:
            b[:: 5 + i] ^= 0x41  # some elements moved; the even ones unchanged
    keep_fresh = [np.zeros_like(r) if i % 3 else None for i, r in enumerate(raws)]
    per_plane = np.array([r.size // n_planes for r in raws], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(per_plane)[:-1]]).astype(np.int64)
    planes = np.full((n_planes, int(per_plane.sum()) + 7), 0xEE, dtype=np.uint8)  # 7 guard bytes per plane

    changed = D.delta_split(raws, bases, keep_fresh, kind, size, planes, offsets)

    for i, (raw, base) in enumerate(zip(raws, bases)):
        want = D.encode_numpy(raw, base, kind, size).reshape(-1, n_planes).T
        got = planes[:, offsets[i] : offsets[i] + per_plane[i]]
        assert np.array_equal(got, want), i
        assert changed[i] == bool(want.any()) == (i % 2 == 1 and raw.size > 0), i
        assert keep_fresh[i] is None or np.array_equal(keep_fresh[i], raw)
    assert (planes[:, -7:] == 0xEE).all()  # nothing written past the planes

    in_place = [b.copy() for b in bases]  # each array kept over its own base
    planes_again = np.zeros_like(planes)
    D.delta_split(raws, in_place, in_place, kind, size, planes_again, offsets)
    assert np.array_equal(planes_again[:, :-7], planes[:, :-7])
    assert all(np.array_equal(k, r) for k, r in zip(in_place, raws))

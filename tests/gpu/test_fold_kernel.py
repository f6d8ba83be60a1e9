"""The chain fold (nvdcp/gpu/fold.py) against the torch folds it replaces in the GPU delta load
(to_difference_torch, then accumulate_torch per level): the same bytes for XOR and zigzag items
of every element width, chains one to three levels deep ending in a delta or in bytes saved
whole, sizes with and without a tail, an empty item, and levels the kernel does not take (an
level not contiguous) folded with torch in order between kernel folds. On the device,
on the host under Triton's interpreter (no GPU needed; skipped without triton, as in CI), and
the torch-only folder everywhere."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nvdcp.gpu.fold import TILE, ChainFolder, FoldPlan
from nvdcp.transform.delta import XOR, ZIGZAG_DIFF, accumulate_torch, to_difference_torch
from tests.gpu.interpreted import run_interpreted

#: (kind, element size, elements, levels below the top, whether the bottom level is a delta)
CASES = [
    (ZIGZAG_DIFF, 2, 5, 1, False),
    (ZIGZAG_DIFF, 2, TILE * 3 + 7, 2, False),
    (ZIGZAG_DIFF, 4, TILE + 1, 1, True),
    (ZIGZAG_DIFF, 4, 100, 3, False),
    (ZIGZAG_DIFF, 8, 33, 2, False),
    (XOR, 4, 999, 2, False),
    (XOR, 1, TILE * 5, 1, False),
    (ZIGZAG_DIFF, 2, 0, 1, False),
]


def _bytes(rng: np.random.Generator, n: int, device: torch.device, strided: bool = False) -> torch.Tensor:
    """``n`` random bytes as a flat uint8 tensor; ``strided``: every other byte of a larger one."""
    data = torch.from_numpy(rng.integers(0, 256, size=2 * n, dtype=np.uint8)).to(device)
    return data[::2] if strided else data[:n]


def _reference(top: torch.Tensor, levels: list[tuple[torch.Tensor, bool]], kind: int, size: int) -> torch.Tensor:
    acc = top.clone()
    if acc.numel():
        to_difference_torch(acc, kind, size)
        for level, is_delta in levels:
            accumulate_torch(acc, level.clone(), kind, size, is_delta)
    return acc


def check_fold(device: torch.device, seed: int, kernel: bool) -> None:
    """Assert the folder gives the torch folds' bytes (with ``kernel``, the kernel must run here)."""
    rng = np.random.default_rng(seed)
    chains = []
    for kind, size, elements, depth, bottom_delta in CASES:
        n = elements * size
        top = _bytes(rng, n, device)
        # the XOR case's first level is strided: the torch fallback, between kernel folds
        levels = [(_bytes(rng, n, device, strided=(kind == XOR and size == 4 and d == 0)), d < depth - 1 or bottom_delta)
                  for d in range(depth)]
        chains.append((top, levels, kind, size, _reference(top, levels, kind, size)))
    if kernel:
        assert not FoldPlan().add(chains[5][0], chains[5][1][0][0], XOR, 4, False, False)  # strided
        off = _bytes(rng, 10, device)[1:9]
        assert not FoldPlan().add(off, off.clone(), ZIGZAG_DIFF, 4, True, True)  # off the element width
    folder = ChainFolder(kernel=kernel)
    for top, _, kind, size, _ in chains:
        folder.top(top, True, kind, size)
    for d in range(max(len(levels) for _, levels, _, _, _ in chains)):
        for top, levels, kind, size, _ in chains:
            if d < len(levels):
                folder.fold(top, levels[d][0], kind, size, levels[d][1])
        folder.end_level()
    folder.finish()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    for i, (top, _, _, _, want) in enumerate(chains):
        assert torch.equal(top, want), i


@pytest.mark.parametrize("seed", range(2))
def test_torch_folder_gives_the_torch_folds(seed: int) -> None:
    check_fold(torch.device("cpu"), seed, kernel=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("seed", range(3))
def test_kernel_fold_gives_the_torch_folds(seed: int) -> None:
    pytest.importorskip("triton")
    check_fold(torch.device("cuda", 0), seed, kernel=True)


def test_kernel_fold_on_the_host_under_the_interpreter() -> None:
    pytest.importorskip("triton")
    code = ("import torch; from tests.gpu.test_fold_kernel import check_fold\n"
            "for seed in range(2):\n    check_fold(torch.device('cpu'), seed, kernel=True)\nprint('fold ok')")
    done = run_interpreted(["-c", code], ("NVDCP_GPU_FOLD",))
    assert "fold ok" in done.stdout

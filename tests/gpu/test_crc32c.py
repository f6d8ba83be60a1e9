"""CRC32C on the device (nvdcp.gpu.crc32c): the tables and the combine math against the crc32c
package on every machine; the Triton kernel in Triton's interpreter (a subprocess, where Triton is
installed) and on a real GPU (``gpu`` marker)."""

from __future__ import annotations

import json
import textwrap

import crc32c as crc32c_pkg
import numpy as np
import pytest
import torch

from nvdcp.format.crc import checksum_ranges
from nvdcp.gpu.crc32c import byte_table, reference_ranges, tables
from tests.gpu.interpreted import run_interpreted

LENGTHS = [0, 1, 2, 3, 4, 5, 7, 8, 31, 63, 64, 65, 255, 256, 257, 511, 512, 513, 1000]


def _cases(rng: np.random.Generator, size: int, lengths: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    buf = rng.integers(0, 256, size=size, dtype=np.uint8)
    offs = np.asarray([int(rng.integers(0, size - n + 1)) for n in lengths], dtype=np.int64)
    return buf, offs, np.asarray(lengths, dtype=np.int64)


def _package(buf: np.ndarray, offs: np.ndarray, lens: np.ndarray) -> np.ndarray:
    return np.asarray([crc32c_pkg.crc32c(buf[o : o + n].tobytes()) for o, n in zip(offs, lens)], dtype=np.uint32)


def test_byte_table_is_the_castagnoli_table() -> None:
    t = byte_table()
    assert t[1] == 0xF26B8303 and t[128] == 0x82F63B78 and t[255] == 0xAD7D5351


@pytest.mark.parametrize("tile", [4, 16, 64, 256])
def test_blocked_algorithm_equals_crc32c(tile: int) -> None:
    rng = np.random.default_rng(tile)
    buf, offs, lens = _cases(rng, 3000, LENGTHS + [tile - 1, tile, tile + 1, 2 * tile + 3])
    assert (reference_ranges(buf, offs, lens, tile) == _package(buf, offs, lens)).all()


def test_unshift_inverts_shift() -> None:
    _, shift1, unshift = tables(4)
    position, shift, unshift256 = tables(256)
    assert position.shape == (8, 256) and shift.shape == (32,) and unshift256.shape == (256, 32)
    # shift_{-1} after shift_1 is the identity, column by column
    cols = (1 << np.arange(32, dtype=np.uint64)).astype(np.uint32)
    t = byte_table()
    once = t[cols & 0xFF] ^ (cols >> np.uint32(8))
    back = np.asarray([
        np.bitwise_xor.reduce(np.where((int(v) >> np.arange(32)) & 1, unshift256[1], 0).astype(np.uint32)) for v in once
    ], dtype=np.uint32)
    assert (back == cols).all()


_INTERPRETED = textwrap.dedent("""
    import json, sys
    import numpy as np, torch
    from nvdcp.gpu.crc32c import checksum_ranges_device
    case = json.loads(sys.argv[1])
    buf = torch.tensor(case["buf"], dtype=torch.uint8)
    crcs, bad = checksum_ranges_device(buf, np.asarray(case["offs"]), np.asarray(case["lens"]),
                                       torch.tensor(case["expected"], dtype=torch.int32), tile=case["tile"])
    print(json.dumps({"crcs": crcs.numpy().view(np.uint32).tolist(), "bad": bad.tolist()}))
""")


@pytest.mark.parametrize("tile", [16, 64])
def test_triton_kernel_in_the_interpreter(tile: int) -> None:
    pytest.importorskip("triton")
    rng = np.random.default_rng(7)
    lens = [0, 1, 3, 4, 5, tile - 1, tile, tile + 1, 2 * tile + 5, 200]
    buf, offs, lengths = _cases(rng, 600, lens)
    want = _package(buf, offs, lengths)
    expected = want.copy()
    expected[[2, 6]] ^= 0x10  # two ranges whose CRC "does not match"
    case = {"buf": buf.tolist(), "offs": offs.tolist(), "lens": lens, "tile": tile,
            "expected": expected.view(np.int32).tolist()}
    ran = run_interpreted(["-c", _INTERPRETED, json.dumps(case)], ("NVDCP_DEVICE_CRC",))
    got = json.loads(ran.stdout.strip().splitlines()[-1])
    assert got["crcs"] == want.tolist()
    assert got["bad"] == [2, 2]


# -- on a GPU ---------------------------------------------------------------------------------
def _device_crc_or_skip() -> None:
    from nvdcp.gpu.crc32c import device_crc_available

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if not device_crc_available():
        pytest.skip("needs triton")


@pytest.mark.gpu
def test_device_crc_equals_host_crc_on_every_length() -> None:
    _device_crc_or_skip()
    from nvdcp.gpu.crc32c import checksum_ranges_device

    rng = np.random.default_rng(1)
    lens = list(range(0, 1100)) + [4095, 4096, 4097, 65535, 65536, 65537, 1 << 20, (1 << 20) + 3]
    buf, offs, lengths = _cases(rng, 3 << 20, lens)
    host = checksum_ranges(buf, offs, lengths)
    assert (host == _package(buf, offs, lengths)).all()
    dev = torch.from_numpy(buf).cuda()
    crcs, bad = checksum_ranges_device(dev, offs, lengths)
    assert bad is None
    assert (crcs.cpu().numpy().view(np.uint32) == host).all()
    # odd offsets inside a larger buffer, and offsets/lengths given as device tensors
    crcs2, _ = checksum_ranges_device(dev, torch.from_numpy(offs).cuda(), torch.from_numpy(lengths).cuda())
    assert torch.equal(crcs, crcs2)


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [64, 128, 256, 512])
def test_device_crc_other_tiles(tile: int) -> None:
    _device_crc_or_skip()
    from nvdcp.gpu.crc32c import checksum_ranges_device

    rng = np.random.default_rng(tile)
    buf, offs, lengths = _cases(rng, 1 << 18, [0, 1, 5, tile - 1, tile, tile + 1, 5 * tile + 7, 65536, 100_000])
    crcs, _ = checksum_ranges_device(torch.from_numpy(buf).cuda(), offs, lengths, tile=tile)
    assert (crcs.cpu().numpy().view(np.uint32) == _package(buf, offs, lengths)).all()


@pytest.mark.gpu
def test_device_check_counts_mismatches_and_names_the_first() -> None:
    _device_crc_or_skip()
    from nvdcp.gpu.crc32c import checksum_ranges_device

    rng = np.random.default_rng(3)
    buf, offs, lengths = _cases(rng, 1 << 20, [int(n) for n in rng.integers(0, 65536, size=300)])
    want = _package(buf, offs, lengths)
    expected = torch.from_numpy(want.view(np.int32).copy())
    _, bad = checksum_ranges_device(torch.from_numpy(buf).cuda(), offs, lengths, expected)
    assert bad is not None and bad.tolist() == [0, 2**31 - 1]
    expected[[17, 250, 40]] ^= 1
    _, bad = checksum_ranges_device(torch.from_numpy(buf).cuda(), offs, lengths, expected)
    assert bad is not None and bad.tolist() == [3, 17]

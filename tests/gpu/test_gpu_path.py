"""The nvCOMP GPU path on a real GPU: round trips, interop with the CPU path, bounds, streams.

Run on the H200 device machine (DEVELOPERS.md); skipped without CUDA and nvidia-nvcomp-cu12.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import nvdcp
from nvdcp.gpu.config import GpuConfig
from tests.conftest import ALL_DTYPES, bit_equal, random_tensor, weights_like

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda", 0)


def _state(device: torch.device) -> dict[str, torch.Tensor]:
    sd = {
        "w32": weights_like((1024, 1000)).to(device),
        "w16": weights_like((700, 1300), torch.bfloat16, seed=1).to(device),
        "half": weights_like((3333,), torch.float16, seed=2).to(device),
        "ids": torch.arange(100_000, device=device),
        "mask": (torch.rand(9999, device=device) > 0.5),
        "scalar": torch.tensor(3.25, device=device),
        "empty": torch.empty(0, 7, device=device),
        "view": weights_like((300, 400), seed=4).to(device)[:, ::3],
        "rand": random_tensor(torch.float32, (50_000,), seed=5).to(device),
    }
    return sd


def _zeros_like(sd: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: torch.zeros(v.shape, dtype=v.dtype, device=device) for k, v in sd.items()}


@pytest.mark.parametrize("codec", ["auto", "gdeflate", "zstd", "none", "ans", "bitcomp"])
def test_gpu_round_trip_into_gpu(tmp_path: Path, codec: str) -> None:
    sd = _state(CUDA)
    dcp.save(sd, storage_writer=nvdcp.NvcompWriter(tmp_path, codec=codec))
    out = _zeros_like(sd, CUDA)
    dcp.load(out, storage_reader=nvdcp.NvcompReader(tmp_path))
    for k in sd:
        assert bit_equal(out[k].cpu(), sd[k].contiguous().cpu()), (codec, k)


@pytest.mark.parametrize("decode_device", ["cuda", "cpu"])
def test_gpu_written_loads_into_cpu_tensors(tmp_path: Path, decode_device: str) -> None:
    sd = _state(CUDA)
    dcp.save(sd, storage_writer=nvdcp.NvcompWriter(tmp_path))
    out = _zeros_like(sd, torch.device("cpu"))
    dcp.load(out, storage_reader=nvdcp.NvcompReader(tmp_path, gpu=GpuConfig(decode_device=decode_device)))
    for k in sd:
        assert bit_equal(out[k], sd[k].contiguous().cpu()), k


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype_on_gpu(tmp_path: Path, dtype: torch.dtype) -> None:
    sd = {f"t{i}": random_tensor(dtype, shape, seed=i).to(CUDA) for i, shape in enumerate([(), (0,), (5,), (70_001,), (3, 40_000)])}
    dcp.save(sd, storage_writer=nvdcp.NvcompWriter(tmp_path))
    out = _zeros_like(sd, CUDA)
    dcp.load(out, storage_reader=nvdcp.NvcompReader(tmp_path))
    for k in sd:
        assert bit_equal(out[k].cpu(), sd[k].cpu()), k


def test_items_larger_than_the_gpu_budget(tmp_path: Path) -> None:
    budget = 16 << 20
    sd = {"big": weights_like((40 << 20) // 4,).to(CUDA), "big16": weights_like((30 << 20) // 2,).bfloat16().to(CUDA),
          "small": torch.ones(10, device=CUDA)}
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    cfg = GpuConfig(gpu_memory_bytes=budget)
    dcp.save(sd, storage_writer=nvdcp.NvcompWriter(tmp_path, gpu=cfg))
    peak_extra = torch.cuda.max_memory_allocated() - base
    assert peak_extra <= budget * 1.25, peak_extra
    out = _zeros_like(sd, CUDA)
    dcp.load(out, storage_reader=nvdcp.NvcompReader(tmp_path, gpu=cfg))
    for k in sd:
        assert bit_equal(out[k].cpu(), sd[k].cpu()), k


def test_a_load_under_a_gpu_bound_holds_nvcomps_zstd_workspace_within_it(tmp_path: Path) -> None:
    """Zstd's decode workspace grows with the chunks of a call (about 0.2 MiB a 64 KiB chunk):
    under ``gpu_memory_bytes`` a load sets a quarter aside for it and splits its calls."""
    from nvdcp.gpu.nvcomp_batch import WORKSPACES

    sd = {"w": weights_like((96 << 20) // 4,).to(CUDA), "b": weights_like((40 << 20) // 2, seed=1).bfloat16().to(CUDA)}
    dcp.save(sd, storage_writer=nvdcp.NvcompWriter(tmp_path, codec="zstd"))
    bound = 24 << 20
    out = _zeros_like(sd, CUDA)
    WORKSPACES.release()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    dcp.load(out, storage_reader=nvdcp.NvcompReader(tmp_path, gpu=GpuConfig(gpu_memory_bytes=bound)))
    peak_extra = torch.cuda.max_memory_allocated() - base
    assert peak_extra <= bound + (1 << 20), peak_extra  # + the calls' chunk tables and results (KiB each)
    for k in sd:
        assert bit_equal(out[k].cpu(), sd[k].cpu()), k


def test_many_small_tensors_batch(tmp_path: Path) -> None:
    sd = {f"p{i}": weights_like((16 + i % 50, 33), seed=i).to(CUDA) for i in range(2000)}
    dcp.save(sd, storage_writer=nvdcp.NvcompWriter(tmp_path))
    out = _zeros_like(sd, CUDA)
    dcp.load(out, storage_reader=nvdcp.NvcompReader(tmp_path))
    assert all(torch.equal(out[k], sd[k]) for k in sd)


def test_tensor_written_on_a_side_stream_just_before_save(tmp_path: Path) -> None:
    side = torch.cuda.Stream()
    x = torch.zeros(64 << 20, device=CUDA)
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # keep the stream busy so an unsynchronized read sees zeros
        x.fill_(1.5)
        with torch.cuda.stream(side):
            dcp.save({"x": x}, storage_writer=nvdcp.NvcompWriter(tmp_path))
    out = {"x": torch.zeros_like(x)}
    dcp.load(out, storage_reader=nvdcp.NvcompReader(tmp_path))
    assert torch.equal(out["x"], torch.full_like(x, 1.5))


def test_cpu_written_golden_loads_on_gpu() -> None:
    import json

    from tests.format.test_golden import GOLDEN
    from tests.golden.make_golden import digest, golden_state

    expected = json.loads((GOLDEN / "expected.json").read_text())
    for codec in ("zstd", "gdeflate", "none"):
        sd = {k: v.to(CUDA) for k, v in golden_state().items() if isinstance(v, torch.Tensor)}
        for v in sd.values():
            v.zero_()
        dcp.load(sd, storage_reader=nvdcp.NvcompReader(GOLDEN / codec, gpu=GpuConfig(decode_device="cuda")))
        for k, v in sd.items():
            assert digest(v.cpu()) == expected[k], (codec, k)


def test_write_gpu_golden_for_cpu_interop() -> None:
    """Writes GPU-made checkpoints of the golden state; the CPU suite decodes the committed copies."""
    from tests.golden.make_golden import golden_state

    out = Path(os.environ.get("NVDCP_GPU_GOLDEN_OUT", "/tmp/nvdcp-gpu-golden"))
    for codec in ("auto", "ans"):
        target = out / f"gpu_{codec}"
        shutil.rmtree(target, ignore_errors=True)
        sd = {k: (v.to(CUDA) if isinstance(v, torch.Tensor) else v) for k, v in golden_state().items()}
        dcp.save(sd, storage_writer=nvdcp.NvcompWriter(target, codec=codec))
        assert (target / ".metadata").exists()


@pytest.mark.parametrize("chunk_bytes", [1024, 3000, 1025, 65536])
def test_any_chunk_size_round_trips_on_gpu(tmp_path: Path, chunk_bytes: int) -> None:
    # Chunk sizes that are not multiples of 8 leave slots and nvCOMP buffers unaligned.
    g = torch.Generator(device="cuda").manual_seed(chunk_bytes)
    sd = {"w": torch.randn(70_001, device="cuda", generator=g), "h": torch.randn(333, device="cuda", generator=g).half(),
          "i": torch.arange(5_000, device="cuda", dtype=torch.int32)}
    dcp.save(sd, storage_writer=nvdcp.NvcompWriter(tmp_path, chunk_bytes=chunk_bytes))
    for device in ("cuda", "cpu"):
        out = {k: torch.zeros_like(v, device=device) for k, v in sd.items()}
        dcp.load(out, storage_reader=nvdcp.NvcompReader(tmp_path, gpu=GpuConfig(decode_device=device)))
        for k in sd:
            assert bit_equal(out[k].cpu(), sd[k].cpu()), (k, device)


def test_auto_decodes_small_cpu_codec_records_for_host_tensors_on_the_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """decode_device="auto": host-bound records of a CPU codec up to 4 MiB decode on the CPU
    (batched there); GDeflate records (GPU-written) go through the GPU. Bit-exact either way."""
    from nvdcp.dcp import reader as reader_module

    host = {f"p{i}": weights_like((500 + i,), seed=i) for i in range(30)}
    dcp.save(host, storage_writer=nvdcp.NvcompWriter(tmp_path / "zstd"))  # CPU tensors: zstd
    dcp.save(_state(CUDA), storage_writer=nvdcp.NvcompWriter(tmp_path / "gdeflate"))
    batches: list[int] = []
    real = reader_module.NvcompReader._load_gpu_batch

    def spy(self: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        batches.append(len(batch))
        return real(self, batch, *args, **kwargs)

    monkeypatch.setattr(reader_module.NvcompReader, "_load_gpu_batch", spy)
    out = _zeros_like(host, torch.device("cpu"))
    dcp.load(out, storage_reader=nvdcp.NvcompReader(tmp_path / "zstd"))
    assert batches == [] and all(bit_equal(out[k], host[k]) for k in host)
    gpu_written = _zeros_like(_state(CUDA), torch.device("cpu"))
    dcp.load(gpu_written, storage_reader=nvdcp.NvcompReader(tmp_path / "gdeflate"))
    assert sum(batches) > 0


def test_cpu_written_float_planes_decode_on_gpu(tmp_path: Path) -> None:
    """The CPU path's frames for float sign+exponent planes (nvdcp.codecs.zstd_literals: no match
    search, literals Huffman-coded) decode with nvCOMP's Zstd, small items and large ones."""
    from nvdcp.codecs.zstd_literals import literals_compressor

    assert literals_compressor() is not None, "zstandard's cffi backend: pip install zstandard[cffi]"
    sd = {
        "w32": weights_like((1024, 1000)),
        "w16": weights_like((700, 1300), torch.bfloat16, seed=1),
        "half": weights_like((3333,), torch.float16, seed=2),
        **{f"small{i}": weights_like((64 * (i + 1),), seed=10 + i) for i in range(40)},
    }
    dcp.save(sd, storage_writer=nvdcp.NvcompWriter(tmp_path))  # host tensors: the CPU path writes
    out = _zeros_like(sd, CUDA)
    dcp.load(out, storage_reader=nvdcp.NvcompReader(tmp_path, gpu=GpuConfig(decode_device="cuda")))
    for k in sd:
        assert bit_equal(out[k].cpu(), sd[k]), k


def test_a_gpu_save_holds_a_short_switch_interval_and_gives_it_back_and_a_load_leaves_it(tmp_path: Path) -> None:
    """nvdcp.gpu.gil: a save with GPU work runs under the 0.5 ms interval, seen from a sampling
    thread, and the caller's value is back after; loads do not set it (measured no faster)."""
    import sys
    import threading

    from nvdcp.gpu import gil

    seen: list[float] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            seen.append(sys.getswitchinterval())
            stop.wait(0.0001)

    before = sys.getswitchinterval()
    sd = {f"t{i}": weights_like((512, 1024), seed=i).to(CUDA) for i in range(32)}
    out = _zeros_like(sd, CUDA)
    for op in ("save", "load"):
        seen.clear()
        stop.clear()
        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            if op == "save":
                dcp.save(sd, storage_writer=nvdcp.NvcompWriter(tmp_path))
            else:
                dcp.load(out, storage_reader=nvdcp.NvcompReader(tmp_path))
        finally:
            stop.set()
            sampler.join()
        want = min(before, gil.GPU_SWITCH_INTERVAL) if op == "save" else before
        assert min(seen) == pytest.approx(want), op
        assert sys.getswitchinterval() == before, op
    for k in sd:
        assert bit_equal(out[k].cpu(), sd[k].cpu()), k

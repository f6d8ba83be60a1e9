"""The GPU save and load pipelines with chunk checksums on the device: records equal to the host
checksums', bit-exact round trips through several buckets and passes, decoding straight into the
destination, and a damaged chunk caught on load and named (file, item, chunk).

Run on the H200 device machine (DEVELOPERS.md); skipped without CUDA, nvidia-nvcomp-cu12 or triton.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

import nvdcp
from nvdcp.errors import CorruptCheckpointError
from nvdcp.format.header import parse_item_header_only
from nvdcp.gpu.config import GpuConfig
from nvdcp.pipeline.config import EncodeConfig
from nvdcp.pipeline.encoder import ItemEncoder
from nvdcp.testing import failure_of
from tests.conftest import bit_equal, has_cuda_nvcomp, random_tensor, weights_like
from tests.gpu import bound_with_room

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not has_cuda_nvcomp(), reason="needs an NVIDIA GPU with CUDA and nvidia-nvcomp-cu12"),
]
CUDA = torch.device("cuda", 0)
MiB = 1 << 20


@pytest.fixture(autouse=True)
def _needs_device_crc() -> None:
    from nvdcp.gpu.crc32c import device_crc_available

    if not device_crc_available():
        pytest.skip("triton is not importable: no device checksums")


def _state(n_big: int = 6, n_small: int = 300) -> dict[str, torch.Tensor]:
    sd: dict[str, torch.Tensor] = {}
    for i in range(n_big):
        sd[f"big{i}"] = weights_like((1024, 1500 + 17 * i), seed=i).to(CUDA)
    for i in range(n_small):
        shape = (int(np.random.default_rng(i).integers(1, 3000)),)
        sd[f"small{i}"] = random_tensor(torch.bfloat16 if i % 3 else torch.float32, shape, seed=100 + i).to(CUDA)
    sd["empty"] = torch.empty(0, 5, device=CUDA)
    sd["odd"] = weights_like((333, 77), seed=9).to(CUDA)[:, 1::2]
    return sd


def _records(enc: ItemEncoder, sd: dict[str, torch.Tensor]) -> dict[str, bytes]:
    out = {}
    for key, item in enc.encode_items(sd.items(), str):
        out[key] = item.header_bytes + b"".join(bytes(c) for c in item.chunks)
    return out


@pytest.mark.parametrize("codec", ["auto", "zstd", "none"])
def test_device_checksums_give_the_host_checksums_records(codec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    sd = _state(n_small=50)
    small = GpuConfig(gpu_memory_bytes=bound_with_room(codec, 64 * MiB, 32 * MiB), pinned_memory_bytes=32 * MiB)  # many buckets
    enc = ItemEncoder(EncodeConfig(codec=codec), small)
    try:
        on_device = _records(enc, sd)
        monkeypatch.setenv("NVDCP_DEVICE_CRC", "0")
        from nvdcp.gpu import crc32c

        crc32c.device_crc_available.cache_clear()
        host = ItemEncoder(EncodeConfig(codec=codec), small)
        try:
            on_host = _records(host, sd)
        finally:
            host.close()
            monkeypatch.delenv("NVDCP_DEVICE_CRC")
            crc32c.device_crc_available.cache_clear()
    finally:
        enc.close()
    assert on_device == on_host


@pytest.mark.parametrize("thread_count", [1, 4])
def test_round_trip_through_many_buckets_and_passes(tmp_path: Path, thread_count: int) -> None:
    sd = _state()
    gpu = GpuConfig(gpu_memory_bytes=32 * MiB, pinned_memory_bytes=16 * MiB)
    dcp.save(sd, storage_writer=nvdcp.NvcompWriter(tmp_path, thread_count=thread_count, gpu=gpu))
    out = {k: torch.full_like(v.contiguous(), 7) for k, v in sd.items()}
    reader = nvdcp.NvcompReader(tmp_path, gpu=gpu)
    dcp.load(out, storage_reader=reader)
    for k in sd:
        assert bit_equal(out[k].cpu(), sd[k].contiguous().cpu()), k
    host = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in sd.items()}
    dcp.load(host, storage_reader=nvdcp.NvcompReader(tmp_path))
    for k in sd:
        assert bit_equal(host[k], sd[k].contiguous().cpu()), k


def test_decode_many_writes_straight_into_out(tmp_path: Path) -> None:
    from nvdcp.gpu.decoder import GpuDecoder

    enc = ItemEncoder(EncodeConfig(codec="auto"), GpuConfig(gpu_memory_bytes=64 * MiB))
    sd = {f"t{i}": weights_like((512, 700 + i), seed=i).to(CUDA) for i in range(5)}
    try:
        records = _records(enc, sd)
    finally:
        enc.close()
    decoder = GpuDecoder(CUDA, budget_bytes=6 * MiB, pinned_bytes=8 * MiB)  # several passes per item
    _check_decoded_into_destinations(decoder, records, sd, flat_bytes=True)


def _check_decoded_into_destinations(decoder: Any, records: dict[str, bytes], sd: dict[str, torch.Tensor],
                                     flat_bytes: bool) -> None:
    """Decode every record into a zeroed tensor like its item (given as flat bytes, or as the
    tensor itself): the outputs are those tensors, bit-equal to the items."""
    from nvdcp.gpu.decoder import DecodeRequest

    requests, dests = [], []
    for key, rec in records.items():
        header = parse_item_header_only(memoryview(rec), key)
        dest = torch.zeros_like(sd[key])
        dests.append(dest)
        payload = np.frombuffer(rec, dtype=np.uint8)[header.header_bytes :]
        out = dest.view(-1).view(torch.uint8) if flat_bytes else dest
        requests.append(DecodeRequest(header, sd[key].dtype, key, payload=payload, out=out))
    outs = decoder.decode_many(requests)
    for out, dest, key in zip(outs, dests, records):
        assert out.data_ptr() == dest.data_ptr()
        assert bit_equal(dest.cpu(), sd[key].cpu()), key


@pytest.mark.parametrize("fused", [True, False], ids=["fused-merge", "torch-merge"])
def test_decode_many_writes_into_destinations_of_any_dtype_and_shape(fused: bool) -> None:
    # The reader hands the destination tensors themselves (no flat uint8 view per item): the
    # fused merge writes by address, the torch merge views them as bytes.
    from nvdcp.gpu.decoder import DecodeRequest, GpuDecoder

    enc = ItemEncoder(EncodeConfig(codec="auto"), GpuConfig(gpu_memory_bytes=64 * MiB))
    sd = {
        "bf16": weights_like((300, 70), seed=1).to(torch.bfloat16).to(CUDA),
        "fp32_3d": weights_like((4, 50, 33), seed=2).to(CUDA),
        "scalar": torch.tensor(3.25, device=CUDA),
        "int64": torch.arange(1000, device=CUDA),
    }
    try:
        records = _records(enc, sd)
    finally:
        enc.close()
    decoder = GpuDecoder(CUDA, budget_bytes=6 * MiB, pinned_bytes=8 * MiB)
    if not fused:
        decoder.fused = False  # as with NVDCP_GPU_MERGE=0 (merge_available() is cached)
    assert decoder.fused == fused
    _check_decoded_into_destinations(decoder, records, sd, flat_bytes=False)
    header = parse_item_header_only(memoryview(records["bf16"]), "bf16")
    payload = np.frombuffer(records["bf16"], dtype=np.uint8)[header.header_bytes :]
    too_small = torch.zeros(300, 69, dtype=torch.bfloat16, device=CUDA)
    with pytest.raises(ValueError, match="bf16: out must be a contiguous tensor of 42000 bytes"):
        decoder.decode_many([DecodeRequest(header, torch.bfloat16, "bf16", payload=payload, out=too_small)])


def _damage_chunk(path: Path, item: str, chunk: int) -> tuple[str, int]:
    """Flip one byte of a stored chunk of ``item``; returns the file name and the chunk's position."""
    reader = nvdcp.NvcompReader(path)
    md = reader.read_metadata()
    (index,) = [ix for ix in md.storage_data if ix.fqn == item]
    info = md.storage_data[index]
    data_file = path / info.relative_path
    blob = bytearray(data_file.read_bytes())
    header = parse_item_header_only(memoryview(bytes(blob[info.offset : info.offset + info.length])), item)
    at = info.offset + header.header_bytes + sum(s for s, _ in header.chunks[:chunk]) + header.chunks[chunk][0] // 2
    blob[at] ^= 0x40
    data_file.write_bytes(bytes(blob))
    return info.relative_path, at


@pytest.mark.parametrize("destination", ["cuda", "cpu"])
def test_damaged_chunk_is_caught_on_load_and_named(tmp_path: Path, destination: str) -> None:
    from torch.distributed.checkpoint.api import CheckpointException

    sd = _state(n_big=3, n_small=20)
    dcp.save(sd, storage_writer=nvdcp.NvcompWriter(tmp_path))
    name, _ = _damage_chunk(tmp_path, "big1", 5)
    out = {k: torch.zeros(v.shape, dtype=v.dtype, device=destination) for k, v in sd.items()}
    reader = nvdcp.NvcompReader(tmp_path, gpu=GpuConfig(decode_device="cuda"))
    reader.reread_attempts = 0
    with pytest.raises(CheckpointException) as info:
        dcp.load(out, storage_reader=reader)
    err = failure_of(info.value)
    assert isinstance(err, CorruptCheckpointError), err
    msg = str(err)
    assert name in msg and "'big1'" in msg and "chunk 5 " in msg and "checksum mismatch" in msg, msg


@pytest.mark.parametrize("merge", ["kernel", "torch"])
def test_many_dtypes_decode_into_their_destinations(tmp_path: Path, merge: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every plane count (1, 2, 4, 8, 16 bytes), byte planes and raw items, 0-d and empty
    tensors, into GPU destinations and into new tensors (resharded requests, CPU targets): the
    per-pass merge kernel and the item-by-item torch merge give the same bytes."""
    from nvdcp.gpu import decoder as decoder_mod
    from nvdcp.gpu import merge as merge_mod

    if merge == "torch":
        monkeypatch.setattr(decoder_mod, "merge_available", lambda: False)
    elif not merge_mod.merge_available():
        pytest.skip("the merge kernel does not run here")
    rng = np.random.default_rng(3)
    sd: dict[str, torch.Tensor] = {}
    dtypes = [torch.uint8, torch.int8, torch.bool, torch.float16, torch.bfloat16, torch.int16, torch.float32,
              torch.int32, torch.float64, torch.int64, torch.complex64, torch.complex128]
    for i in range(240):
        dtype = dtypes[i % len(dtypes)]
        n = int(rng.integers(0, 40_000)) if i % 7 else int(rng.integers(100_000, 300_000))
        sd[f"t{i}"] = random_tensor(dtype, (n,), seed=i).to(CUDA)
    sd["scalar"] = torch.tensor(3.25, device=CUDA)
    sd["matrix"] = weights_like((257, 129), seed=4).to(CUDA)
    gpu = GpuConfig(gpu_memory_bytes=32 * MiB, pinned_memory_bytes=16 * MiB)
    # written by the CPU path (every dtype; the GPU writer's own records are covered above)
    dcp.save({k: v.cpu() for k, v in sd.items()}, storage_writer=nvdcp.NvcompWriter(tmp_path))
    out = {k: torch.full_like(v, 1) if v.dtype != torch.bool else torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(out, storage_reader=nvdcp.NvcompReader(tmp_path, gpu=gpu))
    for k in sd:
        assert bit_equal(out[k].cpu(), sd[k].cpu()), k
    host = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in sd.items()}  # new tensors, then copies
    dcp.load(host, storage_reader=nvdcp.NvcompReader(tmp_path, gpu=GpuConfig(decode_device="cuda")))
    for k in sd:
        assert bit_equal(host[k], sd[k].cpu()), k

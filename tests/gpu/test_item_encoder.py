"""ItemEncoder on CUDA tensors: GPU records decode bit-exactly on the CPU, encoders are reused,
owned records outlive the pinned buffers, and staging matches direct encoding.

Run on the H200 device machine (DEVELOPERS.md); skipped without CUDA and nvidia-nvcomp-cu12.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from nvdcp.codecs import codec_id
from nvdcp.codecs.gdeflate import GDeflateCodec
from nvdcp.errors import CodecUnavailableError
from nvdcp.format.dtypes import dtype_code
from nvdcp.format.header import (
    KIND_BYTES,
    KIND_TENSOR,
    TRANSFORM_BYTEPLANES,
    TRANSFORM_NONE,
    parse_item_header,
)
from nvdcp.gpu.config import GpuConfig
from nvdcp.pipeline.config import EncodeConfig
from nvdcp.pipeline.cpu import EncodedItem, decode_item
from nvdcp.pipeline.encoder import ItemEncoder, descriptor_codec
from nvdcp.pipeline.policy import GPU_AUTO_CODEC, choose_layout
from tests.conftest import bit_equal, has_cuda_nvcomp, random_tensor, weights_like
from tests.gpu import bound_with_room

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not has_cuda_nvcomp(), reason="needs an NVIDIA GPU with CUDA and nvidia-nvcomp-cu12"),
]
CUDA = torch.device("cuda", 0)
MiB = 1 << 20


def _needs_cpu_decoder(codec: str) -> None:
    if codec in ("auto", "gdeflate") and not GDeflateCodec.available():
        pytest.skip("GDeflate's CPU decoder (libnvcomp_cpu) is not installed")


@pytest.fixture
def make_encoder() -> Iterator[Any]:
    made: list[ItemEncoder] = []

    def make(codec: str = "auto", chunk_bytes: int = 65536, gpu: GpuConfig | None = None) -> ItemEncoder:
        _needs_cpu_decoder(codec)  # the records are checked by decoding them on the CPU
        enc = ItemEncoder(EncodeConfig(codec=codec, chunk_bytes=chunk_bytes, codec_threads=2),
                          gpu or GpuConfig(gpu_memory_bytes=bound_with_room(codec, 256 * MiB, 64 * MiB, chunk_bytes),
                                           pinned_memory_bytes=64 * MiB))
        made.append(enc)
        return enc

    yield make
    for enc in made:
        enc.close()


def _record(item: EncodedItem) -> bytes:
    """The record's bytes, copied (GPU chunks view pinned memory reused by the next record)."""
    return item.header_bytes + b"".join(bytes(c) for c in item.chunks)


def _collect(enc: ItemEncoder, items: Iterable[tuple[Any, Any]], shares: int = 1) -> dict[Any, bytes]:
    out: dict[Any, bytes] = {}
    for key, item in enc.encode_items(items, lambda k: f"entry {k!r}", shares):
        assert key not in out
        out[key] = _record(item)  # consumed before the next record is asked for
    return out


def _cpu_decode(record: bytes, dtype: torch.dtype, where: str = "gpu record") -> torch.Tensor:
    size = torch.empty((), dtype=dtype).element_size()
    header, raw = decode_item(memoryview(record), where, None, size)
    assert header.kind == KIND_TENSOR and header.dtype_code == dtype_code(dtype)
    if raw.size == 0:
        return torch.empty(header.shape, dtype=dtype)
    return torch.from_numpy(raw).view(dtype).reshape(header.shape)


def _tensors(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Compressible and incompressible tensors, views, odd strides, scalars and empties, on the GPU."""
    if dtype.is_floating_point:
        smooth = weights_like((300, 517), dtype, seed=1).to(CUDA)
    else:
        smooth = torch.randint(-3, 4, (300, 517), generator=torch.Generator().manual_seed(1)).to(dtype).to(CUDA)
    base = random_tensor(dtype, (64, 40), seed=2).to(CUDA)
    return {
        "smooth": smooth,
        "random": random_tensor(dtype, (70_001,), seed=3).to(CUDA),
        "view": smooth[7:290:2, ::3],  # non-contiguous
        "transposed": base.t(),
        "odd_stride_size1": base.reshape(-1).as_strided((1,), (13,), 5),
        "odd_strides_1x1": base.reshape(-1).as_strided((1, 1), (7, 3), 11),
        "scalar": base[3, 4],
        "empty": torch.empty(0, 7, dtype=dtype, device=CUDA),
    }


@pytest.mark.parametrize("codec", ["auto", "gdeflate", "zstd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8], ids=str)
def test_gpu_records_decode_on_the_cpu(make_encoder: Any, codec: str, dtype: torch.dtype) -> None:
    enc = make_encoder(codec)
    sd = _tensors(dtype)
    for t in sd.values():
        assert enc.uses_gpu(t)
    torch.cuda.synchronize()
    records = _collect(enc, sd.items())
    assert set(records) == set(sd)
    chosen = GPU_AUTO_CODEC if codec == "auto" else codec
    layout = choose_layout(dtype, codec, auto_codec=GPU_AUTO_CODEC)
    for key, t in sd.items():
        out = _cpu_decode(records[key], dtype, f"entry {key!r}")
        assert bit_equal(out, t.contiguous().cpu()), (codec, dtype, key)
        header = decode_item(memoryview(records[key]), key, None, t.element_size())[0]
        assert header.plane_codecs == tuple(codec_id(n) for n in layout.plane_codecs), key
        assert header.transform == (TRANSFORM_BYTEPLANES if t.element_size() > 1 else TRANSFORM_NONE)
    smooth = decode_item(memoryview(records["smooth"]), "smooth", None, sd["smooth"].element_size())[0]
    assert smooth.stored_nbytes < smooth.raw_nbytes, "the GPU compressed nothing"
    assert layout.descriptor_codec == chosen


@pytest.mark.parametrize("chunk_bytes", [1024, 3000, 65536])
def test_gpu_records_decode_on_the_cpu_other_chunk_sizes(make_encoder: Any, chunk_bytes: int) -> None:
    enc = make_encoder("zstd", chunk_bytes)
    sd = {"w": weights_like((1000, 333), torch.bfloat16, seed=4).to(CUDA),
          "i": torch.arange(50_001, device=CUDA), "s": torch.ones(1, device=CUDA)}
    records = _collect(enc, sd.items())
    for key, t in sd.items():
        assert bit_equal(_cpu_decode(records[key], t.dtype), t.cpu()), (chunk_bytes, key)
        assert decode_item(memoryview(records[key]), key, None, t.element_size())[0].chunk_bytes == chunk_bytes


@pytest.mark.parametrize("codec", ["auto", "zstd"])
def test_many_small_tensors_of_mixed_shapes_decode_on_the_cpu(
    make_encoder: Any, codec: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Small tensors are split into planes in groups of one shape (several groups per shape here,
    one-element tensors, tensors of exactly one block, 1-byte and 8-byte dtypes)."""
    from nvdcp.gpu import encoder as gpu_encoder

    monkeypatch.setattr(gpu_encoder, "SMALL_SPLIT_BYTES", 64 << 10)
    enc = make_encoder(codec, 4096)
    dtypes = [torch.float32, torch.bfloat16, torch.int8, torch.float64, torch.bool, torch.complex64]
    sizes = [1, 7, 1000, 4096, 2048, 4095]
    sd = {}
    for i in range(300):
        dtype, n = dtypes[i % len(dtypes)], sizes[(i // len(dtypes)) % len(sizes)]
        sd[f"t{i}"] = random_tensor(dtype, (n,), seed=i).to(CUDA)
    records = _collect(enc, sd.items())
    for key, t in sd.items():
        assert bit_equal(_cpu_decode(records[key], t.dtype, key), t.cpu()), key


def test_items_spanning_several_buckets(make_encoder: Any) -> None:
    """A small GPU budget splits big tensors across buckets (partial records are copied out)."""
    enc = make_encoder("zstd", gpu=GpuConfig(gpu_memory_bytes=bound_with_room("zstd", 16 * MiB, 8 * MiB), pinned_memory_bytes=8 * MiB))
    sd = {"big": weights_like((6 * MiB,), seed=5).to(CUDA), "mid": weights_like((3 * MiB,), torch.bfloat16, seed=6).to(CUDA),
          "small": torch.full((10,), 2.5, device=CUDA)}
    records = _collect(enc, sd.items())
    for key, t in sd.items():
        assert bit_equal(_cpu_decode(records[key], t.dtype), t.cpu()), key


def test_encode_items_mixes_cpu_and_gpu_items(make_encoder: Any) -> None:
    enc = make_encoder("auto")
    gpu_t = weights_like((100, 100), seed=7).to(CUDA)
    cpu_t = weights_like((50, 50), seed=8)
    blob = b"extra state " * 500
    items = [("g", gpu_t), ("b", io.BytesIO(blob)), ("c", cpu_t), ("r", blob)]
    assert enc.uses_gpu(gpu_t) and not enc.uses_gpu(cpu_t)
    order: list[str] = []
    records: dict[str, bytes] = {}
    for key, item in enc.encode_items(items, str):
        order.append(key)
        records[key] = _record(item)
    assert order == ["b", "c", "r", "g"]  # CPU items as they come, GPU items batched at the end
    assert bit_equal(_cpu_decode(records["g"], torch.float32), gpu_t.cpu())
    assert bit_equal(_cpu_decode(records["c"], torch.float32), cpu_t)
    for key in ("b", "r"):
        header, raw = decode_item(memoryview(records[key]), key, None)
        assert header.kind == KIND_BYTES and raw.tobytes() == blob
    # auto means GDeflate on the GPU and zstd on the CPU
    assert decode_item(memoryview(records["g"]), "g", None, 4)[0].plane_codecs == (0, 0, 0, codec_id("gdeflate"))
    assert decode_item(memoryview(records["c"]), "c", None, 4)[0].plane_codecs == (0, 0, 0, codec_id("zstd"))


def test_gpu_encoders_are_reused(make_encoder: Any) -> None:
    enc = make_encoder("auto")
    devices = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    sd = {f"t{d.index}": weights_like((256, 256), seed=d.index).to(d) for d in devices}
    runs = [_collect(enc, sd.items(), shares=1)]
    assert set(enc._idle) == {(d, 1) for d in devices}
    made = {key: list(encoders) for key, encoders in enc._idle.items()}
    assert all(len(encoders) == 1 for encoders in made.values())
    runs.append(_collect(enc, sd.items(), shares=1))
    assert set(enc._idle) == {(d, 1) for d in devices}
    for key, encoders in enc._idle.items():
        assert len(encoders) == 1 and encoders[0] is made[key][0], key  # the same encoder, not a new one
    runs.append(_collect(enc, sd.items(), shares=2))  # another share count gets its own encoders
    assert all(len(enc._idle[(d, 2)]) == 1 for d in devices)
    assert all(enc._idle[(d, 1)][0] is made[(d, 1)][0] for d in devices)
    enc.close()
    assert enc._idle == {}
    runs.append(_collect(enc, sd.items()))  # usable after close, with new encoders
    assert all(enc._idle[(d, 1)][0] is not made[(d, 1)][0] for d in devices)
    # GPU GDeflate output is not always byte-identical between encodes (same sizes, other bytes,
    # same decoded data): compare what the records hold, not their bytes.
    for records in runs:
        assert set(records) == set(sd)
        for key, t in sd.items():
            assert bit_equal(_cpu_decode(records[key], t.dtype), t.cpu()), key


def test_encode_owned_chunks_stay_valid(make_encoder: Any) -> None:
    enc = make_encoder("auto")
    a = weights_like((512, 300), seed=9).to(CUDA)
    b = random_tensor(torch.float32, (512, 300), seed=10).to(CUDA)
    owned = enc.encode_owned(a, "a")
    assert all(isinstance(c, bytes) for c in owned.chunks)
    snapshot = _record(owned)
    for _ in range(2):  # reuse the pinned buffers the first record was copied from
        enc.encode_owned(b, "b")
        _collect(enc, [("b", b)])
    assert _record(owned) == snapshot
    assert bit_equal(_cpu_decode(_record(owned), torch.float32), a.cpu())
    assert descriptor_codec(owned) == "gdeflate"


def _layout_of(record: bytes) -> tuple[Any, ...]:
    """A record's header without the chunk checksums (GPU GDeflate bytes may vary, sizes do not)."""
    h = parse_item_header(memoryview(record), "record")
    return (h.kind, h.dtype_code, h.shape, h.raw_nbytes, h.transform, h.plane_codecs, h.chunk_bytes,
            tuple(size for size, _ in h.chunks))


def _raw_chunks(record: bytes) -> list[bytes]:
    """The chunks stored uncompressed (deterministic: plain copies of the tensor's planes)."""
    h = parse_item_header(memoryview(record), "record")
    out, pos = [], h.header_bytes
    for i, (size, _) in enumerate(h.chunks):
        if size == h.block_elements(i // h.n_planes):
            out.append(record[pos : pos + size])
        pos += size
    return out


def test_stage_gpu_jobs_matches_encode_gpu_jobs(make_encoder: Any) -> None:
    from nvdcp.dcp.stager import HostBuffers

    enc = make_encoder("auto")
    sd = _tensors(torch.bfloat16)
    sd["big"] = weights_like((3 * MiB,), seed=11).to(CUDA)
    jobs = [enc.gpu_job(key, t, f"entry {key!r}") for key, t in sd.items()]
    direct = {job.key: _record(item) for job, item in enc.encode_gpu_jobs(jobs, shares=1)}
    sink = HostBuffers(keep_bytes=64 * MiB, pin=True)
    try:
        records = enc.stage_gpu_jobs([enc.gpu_job(key, t, f"entry {key!r}") for key, t in sd.items()], sink)
        assert sink.used_bytes > 0
        staged = {job.key: _record(item) for job, item in records()}
    finally:
        sink.close()
    assert set(staged) == set(direct) == set(sd)
    for key, t in sd.items():
        assert _layout_of(staged[key]) == _layout_of(direct[key]), key
        assert _raw_chunks(staged[key]) == _raw_chunks(direct[key]), key
        assert bit_equal(_cpu_decode(staged[key], t.dtype), t.contiguous().cpu()), key
        assert bit_equal(_cpu_decode(direct[key], t.dtype), t.contiguous().cpu()), key


def test_gpu_job_moves_host_tensors_to_the_gpu(make_encoder: Any) -> None:
    enc = make_encoder("auto")
    t = weights_like((30, 40), seed=12)[:, ::2]
    job = enc.gpu_job("k", t, "k")
    # the tensor itself, made contiguous on the GPU (read by address); its bytes on demand
    assert job.data.is_cuda and job.data.dtype == torch.float32 and job.data.is_contiguous()
    assert job.nbytes == 30 * 20 * 4 and job.flat.dtype == torch.uint8 and job.flat.shape == (job.nbytes,)
    assert job.shape == (30, 20) and job.dtype == torch.float32 and job.dtype_code == dtype_code(torch.float32)
    assert job.layout == choose_layout(torch.float32, "auto", auto_codec=GPU_AUTO_CODEC)
    assert bytes(job.flat.cpu().numpy()) == bytes(t.contiguous().view(torch.uint8).reshape(-1).numpy())


def test_gpu_only_codec_encodes_host_tensors_on_the_gpu(make_encoder: Any) -> None:
    from nvdcp.gpu.decoder import GpuDecoder

    enc = make_encoder("ans")
    t = weights_like((200, 100), seed=13)
    assert enc.uses_gpu(t) and not enc.uses_gpu(torch.empty(0))
    owned = enc.encode_owned(t, "ans item")
    header = owned.header
    assert header.transform == TRANSFORM_NONE and header.plane_codecs == (codec_id("ans"),)
    with pytest.raises(CodecUnavailableError, match="ans item.*'ans'"):
        decode_item(memoryview(_record(owned)), "ans item", None, 4)
    decoder = GpuDecoder(CUDA, budget_bytes=64 * MiB, pinned_bytes=16 * MiB)
    payload = np.frombuffer(b"".join(bytes(c) for c in owned.chunks), dtype=np.uint8)
    out = decoder.decode(payload, header, torch.float32, "ans item")
    torch.cuda.synchronize()
    assert bit_equal(out.cpu().view(torch.float32).reshape(header.shape), t)
    empty = enc.encode_owned(torch.empty(0, 3), "empty")  # nothing to compress: raw, on the CPU
    assert empty.header.plane_codecs == (0,) and empty.chunks == []


@pytest.mark.parametrize("fill", [0x00, 0xA5, 0xFF])
def test_gdeflate_records_do_not_depend_on_stale_device_memory(make_encoder: Any, fill: int) -> None:
    """nvCOMP's GDeflate leaves some output bytes unwritten; the encoder zeroes its output slots,
    so the same tensor gives the same record whatever the allocator handed out before."""
    t = weights_like((256, 256)).to(CUDA)
    enc = make_encoder(codec="gdeflate")
    torch.cuda.synchronize()
    reference = _collect(enc, [("w", t)])["w"]
    junk = torch.full((512 << 20,), fill, dtype=torch.uint8, device=CUDA)
    del junk  # its memory goes back to torch's caching allocator, full of `fill`
    assert _collect(enc, [("w", t)])["w"] == reference


def test_encode_gpu_buckets_hold_at_most_depth_buckets_and_match_encode(make_encoder: Any) -> None:
    """The writer's path: buckets released out of order, by other threads, after the iterator
    ended; records equal those of encode_gpu_jobs; never more than ``depth`` buckets held."""
    import threading

    enc = make_encoder("auto", gpu=GpuConfig(gpu_memory_bytes=32 * MiB, pinned_memory_bytes=16 * MiB))
    sd = {f"w{i}": weights_like((700 + 50 * i, 256), seed=20 + i).to(CUDA) for i in range(12)}
    sd["big"] = weights_like((6 * MiB,), seed=40).to(CUDA)  # spans buckets: its record is copied out
    direct = {job.key: _record(item) for job, item in enc.encode_gpu_jobs([enc.gpu_job(k, t, k) for k, t in sd.items()])}
    got: dict[str, bytes] = {}
    held: list[Any] = []
    most = 0
    lock = threading.Lock()
    releasers: list[threading.Thread] = []
    for bucket in enc.encode_gpu_buckets([enc.gpu_job(k, t, k) for k, t in sd.items()], depth=3):
        for job, item in bucket.records:
            got[job.key] = _record(item)
        with lock:
            held.append(bucket)
            most = max(most, len(held))
        if len(held) == 3:  # release the newest two from another thread, the oldest later
            newest = held[1:]
            del held[1:]

            def release(bs: list[Any] = newest) -> None:
                for b in reversed(bs):
                    b.release()

            releasers.append(threading.Thread(target=release))
            releasers[-1].start()
            releasers[-1].join()
    for b in held:
        b.release()  # after the iterator ended: still accepted
    assert most <= 3
    assert set(got) == set(direct) == set(sd)
    for key, t in sd.items():
        assert _layout_of(got[key]) == _layout_of(direct[key]), key
        assert bit_equal(_cpu_decode(got[key], t.dtype), t.contiguous().cpu()), key
    assert enc.pinned.in_use == 0


@pytest.mark.parametrize("threads", [None, 1, 4])
def test_writer_spreads_gpu_records_over_files(tmp_path: Any, threads: int | None) -> None:
    """NvcompWriter with GPU state: one encoder, records over ``thread_count`` files (None: auto),
    bit-exact load, every file used, pinned buffers all back in the pool."""
    import torch.distributed.checkpoint as dcp

    import nvdcp
    from nvdcp.dcp import writer as writer_mod

    gpu = GpuConfig(gpu_memory_bytes=64 * MiB, pinned_memory_bytes=32 * MiB)
    sd: dict[str, Any] = {f"w{i}": weights_like((1024 + 64 * i, 512), seed=50 + i).to(CUDA) for i in range(16)}
    sd["big"] = weights_like((20 * MiB,), seed=70).to(CUDA)
    sd["host"] = weights_like((300, 300), seed=71)
    sd["step"] = 3
    writer = nvdcp.NvcompWriter(tmp_path, thread_count=threads, sync_files=False, gpu=gpu, on_identical_save="ignore")
    dcp.save(sd, storage_writer=writer)
    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in sd.items()}
    dcp.load(out, storage_reader=nvdcp.NvcompReader(tmp_path, gpu=gpu))
    for k, v in sd.items():
        assert (bit_equal(out[k].cpu(), v.cpu()) if isinstance(v, torch.Tensor) else out[k] == v), k
    files = sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".nvdcp")
    want = threads or writer_mod.auto_file_count(writer.storage, sum(
        v.numel() * v.element_size() for v in sd.values() if isinstance(v, torch.Tensor)))
    assert len(files) == want
    md = nvdcp.NvcompReader(tmp_path).read_metadata()
    assert {i.relative_path for i in md.storage_data.values()} == set(files)
    assert writer.encoder.pinned.in_use == 0

"""nvCOMP's batched C API through ctypes (:mod:`nvdcp.gpu.nvcomp_batch`).

The first tests run anywhere (the library and its host-only calls load without a GPU); the
``gpu`` ones compare every codec and element type with NVIDIA's Python binding byte for byte,
decode what was compressed, and check that corrupt streams are reported per chunk.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from nvdcp.gpu import nvcomp_batch
from nvdcp.gpu.nvcomp_batch import BatchedCodec
from tests.conftest import bit_equal, weights_like
from tests.gpu import bound_with_room

C = 65536
MiB = 1 << 20
#: every (codec, nvCOMP data_type, gdeflate algorithm type) the GPU path can ask for
CASES = [("gdeflate", None, t) for t in (0, 1, 2)] + [("zstd", None, 0)] \
    + [("ans", d, 0) for d in ("|u1", "<f2", "<f4")] + [("bitcomp", d, 0) for d in ("|u1", "<f2", "<f4", "<f8")]


def test_library_is_nvcomp_6_and_options_are_64_bytes() -> None:
    pytest.importorskip("nvidia.libnvcomp")
    assert nvcomp_batch.library_version() // 1000 == 6
    assert ctypes.sizeof(nvcomp_batch._Opts) == 64
    opts = nvcomp_batch._Opts.of("<iidi", 0, 11, 0.0, 0)
    assert bytes(opts.raw)[4:8] == (11).to_bytes(4, "little") and not any(bytes(opts.raw)[20:])


@pytest.mark.parametrize("name,data_type,gdeflate_type", CASES)
def test_bounds_come_from_the_library_without_a_gpu(name: str, data_type: str | None, gdeflate_type: int) -> None:
    pytest.importorskip("nvidia.libnvcomp")
    codec = BatchedCodec(name, data_type, C, gdeflate_type)
    assert codec.max_output >= C and codec.max_output % 16 == 0


def test_a_codec_without_nvcomp_is_refused() -> None:
    with pytest.raises(ValueError, match="does not run through nvCOMP"):
        BatchedCodec("none", None, C)


def _chunks(dtype: torch.dtype, n: int, seed: int = 0) -> torch.Tensor:
    """``n`` chunks of ``C`` bytes: weights-like values of ``dtype``, one chunk of zeros, one of
    random bytes (incompressible), the last one short."""
    g = torch.Generator().manual_seed(seed)
    elements = n * C // torch.empty((), dtype=dtype).element_size()
    values = (torch.randn(elements, generator=g, dtype=torch.float64) * 0.02).to(dtype)
    data = values.view(torch.uint8).reshape(-1).clone()
    data[C : 2 * C] = 0
    data[2 * C : 3 * C] = torch.randint(0, 256, (C,), generator=g, dtype=torch.uint8)
    return data


_DTYPE_OF = {None: torch.float32, "|u1": torch.float32, "<f2": torch.bfloat16, "<f4": torch.float32,
             "<f8": torch.float64}


@pytest.mark.gpu
@pytest.mark.parametrize("name,data_type,gdeflate_type", CASES)
def test_same_bitstreams_as_nvidias_python_binding(name: str, data_type: str | None, gdeflate_type: int) -> None:
    import nvidia.nvcomp as nv

    from nvdcp.codecs import codec_class

    dev = torch.device("cuda", 0)
    stream = torch.cuda.Stream(dev)
    n, last = 6, C - 4096
    data = _chunks(_DTYPE_OF[data_type], n).to(dev)
    sizes = np.full(n, C, dtype=np.int64)
    sizes[-1] = last
    codec = BatchedCodec(name, data_type, C, gdeflate_type)
    options = {"algorithm_type": gdeflate_type} if name == "gdeflate" else {}
    if data_type is not None:
        options["data_type"] = data_type
    reference = nv.Codec(algorithm=codec_class(name).nvcomp_algorithm, bitstream_kind=nv.BitstreamKind.RAW,
                         uncomp_chunk_size=C, device_id=0, cuda_stream=stream.cuda_stream, **options)
    cap = codec.max_output
    assert cap == max(C, -(-int(reference.get_max_comp_buffer_size(nv.as_array(data[:C]))) // 16) * 16)

    out = torch.zeros(n * cap, dtype=torch.uint8, device=dev)
    result = codec.compress(data, np.arange(n) * C, sizes, out, np.arange(n) * cap, stream)
    got = result.sizes().copy()
    assert not len(result.failed())
    with torch.cuda.stream(stream):
        ref_out = torch.zeros(n * cap, dtype=torch.uint8, device=dev)
        src = nv.as_arrays(data, (np.arange(n) * C).tolist(), sizes.tolist(), cuda_stream=stream.cuda_stream)
        dst = nv.as_arrays(ref_out, (np.arange(n) * cap).tolist(), [cap] * n, cuda_stream=stream.cuda_stream)
        ref_sizes = np.asarray(reference.encode(src, out=dst).buffer_sizes, dtype=np.int64)
    stream.synchronize()
    assert got.tolist() == ref_sizes.tolist()
    for i in range(n):
        a = out[i * cap : i * cap + got[i]].cpu()
        b = ref_out[i * cap : i * cap + got[i]].cpu()
        assert torch.equal(a, b), f"{name} {data_type}: chunk {i} differs from the Python binding's"

    back = torch.full((n * C,), 0xEE, dtype=torch.uint8, device=dev)
    decoded = codec.decompress(out, np.arange(n) * cap, got, back, np.arange(n) * C, sizes, stream)
    assert decoded.sizes().tolist() == sizes.tolist() and not len(decoded.failed())
    assert torch.equal(back[: (n - 1) * C + last].cpu(), data[: (n - 1) * C + last].cpu())


_CORRUPT_CHUNK = """
import sys, numpy as np, torch
from nvdcp.gpu.nvcomp_batch import BatchedCodec
from tests.gpu.test_nvcomp_batch import C, _chunks
name, n = sys.argv[1], 4
dev = torch.device("cuda", 0)
stream = torch.cuda.Stream(dev)
data = _chunks(torch.float32, n).to(dev)
sizes = np.full(n, C, dtype=np.int64)
codec = BatchedCodec(name, None, C)
cap = codec.max_output
out = torch.zeros(n * cap, dtype=torch.uint8, device=dev)
stored = codec.compress(data, np.arange(n) * C, sizes, out, np.arange(n) * cap, stream).sizes().copy()
out[3 * cap : 3 * cap + int(stored[3])] = 0xFF
back = torch.zeros(n * C, dtype=torch.uint8, device=dev)
result = codec.decompress(out, np.arange(n) * cap, stored, back, np.arange(n) * C, sizes, stream)
got = result.sizes()
good = torch.equal(back[:C].cpu(), data[:C].cpu())
print("RESULT", result.failed().tolist(), int(got[3]), good, result.status_text(3))
"""


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gdeflate", "zstd"])
def test_a_corrupt_chunk_is_reported_per_chunk(name: str) -> None:
    """Garbage in one chunk: nvCOMP's status or size for that chunk says so, the others decode.
    In a child process: nvCOMP makes no promise about arbitrary bytes (nvdcp checks every chunk's
    CRC32C before decoding it), and a fault on the device would poison this process's context."""
    done = subprocess.run([sys.executable, "-c", _CORRUPT_CHUNK, name], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2], timeout=120)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT")), None)
    assert line is not None, done.stderr[-3000:]
    failed, size3, good, text = _parse(line)
    assert 3 in failed or size3 != C
    assert good and "status" in text


def _parse(line: str) -> tuple[list[int], int, bool, str]:
    import ast

    body = line[len("RESULT "):]
    failed_end = body.index("]") + 1
    failed = ast.literal_eval(body[:failed_end])
    size3, good, text = body[failed_end + 1 :].split(" ", 2)
    return failed, int(size3), good == "True", text


@pytest.mark.gpu
def test_one_workspace_serves_every_stream_in_turn() -> None:
    """Zstd's workspace is one buffer per GPU: calls on two streams use the same memory, the
    second stream's call queued after the first's, and both results right; release drops it."""
    from nvdcp.gpu.nvcomp_batch import WORKSPACES

    dev = torch.device("cuda", 0)
    streams = [torch.cuda.Stream(dev), torch.cuda.Stream(dev)]
    codec = BatchedCodec("zstd", None, C)
    n = 8
    data = _chunks(torch.float32, n).to(dev)
    sizes = np.full(n, C, dtype=np.int64)
    outs, results, buffers = [], [], []
    for stream in streams * 2:
        out = torch.zeros(n * codec.max_output, dtype=torch.uint8, device=dev)
        outs.append(out)
        results.append(codec.compress(data, np.arange(n) * C, sizes, out, np.arange(n) * codec.max_output, stream))
        buffers.append(WORKSPACES._buffers[0].data_ptr())
    assert len(set(buffers)) == 1 and WORKSPACES.nbytes() >= codec.compress_temp_bytes(n, n * C)
    first = results[0].sizes().tolist()
    for result, out in zip(results, outs):
        assert result.sizes().tolist() == first and not len(result.failed())
        assert torch.equal(out.cpu(), outs[0].cpu())
    import nvdcp

    nvdcp.release_resources()
    assert WORKSPACES.nbytes() == 0


@pytest.mark.gpu
def test_a_zstd_call_and_a_gdeflate_call_on_two_streams_compress_as_they_do_alone() -> None:
    """GDeflate asks for no workspace, so its call never waits for Zstd's (the encoder queues a
    bucket's codec groups on streams of their own); side by side each compresses as alone."""
    from nvdcp.gpu.nvcomp_batch import WORKSPACES

    dev = torch.device("cuda", 0)
    n = 64
    data = _chunks(torch.float32, n).to(dev)
    sizes = np.full(n, C, dtype=np.int64)
    codecs = [BatchedCodec("zstd", None, C), BatchedCodec("gdeflate", None, C)]
    assert codecs[1].compress_temp_bytes(n, n * C) == 0 < codecs[0].compress_temp_bytes(n, n * C)

    def run(streams: list[torch.cuda.Stream]) -> list[tuple[list[int], bytes]]:
        outs, results = [], []
        for codec, stream in zip(codecs, streams):
            out = torch.zeros(n * codec.max_output, dtype=torch.uint8, device=dev)
            outs.append(out)
            results.append(codec.compress(data, np.arange(n) * C, sizes, out, np.arange(n) * codec.max_output, stream))
        return [(r.sizes().tolist(), o.cpu().numpy().tobytes()) for r, o in zip(results, outs)]

    with WORKSPACES.held():
        one = torch.cuda.Stream(dev)
        assert run([torch.cuda.Stream(dev), torch.cuda.Stream(dev)]) == run([one, one])
    assert WORKSPACES.nbytes() == 0


def test_chunks_within_is_the_largest_call_whose_workspace_fits() -> None:
    """A load under a GPU bound splits its Zstd decode calls at this count (host-only queries)."""
    pytest.importorskip("nvidia.libnvcomp")
    codec = BatchedCodec("zstd", None, C)

    def temp(k: int) -> int:
        return codec.decompress_temp_bytes(k, k * C)

    try:
        temp(1)
    except nvcomp_batch.NvcompCallError:
        pytest.skip("this nvCOMP build asks the GPU for its decompression workspace size")

    for limit in (temp(1), 12 * MiB, temp(300) + 1):
        k = codec.chunks_within(limit)
        assert k >= 1 and temp(k) <= limit < temp(k + 1), (limit, k)
    assert codec.chunks_within(temp(1) - 1) == 0


@pytest.mark.gpu
def test_a_decode_under_a_workspace_limit_is_split_into_calls_that_fit() -> None:
    from nvdcp.gpu.nvcomp_batch import WORKSPACES

    dev = torch.device("cuda", 0)
    stream = torch.cuda.Stream(dev)
    n = 64
    data = _chunks(torch.float32, n).to(dev)
    sizes = np.full(n, C, dtype=np.int64)
    codec = BatchedCodec("zstd", None, C)
    cap = codec.max_output
    packed = torch.zeros(n * cap, dtype=torch.uint8, device=dev)
    stored = codec.compress(data, np.arange(n) * C, sizes, packed, np.arange(n) * cap, stream).sizes().copy()
    limit = codec.decompress_temp_bytes(20, 20 * C)
    assert codec.chunks_within(limit) == 20 and codec.decompress_temp_bytes(n, n * C) > limit
    WORKSPACES.release()
    with WORKSPACES.held():
        back = torch.full((n * C,), 0xEE, dtype=torch.uint8, device=dev)
        result = codec.decompress(packed, np.arange(n) * cap, stored, back, np.arange(n) * C, sizes, stream,
                                  temp_limit=limit)
        assert result.sizes().tolist() == sizes.tolist() and not len(result.failed())
        assert 0 < WORKSPACES.nbytes() <= limit
    assert torch.equal(back.cpu(), data.cpu())
    with pytest.raises(ValueError, match=r"zstd: nvCOMP's decompression workspace for one chunk"):
        codec.decompress(packed, np.arange(n) * cap, stored, back, np.arange(n) * C, sizes, stream, temp_limit=1024)


def test_a_batch_of_no_chunks_queues_nothing() -> None:
    pytest.importorskip("nvidia.libnvcomp")
    codec = BatchedCodec("zstd", None, C)
    buf = torch.zeros(C, dtype=torch.uint8)
    none = np.zeros(0, dtype=np.int64)
    for result in (codec.compress(buf, none, none, buf, none, None),  # type: ignore[arg-type]
                   codec.decompress(buf, none, none, buf, none, none, None)):  # type: ignore[arg-type]
        assert result.sizes().tolist() == [] and result.failed().tolist() == []


def test_chunks_larger_than_the_codecs_are_refused_before_any_launch() -> None:
    pytest.importorskip("nvidia.libnvcomp")
    codec = BatchedCodec("gdeflate", None, C)
    buf = torch.zeros(4 * C, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"gdeflate.*chunk 1 .*131072 bytes.*65536"):
        codec.compress(buf, np.array([0, C]), np.array([C, 2 * C]), buf, np.array([0, 2 * C]), None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"gdeflate.*chunk 0 "):
        codec.decompress(buf, np.array([0]), np.array([10]), buf, np.array([C]), np.array([C + 1]), None)  # type: ignore[arg-type]


def _records(enc: Any, sd: dict[str, torch.Tensor]) -> dict[str, bytes]:
    out = {}
    for key, item in enc.encode_items(sd.items(), str):
        out[key] = item.header_bytes + b"".join(bytes(c) for c in item.chunks)
    return out


def _decoded(record: bytes, dtype: torch.dtype) -> torch.Tensor:
    from nvdcp.pipeline.cpu import decode_item

    size = torch.empty((), dtype=dtype).element_size()
    header, raw = decode_item(memoryview(record), "r", None, size)
    return torch.from_numpy(raw).view(dtype).reshape(header.shape)


@pytest.mark.gpu
def test_concurrent_encoders_agree_with_one() -> None:
    """Four threads, each its own ItemEncoder (own streams, codecs, pinned pool) at once: every
    record decodes on the CPU to its tensor (no workspace or table handed to two calls at once)."""
    from nvdcp.gpu.config import GpuConfig
    from nvdcp.pipeline.config import EncodeConfig
    from nvdcp.pipeline.encoder import ItemEncoder

    cuda = torch.device("cuda", 0)
    sd = {f"w{i}": weights_like((512 + 64 * i, 300), torch.bfloat16 if i % 2 else torch.float32, seed=i).to(cuda)
          for i in range(6)}
    errors: list[BaseException] = []
    results: list[dict[str, bytes]] = []

    def run() -> None:
        enc = ItemEncoder(EncodeConfig(codec="zstd"), GpuConfig(gpu_memory_bytes=bound_with_room("zstd", 32 * MiB, 16 * MiB),
                                                                pinned_memory_bytes=16 * MiB))
        try:
            for _ in range(3):
                results.append(_records(enc, sd))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
        finally:
            enc.close()

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(results) == 12
    for records in results:
        assert records == results[0]
        for key, t in sd.items():
            assert bit_equal(_decoded(records[key], t.dtype), t.cpu()), key


@pytest.mark.gpu
def test_the_workspace_is_dropped_when_the_last_save_or_load_ends() -> None:
    """Held while an encode runs, dropped when it ends (its memory stays in torch's cache, where
    the training job's allocations can take it back); a holder inside another keeps it."""
    from nvdcp.gpu.nvcomp_batch import WORKSPACES
    from nvdcp.pipeline.config import EncodeConfig
    from nvdcp.pipeline.encoder import ItemEncoder

    cuda = torch.device("cuda", 0)
    sd = {"w": weights_like((1024, 512), torch.float32, seed=3).to(cuda)}
    enc = ItemEncoder(EncodeConfig(codec="zstd"))
    try:
        WORKSPACES.release()
        with WORKSPACES.held():
            records = _records(enc, sd)
            assert WORKSPACES.nbytes() > 0  # the encode's own hold ended; this one keeps it
        assert WORKSPACES.nbytes() == 0
        assert records == _records(enc, sd) and WORKSPACES.nbytes() == 0
    finally:
        enc.close()
    assert bit_equal(_decoded(records["w"], torch.float32), sd["w"].cpu())

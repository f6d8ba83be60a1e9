"""nvCOMP's allocations through torch's caching allocator and nvdcp's pinned block cache.

The first tests run anywhere (the stream argument, the env switch, installing once); the rest
need the H200 device machine (DEVELOPERS.md): records made under the caching allocators decode
bit-exactly, concurrent encoders agree with one, pinned blocks are reused only once the work
queued on them is done, and ``NVDCP_NVCOMP_ALLOCATOR=nvcomp`` (in a fresh process) keeps
nvCOMP's own allocators with the same results.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import types
from typing import Any

import pytest
import torch

from nvdcp.gpu import allocator
from tests.conftest import bit_equal, has_cuda_nvcomp, weights_like

MiB = 1 << 20


def on_gpu(fn: Any) -> Any:
    """The test needs CUDA and nvCOMP (the H200 device machine)."""
    fn = pytest.mark.skipif(not has_cuda_nvcomp(), reason="needs an NVIDIA GPU with CUDA and nvidia-nvcomp-cu12")(fn)
    return pytest.mark.gpu(fn)


def torch_hooks(fn: Any) -> Any:
    """The test runs nvCOMP through the torch-backed hooks: opt-in (NVDCP_NVCOMP_ALLOCATOR=torch)
    since they segfaulted on the H200 with nvCOMP 6.0.0.12 (nvdcp/gpu/allocator.py)."""
    fn = pytest.mark.skipif(os.environ.get("NVDCP_NVCOMP_ALLOCATOR", "").lower() != "torch",
                            reason="torch-backed nvCOMP allocators are opt-in (NVDCP_NVCOMP_ALLOCATOR=torch)")(fn)
    return on_gpu(fn)


# -- anywhere ------------------------------------------------------------------------------------
def test_stream_handle_reads_the_spellings_nvcomp_may_use() -> None:
    assert allocator.stream_handle(types.SimpleNamespace(ptr=1234)) == 1234
    assert allocator.stream_handle(types.SimpleNamespace(cuda_stream=99)) == 99
    assert allocator.stream_handle(types.SimpleNamespace(handle=lambda: 7)) == 7
    assert allocator.stream_handle(5) == 5
    assert allocator.stream_handle(None) is None
    assert allocator.stream_handle(object()) is None
    assert allocator.stream_handle(types.SimpleNamespace(ptr=True)) is None  # a bool is no handle


def test_stream_device_falls_back_to_the_current_device(monkeypatch: pytest.MonkeyPatch) -> None:
    assert allocator.stream_device(types.SimpleNamespace(device=3)) == 3
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert allocator.stream_device(types.SimpleNamespace(device=-1)) == 0
    assert allocator.stream_device(object()) == 0


@pytest.mark.parametrize(("value", "mode"), [(None, "nvcomp"), ("", "nvcomp"), ("torch", "torch"),
                                             ("NVCOMP", "nvcomp"), ("bogus", "nvcomp")])
def test_requested_mode(monkeypatch: pytest.MonkeyPatch, value: str | None, mode: str) -> None:
    if value is None:
        monkeypatch.delenv(allocator.ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(allocator.ENV_VAR, value)
    assert allocator.requested_mode() == mode


def _fake_nvcomp(monkeypatch: pytest.MonkeyPatch, fail: bool = False) -> dict[str, Any]:
    installed: dict[str, Any] = {}

    def setter(kind: str) -> Any:
        def set_allocator(fn: Any) -> None:
            if fail:
                raise RuntimeError("no allocator hooks")
            installed[kind] = fn
        return set_allocator

    nvidia = types.ModuleType("nvidia")
    nvcomp = types.ModuleType("nvidia.nvcomp")
    nvcomp.set_device_allocator = setter("device")  # type: ignore[attr-defined]
    nvcomp.set_pinned_allocator = setter("pinned")  # type: ignore[attr-defined]
    nvidia.nvcomp = nvcomp  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "nvidia", nvidia)
    monkeypatch.setitem(sys.modules, "nvidia.nvcomp", nvcomp)
    monkeypatch.setattr(allocator, "_installed", None)
    return installed


def test_install_once_from_many_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    installed = _fake_nvcomp(monkeypatch)
    monkeypatch.setenv(allocator.ENV_VAR, "torch")  # the hooks are opt-in
    modes: list[str] = []
    threads = [threading.Thread(target=lambda: modes.append(allocator.install_allocator())) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert modes == ["torch"] * 8 and allocator.installed_mode() == "torch"
    assert installed == {"device": allocator._allocate_device, "pinned": allocator.PINNED_CACHE.allocate}


def test_env_keeps_nvcomps_allocators(monkeypatch: pytest.MonkeyPatch) -> None:
    installed = _fake_nvcomp(monkeypatch)
    monkeypatch.setenv(allocator.ENV_VAR, "nvcomp")
    assert allocator.install_allocator() == "nvcomp" and installed == {}


def test_an_nvcomp_without_hooks_keeps_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_nvcomp(monkeypatch, fail=True)
    monkeypatch.delenv(allocator.ENV_VAR, raising=False)
    assert allocator.install_allocator() == "nvcomp"
    assert allocator.allocator_stats()["mode"] == "nvcomp"


# -- on the GPU ----------------------------------------------------------------------------------
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


def _state() -> dict[str, torch.Tensor]:
    cuda = torch.device("cuda", 0)
    return {f"w{i}": weights_like((512 + 64 * i, 300), torch.bfloat16 if i % 2 else torch.float32, seed=i).to(cuda)
            for i in range(6)}


@torch_hooks
@pytest.mark.parametrize("codec", ["zstd", "gdeflate"])
def test_records_under_the_caching_allocators_decode_bit_exactly(codec: str) -> None:
    from nvdcp.codecs.gdeflate import GDeflateCodec
    from nvdcp.gpu.config import GpuConfig
    from nvdcp.pipeline.config import EncodeConfig
    from nvdcp.pipeline.encoder import ItemEncoder

    if codec == "gdeflate" and not GDeflateCodec.available():
        pytest.skip("GDeflate's CPU decoder (libnvcomp_cpu) is not installed")
    enc = ItemEncoder(EncodeConfig(codec=codec), GpuConfig(gpu_memory_bytes=64 * MiB, pinned_memory_bytes=32 * MiB))
    before = allocator.allocator_stats()
    try:
        sd = _state()
        records = _records(enc, sd)
    finally:
        enc.close()
    after = allocator.allocator_stats()
    if allocator.requested_mode() == "torch":
        assert after["mode"] == "torch"
        assert after["device_allocs"] > before["device_allocs"], "nvCOMP allocated nothing through torch"
    for key, t in sd.items():
        assert bit_equal(_decoded(records[key], t.dtype), t.cpu()), key


@torch_hooks
def test_concurrent_encoders_agree_with_one() -> None:
    """Four threads, each its own ItemEncoder (own streams, nvCOMP codecs, pinned pool) at once:
    every record decodes to its tensor (no buffer handed to two users at once)."""
    from nvdcp.gpu.config import GpuConfig
    from nvdcp.pipeline.config import EncodeConfig
    from nvdcp.pipeline.encoder import ItemEncoder

    sd = _state()
    errors: list[BaseException] = []
    results: list[dict[str, bytes]] = []

    def run() -> None:
        enc = ItemEncoder(EncodeConfig(codec="zstd"), GpuConfig(gpu_memory_bytes=32 * MiB, pinned_memory_bytes=16 * MiB))
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
        for key, t in sd.items():
            assert bit_equal(_decoded(records[key], t.dtype), t.cpu()), key


@torch_hooks
def test_pinned_blocks_wait_for_the_work_queued_before_their_free() -> None:
    cache = allocator.PinnedBlockCache()
    stream = torch.cuda.Stream()
    handle = types.SimpleNamespace(ptr=stream.cuda_stream, device=0)
    first = cache.allocate(10_000, handle)
    ptr = first.ptr
    with torch.cuda.stream(stream):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time queued before the free
    del first
    second = cache.allocate(10_000, handle)
    assert second.ptr != ptr, "a block was reused while work queued before its free was running"
    stream.synchronize()
    del second
    third = cache.allocate(9_000, handle)  # same size class, its work done: reused
    assert third.ptr == ptr
    assert cache.size_class(10_000) == cache.size_class(9_000) == 16384
    del third
    cache.trim()


@torch_hooks
def test_device_blocks_come_from_torchs_pool_on_nvcomps_stream() -> None:
    stream = torch.cuda.Stream()
    before = torch.cuda.memory_allocated()
    block = allocator._allocate_device(3 * MiB, types.SimpleNamespace(ptr=stream.cuda_stream, device=0))
    assert block.ptr and torch.cuda.memory_allocated() >= before + 3 * MiB
    del block  # back to torch's pool (stream-ordered), not to cudaFree
    assert torch.cuda.memory_allocated() == before


@on_gpu
def test_env_nvcomp_in_a_fresh_process_round_trips(tmp_path: Any) -> None:
    """Both settings in one run of the suite: a subprocess with NVDCP_NVCOMP_ALLOCATOR=nvcomp."""

    script = textwrap.dedent(f"""
        import torch, torch.distributed.checkpoint as dcp, nvdcp
        from nvdcp.gpu import allocator
        sd = {{f"w{{i}}": torch.randn(300_000, device="cuda") * 0.01 for i in range(4)}}
        dcp.save(sd, storage_writer=nvdcp.NvcompWriter({str(tmp_path)!r}, sync_files=False))
        out = {{k: torch.zeros_like(v) for k, v in sd.items()}}
        dcp.load(out, storage_reader=nvdcp.NvcompReader({str(tmp_path)!r}))
        assert all(torch.equal(out[k], sd[k]) for k in sd)
        stats = allocator.allocator_stats()
        assert stats["mode"] == "nvcomp" and stats["device_allocs"] == 0, stats
        print("OK", stats["mode"])
    """)
    env = dict(os.environ, NVDCP_NVCOMP_ALLOCATOR="nvcomp")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "OK nvcomp" in done.stdout, done.stderr[-3000:]

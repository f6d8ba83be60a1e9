"""Delta checkpoints on the GPU path: XOR with the base on the device, records every machine loads.

Run on the H200 device machine (DEVELOPERS.md); skipped without CUDA and nvidia-nvcomp-cu12.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import nvdcp
from nvdcp.codecs import codec_name
from nvdcp.dcp import descriptor
from nvdcp.dcp import reader as reader_module
from nvdcp.dcp.delta import DeltaSave
from nvdcp.format.header import parse_item_header
from nvdcp.gpu.config import GpuConfig
from tests.conftest import bit_equal, weights_like
from tests.dcp.helpers import item_span
from tests.gpu import bound_with_room

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda", 0)


def _state() -> dict[str, torch.Tensor]:
    return {
        "w32": weights_like((1024, 1000)).to(CUDA),
        "w16": weights_like((700, 1300), torch.bfloat16, seed=1).to(CUDA),
        "ids": torch.arange(100_000, device=CUDA),
        "big": weights_like((5000, 1000), seed=3).to(CUDA),  # several GPU buckets at a small budget
        "empty": torch.empty(0, 7, device=CUDA),
    }


def _step(sd: dict[str, torch.Tensor], seed: int) -> None:
    g = torch.Generator(device=CUDA).manual_seed(seed)
    for k in ("w32", "big"):
        sd[k].add_(torch.randn(sd[k].shape, device=CUDA, generator=g) * 1e-4)
    sd["w16"].add_((torch.randn(sd["w16"].shape, device=CUDA, generator=g) * 1e-3).to(torch.bfloat16))


def _chain(root: Path, saves: int, policy: nvdcp.DeltaPolicy, gpu: GpuConfig | None = None,
           ) -> list[tuple[Path, dict[str, torch.Tensor]]]:
    sd = _state()
    out = []
    for i in range(saves):
        path = root / f"step{i}"
        dcp.save(sd, storage_writer=nvdcp.NvcompWriter(path, delta=policy, gpu=gpu))
        out.append((path, {k: v.detach().cpu().clone() for k, v in sd.items()}))
        _step(sd, i)
    return out


def _load(path: Path, device: torch.device, expected: dict[str, torch.Tensor], **kw: object) -> None:
    out = {k: torch.zeros(v.shape, dtype=v.dtype, device=device) for k, v in expected.items()}
    dcp.load(out, storage_reader=nvdcp.NvcompReader(path, **kw))  # type: ignore[arg-type]
    for k in expected:
        assert bit_equal(out[k].cpu(), expected[k]), (path.name, k)


@pytest.mark.parametrize("cache_bytes", [None, 0])
def test_gpu_delta_chain_loads_bit_exact_on_gpu_and_cpu(tmp_path: Path, cache_bytes: int | None) -> None:
    # cache_bytes=0: every base is read back from storage (decoded on the host, XORed on the GPU)
    saves = _chain(tmp_path, 4, nvdcp.DeltaPolicy(full_every=4, cache_bytes=cache_bytes),
                   GpuConfig(gpu_memory_bytes=64 << 20))
    for i, (path, expected) in enumerate(saves):
        md = nvdcp.NvcompReader(path).read_metadata()
        deltas = [ix.fqn for ix, info in md.storage_data.items() if descriptor.is_delta(info)]
        if i:
            assert {"w32", "w16", "big"} <= set(deltas), (i, deltas)
        else:
            assert not deltas
        _load(path, CUDA, expected)
        _load(path, torch.device("cpu"), expected)


def test_gpu_delta_chain_loads_the_same_with_the_torch_fold(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the fold kernel (no Triton, or NVDCP_GPU_FOLD=0) the levels are folded item by
    item with torch: the same tensors."""
    saves = _chain(tmp_path, 4, nvdcp.DeltaPolicy(full_every=4), GpuConfig(gpu_memory_bytes=64 << 20))
    monkeypatch.setattr(reader_module, "fold_available", lambda: False)
    for path, expected in saves:
        _load(path, CUDA, expected)


def test_gpu_delta_that_does_not_pay_is_stored_whole(tmp_path: Path) -> None:
    policy = nvdcp.DeltaPolicy(full_every=4)
    sd = _state()
    dcp.save(sd, storage_writer=nvdcp.NvcompWriter(tmp_path / "a", delta=policy))
    sd["w32"].copy_(weights_like((1024, 1000), seed=99).to(CUDA))  # unrelated values: XOR does not pay
    _step(sd, 1)
    dcp.save(sd, storage_writer=nvdcp.NvcompWriter(tmp_path / "b", delta=policy))
    md = nvdcp.NvcompReader(tmp_path / "b").read_metadata()
    kinds = {ix.fqn: descriptor.is_delta(info) for ix, info in md.storage_data.items()}
    assert kinds["w32"] is False and kinds["w16"] is True
    _load(tmp_path / "b", CUDA, {k: v.cpu() for k, v in sd.items()})


def test_cpu_written_chain_continues_on_gpu(tmp_path: Path) -> None:
    """A base saved from host tensors (CPU codecs), the delta from GPU tensors: one chain."""
    policy = nvdcp.DeltaPolicy(full_every=4)
    sd = _state()
    dcp.save({k: v.cpu() for k, v in sd.items()}, storage_writer=nvdcp.NvcompWriter(tmp_path / "a", delta=policy))
    _step(sd, 2)
    dcp.save(sd, storage_writer=nvdcp.NvcompWriter(tmp_path / "b", delta=policy))
    _load(tmp_path / "b", CUDA, {k: v.cpu() for k, v in sd.items()})
    _load(tmp_path / "b", torch.device("cpu"), {k: v.cpu() for k, v in sd.items()})


def test_gpu_async_save_of_deltas_loads_bit_exact(tmp_path: Path) -> None:
    """``dcp.async_save`` with a delta writer stages host copies; the background save XORs them."""
    policy = nvdcp.DeltaPolicy(full_every=4)
    sd = _state()
    saved = []
    for i in range(3):
        fut = dcp.async_save(sd, storage_writer=nvdcp.NvcompWriter(tmp_path / f"s{i}", delta=policy))
        saved.append({k: v.detach().cpu().clone() for k, v in sd.items()})
        _step(sd, i)  # the next step writes the parameters in place while the save runs
        (fut.upload_completion if hasattr(fut, "upload_completion") else fut).result()
    md = nvdcp.NvcompReader(tmp_path / "s2").read_metadata()
    assert any(descriptor.is_delta(info) for info in md.storage_data.values())
    for i, expected in enumerate(saved):
        _load(tmp_path / f"s{i}", CUDA, expected)


def _plane_codecs(path: Path, fqn: str) -> tuple[str, ...]:
    file, offset, length = item_span(path, fqn)
    with open(file, "rb") as f:
        f.seek(offset)
        header = parse_item_header(memoryview(f.read(length)), fqn)
    assert header.is_delta, fqn
    return tuple(codec_name(c) for c in header.plane_codecs)


def test_gpu_delta_planes_get_zstd_where_they_compressed_past_gdeflates_reach(tmp_path: Path) -> None:
    """First delta of an item: Zstd for the top plane, GDeflate for the rest; later deltas give
    Zstd to the planes that compressed 7x or more last time (all of an unchanged tensor's)."""
    policy = nvdcp.DeltaPolicy(full_every=8)
    sd = _state()
    sd["still"] = weights_like((512, 300), seed=7).to(CUDA)
    saved = []
    for i in range(3):
        dcp.save(sd, storage_writer=nvdcp.NvcompWriter(tmp_path / f"s{i}", delta=policy))
        saved.append({k: v.detach().cpu().clone() for k, v in sd.items()})
        _step(sd, i)
    assert _plane_codecs(tmp_path / "s1", "still") == ("gdeflate", "gdeflate", "gdeflate", "zstd")
    assert _plane_codecs(tmp_path / "s2", "still") == ("zstd",) * 4
    w32 = _plane_codecs(tmp_path / "s2", "w32")
    assert w32[0] == "gdeflate" and w32[-1] == "zstd", w32
    for i in (1, 2):
        _load(tmp_path / f"s{i}", CUDA, saved[i])
        _load(tmp_path / f"s{i}", torch.device("cpu"), saved[i])


def test_a_gpu_bound_below_zstds_workspace_holds_the_whole_delta_save(tmp_path: Path) -> None:
    """``gpu_memory_bytes`` bounds a save's scratch and nvCOMP's workspaces together: under 128
    MiB, where Zstd's 1.07 GiB workspace cannot fit, delta saves give their top planes GDeflate,
    add no more GPU memory than the bound at their peak, and the chain loads bit-exact."""
    bound = 128 << 20
    policy = nvdcp.DeltaPolicy(full_every=4)
    sd = _state()
    saved, peaks = [], []
    for i in range(3):
        gc.collect()
        torch.cuda.synchronize(CUDA)
        before = torch.cuda.memory_allocated(CUDA)
        torch.cuda.reset_peak_memory_stats(CUDA)
        dcp.save(sd, storage_writer=nvdcp.NvcompWriter(tmp_path / f"s{i}", delta=policy,
                                                      gpu=GpuConfig(gpu_memory_bytes=bound)))
        peaks.append(torch.cuda.max_memory_allocated(CUDA) - before)
        saved.append({k: v.detach().cpu().clone() for k, v in sd.items()})
        _step(sd, i)
    assert max(peaks) <= bound, [p >> 20 for p in peaks]
    for i in (1, 2):
        for fqn in ("w32", "w16", "big"):
            codecs = _plane_codecs(tmp_path / f"s{i}", fqn)
            assert "zstd" not in codecs and "gdeflate" in codecs, (i, fqn, codecs)
        _load(tmp_path / f"s{i}", CUDA, saved[i])
        _load(tmp_path / f"s{i}", torch.device("cpu"), saved[i])


def test_zstd_asked_for_under_a_gpu_bound_below_its_workspace_is_refused(tmp_path: Path) -> None:
    """``codec="zstd"`` set by the user is not swapped: a bound that cannot hold Zstd's workspace
    fails the save with an error naming the bound and the codec, and leaves no checkpoint."""
    sd = {"w": weights_like((1024, 1024)).to(CUDA)}
    with pytest.raises(CheckpointException, match="gpu_memory_bytes") as err:  # a BaseException
        dcp.save(sd, storage_writer=nvdcp.NvcompWriter(tmp_path / "z", codec="zstd",
                                                      gpu=GpuConfig(gpu_memory_bytes=64 << 20)))
    assert "zstd" in str(err.value)
    assert not (tmp_path / "z" / ".metadata").exists()
    room = GpuConfig(gpu_memory_bytes=bound_with_room("zstd", 64 << 20, 512 << 20))
    dcp.save(sd, storage_writer=nvdcp.NvcompWriter(tmp_path / "z", codec="zstd", gpu=room))
    _load(tmp_path / "z", CUDA, {"w": sd["w"].cpu()})


def _cache_devices(policy: nvdcp.DeltaPolicy) -> dict[str, str]:
    return {ix.fqn: entry.data.device.type for ix, entry in policy.cache.entries.items()}


def _no_reads_back(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Record every base read back from storage one item at a time (a cache miss)."""
    reads: list[object] = []
    original = DeltaSave._read_base

    def spy(self: DeltaSave, index: Any, *args: Any, **kwargs: Any) -> Any:
        reads.append(index)
        return original(self, index, *args, **kwargs)

    monkeypatch.setattr(DeltaSave, "_read_base", spy)
    return reads


def test_gpu_cache_keeps_gpu_items_on_the_gpu_and_chains_load_bit_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    reads = _no_reads_back(monkeypatch)
    policy = nvdcp.DeltaPolicy(full_every=4, gpu_cache_bytes=1 << 30)
    saves = _chain(tmp_path, 3, policy, GpuConfig(gpu_memory_bytes=64 << 20))
    assert not reads  # every base came from the GPU part of the cache
    assert set(_cache_devices(policy).values()) == {"cuda"}, _cache_devices(policy)
    assert policy.cache.allocated == 0 and 0 < policy.cache.gpu_allocated <= 1 << 30
    for i, (path, expected) in enumerate(saves):
        md = nvdcp.NvcompReader(path).read_metadata()
        deltas = {ix.fqn for ix, info in md.storage_data.items() if descriptor.is_delta(info)}
        assert ({"w32", "w16", "big"} <= deltas) if i else not deltas, (i, deltas)
        _load(path, CUDA, expected)
        _load(path, torch.device("cpu"), expected)


def test_gpu_cache_budget_spills_to_host_memory(tmp_path: Path) -> None:
    """Room on the GPU for 4 MB: what does not fit there (big, 20 MB, at least) is kept in host memory."""
    policy = nvdcp.DeltaPolicy(full_every=4, gpu_cache_bytes=4_096_000)
    saves = _chain(tmp_path, 3, policy)
    devices = _cache_devices(policy)
    assert "cuda" in devices.values() and "cpu" in devices.values(), devices
    assert policy.cache.gpu_allocated <= 4_096_000
    for path, expected in saves:
        _load(path, CUDA, expected)


def test_gpu_cache_spills_to_host_memory_when_the_gpu_has_no_room(tmp_path: Path) -> None:
    """The process may not allocate the cache's first GPU arena (torch's per-process memory
    fraction, as a training job that holds the GPU's memory): the save keeps its bytes in host
    memory instead of failing, and the chain stays deltas."""
    total = torch.cuda.get_device_properties(CUDA).total_memory
    sd = _state()
    # Earlier tests' cache arenas (256 MiB) sit free in torch's allocator cache: a new arena would
    # reuse one without reserving anything. Hand them back first.
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    room = torch.cuda.memory_reserved(CUDA) + (128 << 20)  # the save's buckets fit, a 256 MiB arena does not
    torch.cuda.set_per_process_memory_fraction(room / total, CUDA)
    try:
        policy = nvdcp.DeltaPolicy(full_every=4, gpu_cache_bytes=8 << 30)
        for i in range(2):
            # GDeflate only: nvCOMP's Zstd needs a 1.07 GiB workspace, which would not fit either
            dcp.save(sd, storage_writer=nvdcp.NvcompWriter(tmp_path / f"s{i}", delta=policy, codec="gdeflate",
                                                          gpu=GpuConfig(gpu_memory_bytes=32 << 20)))
            _step(sd, i)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, CUDA)
    assert policy.cache.gpu_allocated == 0 and set(_cache_devices(policy).values()) == {"cpu"}
    md = nvdcp.NvcompReader(tmp_path / "s1").read_metadata()
    assert {ix.fqn for ix, info in md.storage_data.items() if descriptor.is_delta(info)} >= {"w32", "big"}


def test_gpu_cache_filled_from_storage_after_a_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A resumed job's first delta save reads its bases back in groups (prefetch) through host
    buffers into GPU slots: no item is read back on its own."""
    saves = _chain(tmp_path, 1, nvdcp.DeltaPolicy(full_every=4))
    sd = {k: v.to(CUDA) for k, v in saves[0][1].items()}
    policy = nvdcp.DeltaPolicy(full_every=4, gpu_cache_bytes=1 << 30)
    policy.resume_from(saves[0][0])
    _step(sd, 7)
    reads = _no_reads_back(monkeypatch)
    dcp.save(sd, storage_writer=nvdcp.NvcompWriter(tmp_path / "resumed", delta=policy))
    assert not reads
    assert set(_cache_devices(policy).values()) == {"cuda"}
    md = nvdcp.NvcompReader(tmp_path / "resumed").read_metadata()
    assert {ix.fqn for ix, info in md.storage_data.items() if descriptor.is_delta(info)} >= {"w32", "w16", "big"}
    _load(tmp_path / "resumed", CUDA, {k: v.cpu() for k, v in sd.items()})


def test_gpu_cached_items_keep_their_gpu_slots_through_a_save_from_host_tensors(tmp_path: Path) -> None:
    """Bytes kept on the GPU; the next save from host copies (CPU codecs, as dcp.async_save
    stages them) reads the bases off the GPU and keeps its bytes in the same GPU slots; the save
    after it, from the GPU again, finds them there. No slot is allocated twice."""
    policy = nvdcp.DeltaPolicy(full_every=8, gpu_cache_bytes=1 << 30)
    sd = _state()
    dcp.save(sd, storage_writer=nvdcp.NvcompWriter(tmp_path / "a", delta=policy))
    allocated, used = policy.cache.gpu_allocated, policy.cache.used
    _step(sd, 3)
    host = {k: v.cpu() for k, v in sd.items()}
    dcp.save(host, storage_writer=nvdcp.NvcompWriter(tmp_path / "b", delta=policy))
    _step(sd, 4)
    dcp.save(sd, storage_writer=nvdcp.NvcompWriter(tmp_path / "c", delta=policy))
    assert set(_cache_devices(policy).values()) == {"cuda"}
    assert (policy.cache.gpu_allocated, policy.cache.used, policy.cache.allocated) == (allocated, used, 0)
    for name in ("b", "c"):
        md = nvdcp.NvcompReader(tmp_path / name).read_metadata()
        assert {ix.fqn for ix, info in md.storage_data.items() if descriptor.is_delta(info)} >= {"w32", "big"}, name
    _load(tmp_path / "b", torch.device("cpu"), host)
    _load(tmp_path / "b", CUDA, host)
    _load(tmp_path / "c", CUDA, {k: v.cpu() for k, v in sd.items()})

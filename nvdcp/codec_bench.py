"""Codec benchmark: ratio and throughput of every codec this machine runs, per dtype.

Input is either the CPU reference workload (the tiny GPT of :mod:`nvdcp.demo.model` trained a
few steps with AdamW: weights and both moments, in fp32 and in a bf16 copy) or any checkpoint,
read item by item. Each tensor goes through the same item encoder the writer uses (byte planes +
codec, CRC32C per chunk) and back through the decoder, checked bit-exact. Throughput is
uncompressed bytes per second of wall time, summed per codec and dtype.

The results schema (``--json``, ``benchmarks/codec_bench.py``) is :func:`BenchResult.as_dict`.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from nvdcp.codecs import GPU_ONLY, cpu_codec
from nvdcp.cores import usable_cores
from nvdcp.errors import CodecUnavailableError, CorruptCheckpointError
from nvdcp.format.header import DEFAULT_CHUNK_BYTES
from nvdcp.gpu import gpu_available
from nvdcp.pipeline.config import EncodeConfig
from nvdcp.pipeline.cpu import decode_item
from nvdcp.pipeline.encoder import ItemEncoder
from nvdcp.pipeline.tensors import tensor_to_host_bytes

SCHEMA = "nvdcp.codec_bench/1"
CPU_CODECS = ("none", "zstd", "gdeflate")
GPU_CODECS = ("gdeflate", "zstd", "ans", "bitcomp")


@dataclass
class Row:
    """One codec on one device over every tensor of one dtype."""

    codec: str
    device: str
    dtype: str
    items: int = 0
    raw_bytes: int = 0
    stored_bytes: int = 0
    encode_s: float = 0.0
    decode_s: float = 0.0

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else 1.0

    @property
    def encode_gbps(self) -> float | None:
        return self.raw_bytes / self.encode_s / 1e9 if self.encode_s else None

    @property
    def decode_gbps(self) -> float | None:
        return self.raw_bytes / self.decode_s / 1e9 if self.decode_s else None

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(
            ratio=round(self.ratio, 4),
            # four significant digits, not decimals: a slow codec on a few KiB is not 0 GB/s
            encode_gbps=None if self.encode_gbps is None else float(f"{self.encode_gbps:.4g}"),
            decode_gbps=None if self.decode_gbps is None else float(f"{self.decode_gbps:.4g}"),
            encode_s=round(self.encode_s, 5), decode_s=round(self.decode_s, 5),
        )
        return d


@dataclass
class BenchResult:
    source: dict[str, Any]
    rows: list[Row] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    def totals(self) -> list[Row]:
        """One row per codec and device over all dtypes."""
        out: dict[tuple[str, str], Row] = {}
        for r in self.rows:
            t = out.setdefault((r.codec, r.device), Row(r.codec, r.device, "all"))
            t.items += r.items
            t.raw_bytes += r.raw_bytes
            t.stored_bytes += r.stored_bytes
            t.encode_s += r.encode_s
            t.decode_s += r.decode_s
        return list(out.values())

    def as_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "machine": machine(),
            "source": self.source,
            "results": [r.as_dict() for r in self.rows],
            "totals": [r.as_dict() for r in self.totals()],
            "skipped": self.skipped,
        }


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "cores": os.cpu_count(), "arch": platform.machine(), "python": platform.python_version(),
        "torch": torch.__version__,
    }
    if gpu_available():
        info["gpu"] = torch.cuda.get_device_name()
    from nvdcp.gpu_info import nvcomp_version

    info["nvcomp"] = nvcomp_version()
    return info


# -- inputs ------------------------------------------------------------------------------------
def reference_state(*, steps: int, d_model: int, layers: int, batch: int = 8, seed: int = 0) -> dict[str, Any]:
    """The CPU reference workload (:func:`nvdcp.demo.workload.train_state` on the CPU):
    a byte-level GPT trained ``steps`` steps with AdamW on the standard library's sources."""
    from nvdcp.demo.model import GPTConfig
    from nvdcp.demo.workload import train_state

    cfg = GPTConfig(d_model=d_model, n_layers=layers, n_heads=max(1, d_model // 64))
    state, _ = train_state("cpu", cfg=cfg, steps=steps, batch=batch, seed=seed, data_bytes=4 << 20)
    return state


def flat_tensors(state: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(state, torch.Tensor):
        yield prefix, state.detach()
    elif isinstance(state, dict):
        for k, v in state.items():
            yield from flat_tensors(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            yield from flat_tensors(v, f"{prefix}.{i}" if prefix else str(i))


def workload_tensors(state: dict[str, Any], bf16: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """The state's tensors, then (``bf16``) a bf16 copy of every floating tensor of dim >= 1."""
    tensors = list(flat_tensors(state))
    yield from tensors
    if bf16:
        for name, t in tensors:
            if t.is_floating_point() and t.dim() > 0 and t.dtype != torch.bfloat16:
                yield f"{name}@bf16", t.to(torch.bfloat16)


def checkpoint_tensors(path: str, storage_options: dict[str, Any] | None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every stored tensor chunk of a checkpoint (stock DCP or nvdcp), one at a time."""
    from nvdcp.convert import Source

    source = Source(path, threads=1, storage_options=storage_options)
    for job in sorted(source.jobs(), key=lambda j: (j.info.relative_path, j.info.offset)):
        if job.dtype is None or job.shape is None:
            continue
        raw = source.read(job)
        tensor = torch.from_numpy(raw).view(job.dtype).reshape(job.shape) if raw.size else torch.empty(job.shape, dtype=job.dtype)
        yield job.index.fqn, tensor


# -- codecs ------------------------------------------------------------------------------------
class _CpuRunner:
    """The writer's CPU path (:class:`~nvdcp.pipeline.encoder.ItemEncoder`): items one after
    another, the chunks of each on every core."""

    device = "cpu"

    def __init__(self, codec: str, pool: ThreadPoolExecutor, chunk_bytes: int, threads: int | None) -> None:
        cpu_codec(codec)  # raises CodecUnavailableError when its library is missing
        self.codec, self.pool = codec, pool
        self.encoder = ItemEncoder(EncodeConfig(codec, chunk_bytes, threads))

    def run(self, batch: list[torch.Tensor]) -> tuple[int, float, float]:
        """Encode and decode ``batch``; returns (stored bytes, encode s, decode s)."""
        stored, enc_s, dec_s = 0, 0.0, 0.0
        for t in batch:
            t0 = time.perf_counter()
            enc = self.encoder.encode_tensor(t, f"codec {self.codec}")
            enc_s += time.perf_counter() - t0
            record = b"".join([enc.header_bytes, *enc.chunks])  # the writer streams the parts instead
            t1 = time.perf_counter()
            _, back = decode_item(memoryview(record), self.codec, self.pool, t.element_size())
            dec_s += time.perf_counter() - t1
            if not np.array_equal(back, tensor_to_host_bytes(t)):
                raise CorruptCheckpointError(f"codec {self.codec}: round trip is not bit-exact")
            stored += len(record)
        return stored, enc_s, dec_s

    def close(self) -> None:
        self.encoder.close()


class _GpuRunner:
    """The writer's and reader's GPU path: one batched nvCOMP encode over many items (as the
    writer hands a data file's items to :meth:`ItemEncoder.encode_gpu_jobs`), one ``decode_many``
    back. Times include the device->host copies and host CRC32Cs of encoding, and the
    host->device copies of decoding, as in a save and a load."""

    device = "cuda"

    def __init__(self, codec: str, pool: ThreadPoolExecutor, chunk_bytes: int) -> None:
        from nvdcp.gpu.config import GpuConfig
        from nvdcp.gpu.decoder import GpuDecoder

        self.codec = codec
        self.dev = torch.device("cuda", torch.cuda.current_device())
        self.encoder = ItemEncoder(EncodeConfig(codec, chunk_bytes), GpuConfig())
        self.decoder = GpuDecoder(self.dev, budget_bytes=GpuConfig().gpu_budget(self.dev, load=True))

    def close(self) -> None:
        self.encoder.close()

    def run(self, batch: list[torch.Tensor]) -> tuple[int, float, float]:
        from nvdcp.format.header import parse_item_header
        from nvdcp.gpu.decoder import DecodeRequest

        batch = [t for t in batch if t.numel()]  # nothing to compress (and nvCOMP takes no empty batch)
        if not batch:
            return 0, 0.0, 0.0
        jobs = [self.encoder.gpu_job(k, t.to(self.dev), f"codec {self.codec}") for k, t in enumerate(batch)]
        torch.cuda.synchronize(self.dev)
        records: dict[int, bytes] = {}
        t0 = time.perf_counter()
        for job, enc in self.encoder.encode_gpu_jobs(jobs):
            # on the host, as the writer has it (the chunks are views of a reused pinned buffer)
            records[job.key] = b"".join([enc.header_bytes, *enc.chunks])
        t1 = time.perf_counter()
        requests = []
        for job in jobs:
            header = parse_item_header(memoryview(records[job.key]), self.codec)
            payload = np.frombuffer(records[job.key], dtype=np.uint8)[header.header_bytes :]
            requests.append(DecodeRequest(header=header, dtype=job.dtype, where=self.codec, payload=payload))
        t2 = time.perf_counter()
        outs = self.decoder.decode_many(requests)
        torch.cuda.synchronize(self.dev)
        t3 = time.perf_counter()
        for job, back in zip(jobs, outs):
            if not torch.equal(back, job.data):
                raise CorruptCheckpointError(f"GPU codec {self.codec}: round trip is not bit-exact")
        return sum(len(r) for r in records.values()), t1 - t0, t3 - t2


def _batches(tensors: Iterator[tuple[str, torch.Tensor]], batch_bytes: int) -> Iterator[list[torch.Tensor]]:
    """Tensors grouped by dtype into batches of about ``batch_bytes`` (streamed: at most one
    pending batch per dtype is held)."""
    pending: dict[torch.dtype, list[torch.Tensor]] = {}
    size: dict[torch.dtype, int] = {}
    for _, t in tensors:
        pending.setdefault(t.dtype, []).append(t)
        size[t.dtype] = size.get(t.dtype, 0) + t.numel() * t.element_size()
        if size[t.dtype] >= batch_bytes:
            yield pending.pop(t.dtype)
            size[t.dtype] = 0
    yield from pending.values()


def run_bench(
    tensors: Callable[[], Iterator[tuple[str, torch.Tensor]]],
    source: dict[str, Any],
    *,
    codecs: list[str] | None = None,
    gpu: bool | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    threads: int | None = None,
    batch_bytes: int = 256 << 20,
    progress: Callable[[int, int], None] | None = None,
) -> BenchResult:
    """Encode and decode every tensor ``tensors()`` yields with every codec, per dtype.

    ``codecs`` limits the codecs (default: every CPU codec, and with ``gpu`` every nvCOMP codec on
    the GPU; ``gpu=None`` means "when this machine has one"). Codecs that cannot run here are
    listed in ``skipped`` with the reason. ``tensors`` is called once per codec, so inputs are
    streamed rather than held; they go to the codecs in per-dtype batches of ``batch_bytes``
    (the GPU path encodes a batch in one call, as the writer does a data file's items).
    """
    use_gpu = gpu_available() if gpu is None else gpu
    if use_gpu and not gpu_available():
        raise CodecUnavailableError("--gpu needs CUDA and nvidia-libnvcomp-cu12; neither is usable here")
    wanted = codecs or list(dict.fromkeys([*CPU_CODECS, *(GPU_CODECS if use_gpu else ())]))
    result = BenchResult(source)
    pool = ThreadPoolExecutor(threads or usable_cores(), thread_name_prefix="nvdcp-bench")
    runners: list[Any] = []
    for codec in wanted:
        if codec in CPU_CODECS:
            try:
                runners.append(_CpuRunner(codec, pool, chunk_bytes, threads))
            except CodecUnavailableError as exc:
                result.skipped[f"{codec}@cpu"] = str(exc)
        elif codec not in GPU_CODECS:
            raise ValueError(f"unknown codec {codec!r}; choose from {sorted(set(CPU_CODECS) | set(GPU_CODECS))}")
        if use_gpu and codec in GPU_CODECS:
            runners.append(_GpuRunner(codec, pool, chunk_bytes))
        elif codec in GPU_ONLY:
            result.skipped[f"{codec}@cuda"] = "needs an NVIDIA GPU with nvidia-libnvcomp-cu12"
    try:
        for k, runner in enumerate(runners):
            rows: dict[str, Row] = {}
            for batch in _batches(tensors(), batch_bytes):
                stored, enc_s, dec_s = runner.run(batch)
                dtype = str(batch[0].dtype).removeprefix("torch.")
                row = rows.setdefault(dtype, Row(runner.codec, runner.device, dtype))
                row.items += len(batch)
                row.raw_bytes += sum(t.numel() * t.element_size() for t in batch)
                row.stored_bytes += stored
                row.encode_s += enc_s
                row.decode_s += dec_s
            result.rows += sorted(rows.values(), key=lambda r: -r.raw_bytes)
            if progress:
                progress(k + 1, len(runners))
    finally:
        for runner in runners:
            runner.close()
        pool.shutdown()
    return result


# -- the chart ---------------------------------------------------------------------------------
def plot(result: BenchResult, path: str) -> None:
    """Two panels: ratio per dtype (bars grouped by dtype, one per codec) and encode/decode GB/s
    per codec over all dtypes. Written with matplotlib's Agg backend (no display needed)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise CodecUnavailableError("--plot needs matplotlib: pip install 'nvdcp[cli]'") from None

    labels = [f"{t.codec}@{t.device}" for t in result.totals()]
    dtypes = sorted({r.dtype for r in result.rows}, key=lambda d: -sum(r.raw_bytes for r in result.rows if r.dtype == d))
    ratio = {(f"{r.codec}@{r.device}", r.dtype): r.ratio for r in result.rows}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [max(2, len(dtypes)), 2]})
    width = 0.8 / max(1, len(labels))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, label in enumerate(labels):
        xs = [d + (i - (len(labels) - 1) / 2) * width for d in range(len(dtypes))]
        ys = [ratio.get((label, dt), 0.0) for dt in dtypes]
        bars = ax1.bar(xs, ys, width, label=label, color=colors[i % len(colors)])
        ax1.bar_label(bars, fmt="%.2f", fontsize=7, padding=1)
    ax1.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    top = max([1.0, *ratio.values()])
    ax1.set_ylim(0, top * (1.2 + 0.06 * ((len(labels) - 1) // 4)))  # room for the legend above the bars
    ax1.set_xticks(range(len(dtypes)), dtypes)
    ax1.set_ylabel("compression ratio (original / stored)")
    ax1.set_title("Ratio per dtype")
    ax1.legend(fontsize=7, ncols=min(4, len(labels)), loc="upper left")
    totals = result.totals()
    pos = np.arange(len(totals))
    enc = [t.encode_gbps or 0.0 for t in totals]
    dec = [t.decode_gbps or 0.0 for t in totals]
    b1 = ax2.bar(pos - 0.2, enc, 0.4, label="encode", color="#4878d0")
    b2 = ax2.bar(pos + 0.2, dec, 0.4, label="decode", color="#ee854a")
    ax2.bar_label(b1, fmt="%.2f", fontsize=7, padding=1)
    ax2.bar_label(b2, fmt="%.2f", fontsize=7, padding=1)
    ax2.set_xticks(pos, [f"{t.codec}@{t.device}" for t in totals], rotation=20)
    ax2.set_ylabel("GB/s of original bytes")
    ax2.set_title("Throughput, all dtypes")
    ax2.legend(fontsize=8)
    m = machine()
    where = m.get("gpu") or f"{m['cores']} CPU cores"
    fig.suptitle(f"nvdcp codecs on {result.source.get('name', 'input')} ({where})", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

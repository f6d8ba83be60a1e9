"""Host-side ceilings on a GPU machine: what the save and load pipelines can reach at best.

    python -m benchmarks.host_probe [--gib 2] [--out DIR]

Measures, on the same bytes: host CRC32C of 64 KiB chunks (native batched library at 1, 4 and
all threads; the ``crc32c`` package), pinned device-to-host and host-to-device copies, writes of
a pinned buffer to /dev/shm (as 1, 2, 4 and 8 files, a thread each) and reads back, the CPU
path's encode rate on one core (``encode_item`` of fp32 weights with the default layout: byte
planes split, the top plane zstd-coded, every chunk checksummed), and whether Triton compiles a
kernel here. These bound nvdcp's GB/s of stored bytes: a save cannot beat ``min(D2H, CRC,
write)`` unless the stages overlap, and on the CPU path the encode and the write share the
cores. Writes ``host_probe_<date>.json``.
"""

from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from benchmarks.common import write_results

GiB = 1 << 30


def _best(fn: Any, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def crc_rates(buf: np.ndarray) -> dict[str, float]:
    from nvdcp.format import crc

    chunk = 64 << 10
    offsets = np.arange(0, buf.size, chunk, dtype=np.int64)
    lengths = np.minimum(chunk, buf.size - offsets)
    out = {}
    if crc.native_available():
        for threads in (1, 4, os.cpu_count() or 1):
            out[f"native_t{threads}"] = buf.size / _best(lambda: crc.checksum_ranges(buf, offsets, lengths, threads)) / 1e9
    import crc32c

    small = buf[: 256 << 20]
    out["crc32c_package_t1"] = small.size / _best(lambda: crc32c.crc32c(small.data)) / 1e9
    return out


def copy_rates(nbytes: int) -> dict[str, float]:
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    torch.cuda.synchronize()

    def d2h() -> None:
        host.copy_(dev, non_blocking=True)
        torch.cuda.synchronize()

    def h2d() -> None:
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()

    return {"d2h_pinned": nbytes / _best(d2h) / 1e9, "h2d_pinned": nbytes / _best(h2d) / 1e9}


def file_rates(buf: np.ndarray, where: str) -> dict[str, float]:
    os.makedirs(where, exist_ok=True)
    view = memoryview(buf)

    def run(parts: int, mode: str) -> None:
        """Write (``"wb"``) or read back (``"rb"``) the buffer as ``parts`` files, one thread each."""
        step = -(-buf.size // parts)

        def one(i: int) -> None:
            with open(os.path.join(where, f"p{i}"), mode, buffering=0) as f:
                part = view[i * step : (i + 1) * step]
                if mode == "wb":
                    f.write(part)
                else:
                    f.readinto(part)

        with ThreadPoolExecutor(parts) as pool:
            list(pool.map(one, range(parts)))

    out = {}
    for parts in (1, 2, 4, 8):
        out[f"write_t{parts}"] = buf.size / _best(lambda: run(parts, "wb")) / 1e9
        out[f"read_t{parts}"] = buf.size / _best(lambda: run(parts, "rb")) / 1e9
        for name in os.listdir(where):
            os.remove(os.path.join(where, name))
    return out


def cpu_encode_rate(nbytes: int = 256 << 20) -> dict[str, float]:
    """GB/s of fp32 state one core encodes on the CPU path (best of three), and the stored share."""
    from nvdcp.format.dtypes import dtype_code
    from nvdcp.format.header import KIND_TENSOR
    from nvdcp.pipeline.cpu import encode_item
    from nvdcp.pipeline.policy import choose_layout

    t = torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(0)) * 0.02
    raw = t.numpy().view(np.uint8).ravel()
    layout = choose_layout(torch.float32, "auto")

    def once() -> int:
        item = encode_item(raw, kind=KIND_TENSOR, dtype_code=dtype_code(torch.float32), shape=tuple(t.shape),
                           element_size=4, layout=layout, pool=None)
        return item.nbytes

    stored = once()  # first: faults in the plane buffers
    return {"encode_one_core": raw.size / _best(once) / 1e9, "stored_share": stored / raw.size}


def triton_check() -> dict[str, Any]:
    try:
        import triton
        import triton.language as tl
    except ImportError as exc:
        return {"available": False, "error": str(exc)}

    @triton.jit
    def xor_one(x_ptr, n, BLOCK: tl.constexpr):  # noqa: ANN001
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) ^ 1, mask=mask)

    x = torch.zeros(1 << 20, dtype=torch.int32, device="cuda")
    t0 = time.perf_counter()
    xor_one[(x.numel() // 1024,)](x, x.numel(), BLOCK=1024)
    torch.cuda.synchronize()
    return {"available": True, "version": triton.__version__, "first_compile_s": time.perf_counter() - t0,
            "ok": bool((x == 1).all())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--dir", default="/dev/shm/nvdcp-host-probe")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    nbytes = int(args.gib * GiB)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    host.random_(0, 256)
    buf = host.numpy()
    result: dict[str, Any] = {"bytes": nbytes, "crc_gb_per_s": crc_rates(buf)}
    if torch.cuda.is_available():
        result["copy_gb_per_s"] = copy_rates(nbytes)
        result["triton"] = triton_check()
    result["file_gb_per_s"] = file_rates(buf, args.dir)
    result["cpu_path_gb_per_s"] = cpu_encode_rate()
    for key, value in result.items():
        print(f"{key}: {value}")
    print(write_results("host_probe", result, out_dir=args.out))


if __name__ == "__main__":
    main()

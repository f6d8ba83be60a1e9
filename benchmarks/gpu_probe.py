"""Probe nvCOMP's Python batch API on the GPU: RAW chunk encode/decode through carved buffers,
ratios and speeds per codec on weight-like planes, and CPU<->GPU bitstream interop.

    python -m benchmarks.gpu_probe --out results.json
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import nvidia.nvcomp as nv
import torch

from nvdcp.codecs import cpu_codec

C = 65536


def planes_of(x: torch.Tensor) -> torch.Tensor:
    e = x.element_size()
    return x.reshape(-1).view(torch.uint8).view(-1, e).t().contiguous()


def encode_raw(codec: nv.Codec, buf: torch.Tensor, n: int, cap: int, stream: torch.cuda.Stream):
    nchunks = -(-n // C)
    offs = [i * C for i in range(nchunks)]
    sizes = [min(C, n - i * C) for i in range(nchunks)]
    out = torch.empty(nchunks * cap, dtype=torch.uint8, device=buf.device)
    src = nv.as_arrays(buf, offs, sizes, cuda_stream=stream.cuda_stream)
    dst = nv.as_arrays(out, [i * cap for i in range(nchunks)], [cap] * nchunks, cuda_stream=stream.cuda_stream)
    res = codec.encode(src, out=dst)
    return res, out, offs, sizes


def bench_codec(name: str, kwargs: dict, plane: torch.Tensor, stream: torch.cuda.Stream) -> dict:
    codec = nv.Codec(algorithm=name, bitstream_kind=nv.BitstreamKind.RAW, uncomp_chunk_size=C,
                     cuda_stream=stream.cuda_stream, **kwargs)
    n = plane.numel()
    one = nv.as_array(plane[:C])
    cap = codec.get_max_comp_buffer_size(one)
    cap = -(-cap // 16) * 16
    # warm up
    res, out, offs, sizes = encode_raw(codec, plane, n, cap, stream)
    comp_sizes = res.buffer_sizes
    torch.cuda.synchronize()
    reps = 5
    t0 = time.perf_counter()
    for _ in range(reps):
        res, out, offs, sizes = encode_raw(codec, plane, n, cap, stream)
        comp_sizes = res.buffer_sizes
    torch.cuda.synchronize()
    enc_s = (time.perf_counter() - t0) / reps
    ratio = n / sum(comp_sizes)
    # decode into a carved output buffer
    dec = torch.empty(len(offs) * C, dtype=torch.uint8, device=plane.device)
    nchunks = len(offs)
    csrc = nv.as_arrays(out, [i * cap for i in range(nchunks)], comp_sizes, cuda_stream=stream.cuda_stream)
    cdst = nv.as_arrays(dec, offs, sizes, cuda_stream=stream.cuda_stream)
    r = codec.decode(csrc, out=cdst)
    _ = r.buffer_sizes
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        r = codec.decode(csrc, out=cdst)
        _ = r.buffer_sizes
    torch.cuda.synchronize()
    dec_s = (time.perf_counter() - t0) / reps
    exact = bool(torch.equal(dec[:n], plane))
    return {"codec": name, "opts": kwargs, "ratio": round(ratio, 4), "enc_GBps": round(n / enc_s / 1e9, 2),
            "dec_GBps": round(n / dec_s / 1e9, 2), "exact": exact, "cap": cap, "bytes": n,
            "first_sizes": comp_sizes[:3], "out_type": type(res).__name__}


def interop(stream: torch.cuda.Stream) -> dict:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(1 << 20, generator=g) * 0.02).bfloat16()
    top = planes_of(x)[1].contiguous()
    res = {}
    for gpu_name, cpu_name, kw in [("Zstd", "zstd", {}), ("GDeflate", "gdeflate", {"algorithm_type": 0}),
                                   ("GDeflate", "gdeflate", {"algorithm_type": 2})]:
        codec = nv.Codec(algorithm=gpu_name, bitstream_kind=nv.BitstreamKind.RAW, uncomp_chunk_size=C,
                         cuda_stream=stream.cuda_stream, **kw)
        dev = top.cuda()
        cap = -(-codec.get_max_comp_buffer_size(nv.as_array(dev[:C])) // 16) * 16
        enc, out, offs, sizes = encode_raw(codec, dev, dev.numel(), cap, stream)
        csz = enc.buffer_sizes
        host = out.cpu().numpy()
        ok = True
        for i, (o, s) in enumerate(zip(offs, sizes)):
            buf = bytearray(s)
            cpu_codec(cpu_name).decode(host[i * cap : i * cap + csz[i]].tobytes(), memoryview(buf))
            ok &= bytes(buf) == top.numpy()[o : o + s].tobytes()
        # CPU-encoded -> GPU decode
        cpu_chunks = [cpu_codec(cpu_name).encode(top.numpy()[o : o + s].tobytes()) for o, s in zip(offs, sizes)]
        blob = b"".join(cpu_chunks)
        coffs = np.cumsum([0] + [len(c) for c in cpu_chunks[:-1]]).tolist()
        dblob = torch.frombuffer(bytearray(blob), dtype=torch.uint8).cuda()
        dec = torch.empty(dev.numel(), dtype=torch.uint8, device="cuda")
        r = codec.decode(nv.as_arrays(dblob, coffs, [len(c) for c in cpu_chunks], cuda_stream=stream.cuda_stream),
                         out=nv.as_arrays(dec, offs, sizes, cuda_stream=stream.cuda_stream))
        dsz = r.buffer_sizes
        torch.cuda.synchronize()
        res[f"{gpu_name}{kw}"] = {"gpu_to_cpu": ok, "cpu_to_gpu": bool(torch.equal(dec.cpu(), top)),
                                  "dec_sizes_ok": dsz == sizes}
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu_probe.json")
    ap.add_argument("--mib", type=int, default=256)
    args = ap.parse_args()
    stream = torch.cuda.Stream()
    results: dict = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
    torch.manual_seed(0)
    n = args.mib << 20
    data = {
        "bf16_w": (torch.randn(n // 2, device="cuda") * 0.02).bfloat16(),
        "fp32_w": torch.randn(n // 4, device="cuda") * 0.02,
        "fp32_v": (torch.randn(n // 4, device="cuda") * 1e-4) ** 2,
    }
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    planes_of(data["fp32_w"])
    torch.cuda.synchronize()
    results["split_GBps_fp32"] = round(n / (time.perf_counter() - t0) / 1e9, 1)
    rows = []
    with torch.cuda.stream(stream):
        for dname, x in data.items():
            top = planes_of(x)[-1].contiguous()
            for name, kw in [("GDeflate", {"algorithm_type": 0}), ("GDeflate", {"algorithm_type": 1}),
                             ("GDeflate", {"algorithm_type": 2}), ("Zstd", {}), ("ANS", {"data_type": "|u1"}),
                             ("Deflate", {"algorithm_type": 0})]:
                try:
                    r = bench_codec(name, kw, top, stream)
                except Exception as exc:
                    r = {"codec": name, "opts": kw, "error": repr(exc)}
                r["data"] = dname + ":top_plane"
                rows.append(r)
                print(json.dumps(r), flush=True)
            whole = x.reshape(-1).view(torch.uint8)
            for name, kw in [("ANS", {"data_type": "<f2" if x.dtype == torch.bfloat16 else "<f4"}),
                             ("Bitcomp", {"data_type": "<f2" if x.dtype == torch.bfloat16 else "<f4"})]:
                try:
                    r = bench_codec(name, kw, whole, stream)
                except Exception as exc:
                    r = {"codec": name, "opts": kw, "error": repr(exc)}
                r["data"] = dname + ":whole"
                rows.append(r)
                print(json.dumps(r), flush=True)
    results["rows"] = rows
    try:
        results["interop"] = interop(stream)
    except Exception as exc:
        results["interop"] = {"error": repr(exc)}
    print(json.dumps(results["interop"]))
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

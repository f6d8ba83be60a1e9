"""GPU item decoder: chunks go host -> device in one copy, nvCOMP decodes them in batched calls,
and the byte planes are merged back into elements on the device.

The caller has already checked the item header and every chunk's CRC32C on the host
(:func:`nvdcp.pipeline.cpu.verify_chunks`), so nvCOMP never sees bytes that differ from what
was written. Items larger than the scratch budget are decoded in block ranges.
"""

from __future__ import annotations

import nvidia.nvcomp as nv
import numpy as np
import torch

from nvdcp.codecs import codec_name
from nvdcp.errors import CorruptCheckpointError
from nvdcp.format.header import TRANSFORM_BYTEPLANES, ItemHeader
from nvdcp.gpu.nvcomp_codecs import CodecCache, typed_data_type
from nvdcp.gpu.pinned import POOL


class GpuDecoder:
    """Decodes container records into raw element bytes on one device."""

    def __init__(self, device: torch.device, *, budget_bytes: int, gdeflate_type: int = 0) -> None:
        self.device = device
        self.budget = budget_bytes
        self.gdeflate_type = gdeflate_type
        self.stream = torch.cuda.Stream(device)
        self.codecs: dict[int, CodecCache] = {}

    def decode(self, payload: np.ndarray, header: ItemHeader, dtype: torch.dtype | None, where: str) -> torch.Tensor:
        """Decode the item whose chunk payload (bytes after the header) is ``payload``.

        Returns a flat uint8 tensor of ``header.raw_nbytes`` bytes on this device.
        """
        c = header.chunk_bytes
        p = header.n_planes
        out = torch.empty(header.raw_nbytes, dtype=torch.uint8, device=self.device)
        offsets = np.zeros(len(header.chunks) + 1, dtype=np.int64)
        np.cumsum([s for s, _ in header.chunks], out=offsets[1:])
        blocks_per_pass = max(1, self.budget // (3 * p * c))
        with torch.cuda.stream(self.stream):
            for first in range(0, header.n_blocks, blocks_per_pass):
                last = min(header.n_blocks, first + blocks_per_pass)
                self._decode_blocks(payload, offsets, header, dtype, first, last, out, where)
        self.stream.synchronize()
        return out

    def _decode_blocks(self, payload: np.ndarray, offsets: np.ndarray, header: ItemHeader,
                       dtype: torch.dtype | None, first: int, last: int, out: torch.Tensor, where: str) -> None:
        c = header.chunk_bytes
        p = header.n_planes
        slot0 = first * p
        n = (last - first) * p
        staging = POOL.acquire(n * c)
        try:
            host = staging.numpy()
            raw_sizes = []
            for k in range(n):
                i = slot0 + k
                size = header.chunks[i][0]
                host[k * c : k * c + size] = payload[offsets[i] : offsets[i] + size]
                raw_sizes.append(header.block_elements(i // p))
            up = torch.empty((n, c), dtype=torch.uint8, device=self.device)
            up.view(-1).copy_(staging[: n * c], non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self.stream)
            dec = self._decode_slots(up, header, dtype, slot0, raw_sizes, where)
            self._merge(dec, header, first, last, out)
            copied.synchronize()  # the pinned staging buffer may be reused after this
        finally:
            POOL.release(staging)

    def _decode_slots(self, up: torch.Tensor, header: ItemHeader, dtype: torch.dtype | None, slot0: int,
                      raw_sizes: list[int], where: str) -> torch.Tensor:
        c = header.chunk_bytes
        p = header.n_planes
        groups: dict[tuple[str, str | None], list[int]] = {}
        raw_slots = []
        for k, raw in enumerate(raw_sizes):
            size = header.chunks[slot0 + k][0]
            if size == raw:
                raw_slots.append(k)
            else:
                name = codec_name(header.plane_codecs[(slot0 + k) % p])
                groups.setdefault((name, typed_data_type(name, dtype)), []).append(k)
        if not groups:
            return up
        dec = torch.empty_like(up)
        if raw_slots:
            idx = torch.tensor(raw_slots, device=self.device)
            dec[idx] = up[idx]
        for (name, data_type), ks in groups.items():
            cache = self.codecs.setdefault(c, CodecCache(self.device.index or 0, self.stream, c, self.gdeflate_type))
            codec, _cap = cache.get(name, data_type)
            src = nv.as_arrays(up.view(-1), [k * c for k in ks], [header.chunks[slot0 + k][0] for k in ks],
                               cuda_stream=self.stream.cuda_stream)
            dst = nv.as_arrays(dec.view(-1), [k * c for k in ks], [raw_sizes[k] for k in ks], cuda_stream=self.stream.cuda_stream)
            try:
                got = codec.decode(src, out=dst).buffer_sizes
            except Exception as exc:  # nvCOMP reports bad streams as RuntimeError/ValueError
                raise CorruptCheckpointError(f"{where}: nvCOMP {name} decode failed: {exc}") from exc
            bad = [k for k, g in zip(ks, got) if g != raw_sizes[k]]
            if bad:
                raise CorruptCheckpointError(
                    f"{where}: chunk {slot0 + bad[0]} ({name}) decoded to the wrong size on the GPU"
                )
        return dec

    @staticmethod
    def _merge(dec: torch.Tensor, header: ItemHeader, first: int, last: int, out: torch.Tensor) -> None:
        c = header.chunk_bytes
        p = header.n_planes
        start = first * c * p
        m = min(header.plane_nbytes, last * c) - first * c
        full, tail = divmod(m, c)
        dst = out[start : start + m * p]
        if header.transform != TRANSFORM_BYTEPLANES:
            dst.copy_(dec.view(-1)[:m])
            return
        if full:
            dst[: full * c * p].view(full, c, p).copy_(dec[: full * p].view(full, p, c).permute(0, 2, 1))
        if tail:
            dst[full * c * p :].view(tail, p).copy_(dec[full * p : (full + 1) * p, :tail].t())

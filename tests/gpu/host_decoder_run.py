"""Runs :class:`nvdcp.gpu.decoder.GpuDecoder`'s pass logic on CPU tensors: the Triton kernels
(device CRC32C, plane merge) under ``TRITON_INTERPRET=1``, nvCOMP's batched calls replaced by the CPU codecs.
Started by tests/gpu/test_decoder_host.py in a subprocess (the interpreter must be chosen before
Triton compiles anything); exits non-zero on a failed check.

    TRITON_INTERPRET=1 python -m tests.gpu.host_decoder_run [--legacy] [--interpret-crc]
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import torch


class _FakeResult:
    def __init__(self, sizes: list[int], failed: list[int]) -> None:
        self._sizes = np.asarray(sizes, dtype=np.int64)
        self._failed = np.asarray(failed, dtype=np.int64)

    def sizes(self) -> np.ndarray:
        return self._sizes

    def failed(self) -> np.ndarray:
        return self._failed

    def status_text(self, chunk: int) -> str:
        return "status 12 (nvcompErrorCannotDecompress, stand-in)"


class _FakeCodec:
    """Stands in for :class:`nvdcp.gpu.nvcomp_batch.BatchedCodec`: the CPU codec, chunk by chunk."""

    calls = 0
    #: set: the batch's chunk of this index reports a failed status (as nvCOMP would on a bad stream)
    fail_chunk: int | None = None

    def __init__(self, name: str) -> None:
        self.name = name

    def decompress(self, src: torch.Tensor, src_offsets: np.ndarray, sizes: np.ndarray, dst: torch.Tensor,
                   dst_offsets: np.ndarray, capacities: np.ndarray, stream: Any,
                   temp_limit: int | None = None) -> _FakeResult:
        from nvdcp.codecs import cpu_codec

        _FakeCodec.calls += 1
        assert src.dim() == 1 and src.dtype == torch.uint8 and dst.dim() == 1 and dst.dtype == torch.uint8
        out = []
        for ss, sn, ds, dn in zip(src_offsets.tolist(), sizes.tolist(), dst_offsets.tolist(), capacities.tolist()):
            assert ss % 256 == 0 and ds % 256 == 0, "unaligned slot"
            data = src[ss : ss + sn].numpy().tobytes()
            cpu_codec(self.name).decode(data, memoryview(dst[ds : ds + dn].numpy()))
            out.append(dn)
        failed = [] if _FakeCodec.fail_chunk is None or _FakeCodec.fail_chunk >= len(out) else [_FakeCodec.fail_chunk]
        return _FakeResult(out, failed)


class _FakeCache:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def get(self, name: str, data_type: str | None) -> _FakeCodec:
        return _FakeCodec(name)


class _Pool:
    """Stands in for PinnedPool (no pinned memory without CUDA)."""

    def __init__(self) -> None:
        self.out = 0

    def acquire(self, n: int) -> torch.Tensor:
        self.out += 1
        return torch.full((n,), 0xAB, dtype=torch.uint8)

    def release(self, buf: torch.Tensor) -> None:
        self.out -= 1


def main() -> None:
    legacy = "--legacy" in sys.argv  # item-by-item torch merge, checksums on the host
    if legacy:
        import os

        os.environ["NVDCP_GPU_MERGE"] = os.environ["NVDCP_DEVICE_CRC"] = "0"
    from nvdcp.errors import CorruptCheckpointError
    from nvdcp.format.header import parse_item_header_only
    from nvdcp.gpu import decoder as dec_mod
    from nvdcp.pipeline.config import EncodeConfig
    from nvdcp.pipeline.cpu import chunk_table
    from nvdcp.pipeline.encoder import ItemEncoder

    dec_mod.CodecCache = _FakeCache  # type: ignore[misc,assignment]
    if "--interpret-crc" not in sys.argv:
        # The CRC32C kernel's own tests run it under the interpreter (tests/gpu/test_crc32c.py);
        # here the host computes the same values from the ranges the decoder uploads (minutes less).
        from nvdcp.format.crc import checksum_ranges

        def host_crcs(buf: torch.Tensor, offsets: Any, lengths: Any, expected: Any = None) -> tuple[Any, Any]:
            assert expected is None
            got = checksum_ranges(buf.numpy(), offsets.numpy(), lengths.numpy())
            return torch.from_numpy(got.view(np.int32).copy()), None

        dec_mod.crc32c.checksum_ranges_device = host_crcs  # type: ignore[assignment]
    rng = np.random.default_rng(0)
    sd: dict[str, torch.Tensor] = {
        # several passes each at the smallest budget (64 blocks of 1 KiB per plane and pass)
        "big0": torch.from_numpy((rng.standard_normal(150_001) * 0.02).astype(np.float32)),
        "big1": torch.from_numpy((rng.standard_normal(140_000) * 0.02).astype(np.float32)),
        "f32": torch.from_numpy((rng.standard_normal(3_000) * 0.02).astype(np.float32)),
        "bf16": torch.from_numpy((rng.standard_normal(1_201) * 0.1).astype(np.float32)).to(torch.bfloat16),
        "u8": torch.from_numpy(rng.integers(0, 4, 2_500, dtype=np.uint8)),
        "f64": torch.from_numpy(rng.standard_normal(300)),
        "c64": torch.from_numpy(rng.standard_normal(150) + 1j * rng.standard_normal(150)).to(torch.complex64),
        "i32": torch.from_numpy(rng.integers(-5, 5, (13, 21)).astype(np.int32)),
        "one": torch.tensor([1.5]),
        "empty": torch.empty(0, 3),
    }
    for i in range(6):
        sd[f"s{i}"] = torch.from_numpy((rng.standard_normal(int(rng.integers(1, 700))) * 0.02).astype(np.float32))
    for codec in ("auto", "zstd", "none"):
        enc = ItemEncoder(EncodeConfig(codec=codec, chunk_bytes=1024))
        try:
            records = {k: item.header_bytes + b"".join(bytes(c) for c in item.chunks)
                       for k, item in enc.encode_items(sd.items(), str)}
        finally:
            enc.close()
        pool = _Pool()
        for budget in (1, 64 << 20):  # many passes (the smallest budget), then one
            decoder = dec_mod.GpuDecoder(torch.device("cpu"), budget_bytes=budget, pinned=pool)  # type: ignore[arg-type]
            assert decoder.fused is not legacy, "the interpreter should run the fused path"
            requests, dests = [], []
            for i, (key, rec) in enumerate(records.items()):
                header = parse_item_header_only(memoryview(rec), key)
                payload = np.frombuffer(rec, dtype=np.uint8)[header.header_bytes :]
                table = chunk_table(header) if i % 2 else None
                out = None
                if i % 3:
                    dests.append((key, torch.zeros_like(sd[key])))
                    out = dests[-1][1].reshape(-1).view(torch.uint8) if sd[key].numel() else None
                    if out is None:
                        dests.pop()
                if i % 5 == 1:  # a scatter read from "storage"
                    starts = np.concatenate([[0], np.cumsum(table[0] if table else [s for s, _ in header.chunks])])

                    def fill(first: int, buffers: list[memoryview], payload: np.ndarray = payload,
                             starts: np.ndarray = starts) -> None:
                        pos = int(starts[first])
                        for b in buffers:
                            b[:] = payload[pos : pos + len(b)].data
                            pos += len(b)

                    requests.append(dec_mod.DecodeRequest(header, sd[key].dtype, key, fill=fill, out=out, table=table))
                else:
                    requests.append(dec_mod.DecodeRequest(header, sd[key].dtype, key, payload=payload, out=out, table=table))
            outs = decoder.decode_many(requests)
            assert pool.out == 0, "staging buffers leaked"
            for (key, _), got in zip(records.items(), outs):
                want = sd[key].contiguous().reshape(-1).view(torch.uint8)
                assert torch.equal(got, want), (codec, budget, key)
            for key, dest in dests:
                assert torch.equal(dest, sd[key]), (codec, budget, key)
        if not legacy:
            _check_columns(dec_mod, records, sd, pool)
        # a damaged chunk is caught before decoding and named
        key = "f32"
        rec = bytearray(records[key])
        header = parse_item_header_only(memoryview(bytes(rec)), key)
        chunk = 5
        at = header.header_bytes + sum(s for s, _ in header.chunks[:chunk]) + header.chunks[chunk][0] // 2
        rec[at] ^= 0x10
        payload = np.frombuffer(bytes(rec), dtype=np.uint8)[header.header_bytes :]
        decoder = dec_mod.GpuDecoder(torch.device("cpu"), budget_bytes=1, pinned=pool)  # type: ignore[arg-type]
        try:
            decoder.decode_many([dec_mod.DecodeRequest(header, torch.float32, "item f32", payload=payload)])
        except CorruptCheckpointError as exc:
            assert f"item f32: chunk {chunk} " in str(exc) and "checksum mismatch" in str(exc), exc
        else:
            raise AssertionError("damaged chunk not caught")
        assert pool.out == 0
        if codec != "none":  # a chunk nvCOMP reports failed (its status), after a clean checksum
            _FakeCodec.fail_chunk = 0
            decoder = dec_mod.GpuDecoder(torch.device("cpu"), budget_bytes=64 << 20, pinned=pool)  # type: ignore[arg-type]
            header = parse_item_header_only(memoryview(records[key]), key)
            payload = np.frombuffer(records[key], dtype=np.uint8)[header.header_bytes :]
            try:
                decoder.decode_many([dec_mod.DecodeRequest(header, torch.float32, "item f32", payload=payload)])
            except CorruptCheckpointError as exc:
                assert "item f32: chunk " in str(exc) and "decode failed on the GPU: status 12" in str(exc), exc
            else:
                raise AssertionError("failed status not reported")
            finally:
                _FakeCodec.fail_chunk = None
            assert pool.out == 0
        print(f"{codec}: ok ({_FakeCodec.calls} codec calls)")


def _check_columns(dec_mod: Any, records: dict[str, bytes], sd: dict[str, torch.Tensor], pool: Any) -> None:
    """The same records as columns (all in one buffer, parsed together): decoded into the given
    destinations and new tensors alike, in several passes and in one; a record whose header
    disagrees with what is expected is not taken; a damaged chunk is named."""
    from nvdcp.dcp.record_columns import ColumnBatch
    from nvdcp.errors import CorruptCheckpointError
    from nvdcp.pipeline.cpu_batch import parse_records

    keys = list(records)
    blob = np.frombuffer(b"".join(records.values()), dtype=np.uint8)
    lengths = np.asarray([len(records[k]) for k in keys], dtype=np.int64)
    starts = np.cumsum(lengths) - lengths
    expected = [(sd[k].dtype, tuple(sd[k].shape)) for k in keys]
    for budget in (1, 64 << 20):
        decoder = dec_mod.GpuDecoder(torch.device("cpu"), budget_bytes=budget, pinned=pool)
        parsed = parse_records(blob, starts, lengths)
        assert parsed is not None
        dests = {k: torch.zeros_like(sd[k]) for i, k in enumerate(keys) if i % 2}
        targets = [(dests[k], dests[k].nbytes) if k in dests else None for k in keys]
        batch = ColumnBatch()
        taken = batch.add_run(blob, parsed, list(range(len(keys))), expected, [False] * len(keys), targets,
                              torch.device("cpu"), decoder.takes_whole)
        assert taken.any() and (budget > 1 or not taken.all()), (budget, taken)
        members = batch.members()
        outs = decoder.decode_columns(batch.columns(lambda row, members=members: keys[members[row]]))
        assert pool.out == 0, "staging buffers leaked"
        for i, target, out in zip(members, batch.destinations(), outs):
            key = keys[i]
            got = target if target is not None else out.view(sd[key].dtype).view(sd[key].shape)
            assert torch.equal(got, sd[key]), (budget, key)
        # a shape .metadata does not have: nothing of the run is taken
        wrong = list(expected)
        wrong[0] = (wrong[0][0], (1,) + wrong[0][1])
        again = ColumnBatch()
        assert not again.add_run(blob, parsed, list(range(len(keys))), wrong, [False] * len(keys), targets,
                                 torch.device("cpu"), decoder.takes_whole).any()
        assert len(again) == 0
    # a damaged chunk is caught before decoding and named
    key = "f32"
    j = keys.index(key)
    damaged = blob.copy()
    damaged[int(starts[j]) + int(lengths[j]) - 7] ^= 0x10  # inside its last chunk
    parsed = parse_records(damaged, starts, lengths)
    assert parsed is not None
    decoder = dec_mod.GpuDecoder(torch.device("cpu"), budget_bytes=1, pinned=pool)
    batch = ColumnBatch()
    batch.add_run(damaged, parsed, list(range(len(keys))), expected, [False] * len(keys), [None] * len(keys),
                  torch.device("cpu"), decoder.takes_whole)
    members = batch.members()
    assert j in members
    try:
        decoder.decode_columns(batch.columns(lambda row: f"item {keys[members[row]]}"))
    except CorruptCheckpointError as exc:
        assert "item f32: chunk " in str(exc) and "checksum mismatch" in str(exc), exc
    else:
        raise AssertionError("damaged chunk not caught")
    assert pool.out == 0


if __name__ == "__main__":
    main()

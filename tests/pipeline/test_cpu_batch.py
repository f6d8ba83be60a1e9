"""Small host tensors encoded as a batch: the records are byte for byte those of encode_item, and
they decode back to the tensors."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from nvdcp.codecs import codec_id, cpu_codec
from nvdcp.format.dtypes import dtype_code
from nvdcp.format.header import DEFAULT_CHUNK_BYTES, KIND_TENSOR, parse_item_header
from nvdcp.pipeline import cpu_batch
from nvdcp.pipeline.cpu import decode_item, encode_item
from nvdcp.pipeline.policy import choose_layout
from nvdcp.pipeline.tensors import tensor_to_host_bytes


def _mixed(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = [
        torch.randn(3, 7, generator=g),  # fewer bytes than a chunk
        torch.randn(70_000, generator=g),  # two blocks, the second partial
        torch.randn(64, 64, generator=g).to(torch.bfloat16),
        torch.zeros(0, 5),  # no bytes at all
        torch.tensor(3.5),  # 0-d
        torch.randint(-1000, 1000, (513,), generator=g, dtype=torch.int64),
        torch.randint(0, 255, (4099,), generator=g, dtype=torch.uint8),
        torch.rand(17, generator=g) > 0.5,
        torch.randn(40, 30, generator=g).t(),  # not contiguous
        torch.full((1000,), 2.0),  # compresses well in every plane
        torch.randn(8, 8, dtype=torch.complex64, generator=g).conj(),  # lazy conjugate
        torch.randn(5, 3, generator=g, dtype=torch.float64),
        torch.randn(2, 65536, generator=g).to(torch.float16),
    ]
    return out


def _reference(t: torch.Tensor, codec: str, chunk_bytes: int) -> bytes:
    enc = encode_item(
        tensor_to_host_bytes(t), kind=KIND_TENSOR, dtype_code=dtype_code(t.dtype), shape=tuple(t.shape),
        element_size=t.element_size(), layout=choose_layout(t.dtype, codec), pool=None, chunk_bytes=chunk_bytes,
    )
    return b"".join([enc.header_bytes, *[bytes(c) for c in enc.chunks]])


@pytest.mark.parametrize("codec", ["zstd", "none", "gdeflate"])
@pytest.mark.parametrize("chunk_bytes", [DEFAULT_CHUNK_BYTES, 4096])
@pytest.mark.parametrize("threads", [1, 3])
def test_batch_records_equal_encode_item(codec: str, chunk_bytes: int, threads: int) -> None:
    try:
        cpu_codec(codec).check_available()
    except Exception as exc:  # noqa: BLE001 - gdeflate's CPU library may be missing
        pytest.skip(str(exc))
    tensors = _mixed()
    records = cpu_batch.encode_tensor_batch(
        tensors, [dtype_code(t.dtype) for t in tensors], functools.partial(choose_layout, codec=codec),
        chunk_bytes, threads,
    )
    assert len(records) == len(tensors)
    for t, rec in zip(tensors, records):
        expected = _reference(t, codec, chunk_bytes)
        whole = bytes(rec.record)
        assert whole == expected, f"{t.dtype} {tuple(t.shape)}"
        assert rec.header_bytes + b"".join(bytes(c) for c in rec.chunks) == expected
        assert rec.nbytes == len(expected)
        parsed = parse_item_header(memoryview(expected), "x")
        assert parsed == rec.header and parsed.stored_crc == rec.header.stored_crc
        _, raw = decode_item(memoryview(expected), "x", None, t.element_size())
        assert np.array_equal(raw, tensor_to_host_bytes(t))


@pytest.mark.parametrize("chunk_bytes", [DEFAULT_CHUNK_BYTES, 4096])
def test_record_batches_hold_the_same_records_back_to_back(chunk_bytes: int) -> None:
    """``encode_tensor_batches``: one batch per dtype, each record the bytes ``encode_item``
    makes, the batch's gather the records in order, its keys and digests per record."""
    from nvdcp.format.digest import digest_of_record_header

    tensors = _mixed()
    keys = [f"k{i}" for i in range(len(tensors))]
    layout_of = functools.partial(choose_layout, codec="zstd")
    codes = [dtype_code(t.dtype) for t in tensors]
    batches = cpu_batch.encode_tensor_batches(tensors, keys, codes, layout_of, chunk_bytes, 2)
    assert len(batches) == len({t.dtype for t in tensors})
    seen = []
    for batch in batches:
        gathered = b"".join(bytes(piece) for piece in batch.gather())
        expected = b""
        for i in range(len(batch)):
            key = batch.jobs[i].key
            seen.append(key)
            record = _reference(tensors[keys.index(key)], "zstd", chunk_bytes)
            expected += record
            size = int(batch.header_sizes[i])
            assert int(batch.digests[i]) == digest_of_record_header(record[:size]), key
        assert gathered == expected
        assert batch.nbytes == len(expected)
        assert [len(r) for r in _split(expected, batch.record_nbytes.tolist())] == batch.record_nbytes.tolist()
        # per-record objects, where a caller needs them, hold the same bytes
        for job, encoded in batch.items():
            assert encoded.header_bytes + b"".join(bytes(c) for c in encoded.chunks) == _reference(
                tensors[keys.index(job.key)], "zstd", chunk_bytes)
        # a part is records lo..hi-1
        if len(batch) >= 2:
            part = batch.part(1, len(batch))
            assert b"".join(bytes(p) for p in part.gather()) == expected[int(batch.record_nbytes[0]):]
    assert sorted(seen) == sorted(keys)


def _split(blob: bytes, sizes: list[int]) -> list[bytes]:
    out, at = [], 0
    for n in sizes:
        out.append(blob[at : at + n])
        at += n
    return out


def test_batch_of_one_dtype_and_empty_batch_members() -> None:
    tensors = [torch.zeros(0), torch.zeros(0, 3)]
    records = cpu_batch.encode_tensor_batch(tensors, [dtype_code(torch.float32)] * 2,
                                            functools.partial(choose_layout, codec="zstd"), DEFAULT_CHUNK_BYTES)
    for t, rec in zip(tensors, records):
        assert bytes(rec.record) == _reference(t, "zstd", DEFAULT_CHUNK_BYTES)
        assert rec.header.raw_nbytes == 0 and len(rec.header.chunks) == 0


def test_python_fallbacks_give_the_same_records(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the native library (gather, plane split, CRC), the same bytes."""
    from nvdcp.format import crc
    from nvdcp.pipeline import cpu

    tensors = _mixed(1)
    codes = [dtype_code(t.dtype) for t in tensors]
    layout = functools.partial(choose_layout, codec="zstd")
    native = [bytes(r.record) for r in cpu_batch.encode_tensor_batch(tensors, codes, layout, DEFAULT_CHUNK_BYTES)]
    monkeypatch.setattr(cpu_batch, "_native_gather", lambda: None)
    monkeypatch.setattr(cpu_batch, "_native_split_many", lambda: None)
    monkeypatch.setattr(cpu, "_native_split", lambda: None)
    monkeypatch.setattr(crc, "_native", lambda: None)
    fallback = [bytes(r.record) for r in cpu_batch.encode_tensor_batch(tensors, codes, layout, DEFAULT_CHUNK_BYTES)]
    assert fallback == native


def _records(codec: str = "zstd", seed: int = 0) -> tuple[list[torch.Tensor], np.ndarray, np.ndarray, np.ndarray]:
    """The mixed tensors' records back to back after a 7-byte lead (odd offsets)."""
    tensors = _mixed(seed)
    blobs = [_reference(t, codec, DEFAULT_CHUNK_BYTES) for t in tensors]
    lengths = np.array([len(b) for b in blobs], dtype=np.int64)
    starts = 7 + np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    buf = np.frombuffer(b"\x00" * 7 + b"".join(blobs), dtype=np.uint8).copy()
    return tensors, buf, starts, lengths


def _without_block_decoder(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode through the codecs' decode_ranges, then merge (the path without nvdcp.codecs.zstd_blocks)."""
    monkeypatch.setattr(cpu_batch, "block_decoder", lambda: None)


def _counting_block_decoder(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make sure the block decoder is what decodes (skip where it is not built); returns a list
    that gets one entry per call of it."""
    from nvdcp.codecs.zstd_blocks import BlockDecoder, block_decoder

    if block_decoder() is None:
        pytest.skip("the block decoder's native pieces are not built here")
    calls: list[int] = []
    real = BlockDecoder.decode

    def counted(self: BlockDecoder, *args: object, **kwargs: object) -> None:
        calls.append(1)
        real(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(BlockDecoder, "decode", counted)
    return calls


@pytest.mark.parametrize("codec", ["zstd", "none", "gdeflate"])
@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("threads", [1, 3])
def test_parsed_and_decoded_together_equal_one_by_one(codec: str, in_place: bool, threads: int,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _counting_block_decoder(monkeypatch) if in_place else None
    if not in_place:
        _without_block_decoder(monkeypatch)
    try:
        cpu_codec(codec).check_available()
    except Exception as exc:  # noqa: BLE001
        pytest.skip(str(exc))
    tensors, buf, starts, lengths = _records(codec)
    parsed = cpu_batch.parse_records(buf, starts, lengths)
    assert parsed is not None
    for i, (at, n) in enumerate(zip(starts.tolist(), lengths.tolist())):
        one = parse_item_header(buf[at : at + n].data, "x")
        assert parsed.headers[i] == one and parsed.headers[i].stored_crc == one.stored_crc
        c0, c1 = parsed.first_chunk[i], parsed.first_chunk[i + 1]
        assert parsed.sizes[c0:c1].tolist() == one.chunks.sizes.tolist()
        assert parsed.crcs[c0:c1].tolist() == one.chunks.crcs.tolist()
    outs = [np.full(h.raw_nbytes, 0xAB, dtype=np.uint8) for h in parsed.headers]
    cpu_batch.decode_records(buf, parsed, outs, threads=threads)
    for t, out in zip(tensors, outs):
        assert np.array_equal(out, tensor_to_host_bytes(t)), f"{t.dtype} {tuple(t.shape)}"
    if calls is not None:
        assert bool(calls) == (codec == "zstd")  # GDeflate chunks and raw records take the other path


def test_decode_without_the_native_merge(monkeypatch: pytest.MonkeyPatch) -> None:
    tensors, buf, starts, lengths = _records(seed=2)
    parsed = cpu_batch.parse_records(buf, starts, lengths)
    assert parsed is not None
    _without_block_decoder(monkeypatch)
    monkeypatch.setattr(cpu_batch, "_native_merge_many", lambda: None)
    outs = [np.empty(h.raw_nbytes, dtype=np.uint8) for h in parsed.headers]
    cpu_batch.decode_records(buf, parsed, outs)
    assert all(np.array_equal(o, tensor_to_host_bytes(t)) for t, o in zip(tensors, outs))


def test_any_damaged_header_sends_the_batch_to_the_one_by_one_path() -> None:
    """Every header byte matters: flipping any one of the first record's makes the batch parse
    give up (the caller then parses one by one, which names the problem)."""
    tensors, buf, starts, lengths = _records()
    parsed = cpu_batch.parse_records(buf, starts, lengths)
    assert parsed is not None
    header_bytes = parsed.headers[1].header_bytes
    for at in range(int(starts[1]), int(starts[1]) + header_bytes):
        damaged = buf.copy()
        damaged[at] ^= 0x10
        assert cpu_batch.parse_records(damaged, starts, lengths) is None, at
    # a record length that disagrees with its chunks; one that runs past the buffer
    assert cpu_batch.parse_records(buf, starts, lengths + np.eye(len(lengths), dtype=np.int64)[3]) is None
    assert cpu_batch.parse_records(buf[:-1], starts, lengths) is None


@pytest.mark.parametrize("in_place", [True, False])
def test_a_frame_that_decodes_to_another_size_is_a_value_error(in_place: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if not in_place:
        _without_block_decoder(monkeypatch)
    tensors, buf, starts, lengths = _records()
    parsed = cpu_batch.parse_records(buf, starts, lengths)
    assert parsed is not None
    # chunk payload damage passes the header checks (the caller checks chunk CRCs first); the
    # decoder refuses what no longer decodes to its chunk's size
    j = int(parsed.first_chunk[9]) + 3  # torch.full((1000,), 2.0): its sign+exponent plane
    assert parsed.sizes[j] < 1000  # compressed
    damaged = buf.copy()
    damaged[parsed.starts[j] + 4 : parsed.starts[j] + parsed.sizes[j]] = 0xFF
    with pytest.raises(ValueError):
        cpu_batch.decode_records(damaged, parsed, [np.empty(h.raw_nbytes, dtype=np.uint8) for h in parsed.headers])


# -- deltas encoded together ---------------------------------------------------------------------
def _delta_cases(seed: int = 0) -> tuple[list[torch.Tensor], list[np.ndarray]]:
    """Tensors and their bases' bytes: small updates, no change, a wholesale change, other dtypes."""
    g = torch.Generator().manual_seed(seed)
    tensors = [t for t in _mixed(seed) if t.numel() and not t.is_complex()]
    bases = []
    for i, t in enumerate(tensors):
        if t.is_floating_point() and i % 3 == 0:
            base = (t.float() + torch.randn(t.shape, generator=g) * 1e-3).to(t.dtype)  # small update
        elif i % 3 == 1:
            base = t.clone()  # unchanged
        else:
            base = torch.from_numpy(np.random.default_rng(i).integers(0, 256, t.numel() * t.element_size(),
                                                                       dtype=np.uint8)).view(t.dtype).view(t.shape)
        bases.append(tensor_to_host_bytes(base).copy())
    return tensors, bases


@pytest.mark.parametrize("chunk_bytes", [DEFAULT_CHUNK_BYTES, 4096])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("keep", ["none", "fresh", "base"])
def test_delta_batch_records_decode_to_the_items_and_match_encode_item(chunk_bytes: int, threads: int,
                                                                       keep: str) -> None:
    """Each record is a valid v2 delta record, byte for byte encode_item's (the same first-chunk
    probe: a plane whose first chunk does not shrink is stored raw, "none"), and applied to its
    base it gives the item. Items kept for the next save (in fresh memory, or over their own
    base) have their bytes there afterwards, and the records are the same."""
    from nvdcp.pipeline.policy import choose_delta_layout
    from nvdcp.transform import delta as delta_transform

    tensors, bases = _delta_cases()
    digests = [1000 + i for i in range(len(tensors))]
    layout_of = functools.partial(choose_delta_layout, codec="zstd")
    given = [b.copy() for b in bases]  # the batch may overwrite these (keep="base")
    keeps = {"none": None, "fresh": [np.zeros_like(b) for b in bases], "base": given}[keep]
    records = cpu_batch.encode_delta_batch(tensors, given, digests, [dtype_code(t.dtype) for t in tensors],
                                           layout_of, chunk_bytes, threads, keeps)
    if keeps is not None:
        assert all(np.array_equal(k, tensor_to_host_bytes(t)) for k, t in zip(keeps, tensors))
    for t, base, digest, rec in zip(tensors, bases, digests, records):
        raw, kind = tensor_to_host_bytes(t), delta_transform.kind_for(t.dtype)
        ref = encode_item(raw, kind=KIND_TENSOR, dtype_code=dtype_code(t.dtype), shape=tuple(t.shape),
                          element_size=t.element_size(), layout=layout_of(t.dtype), pool=None,
                          chunk_bytes=chunk_bytes, base=base, base_digest=digest, delta_kind=kind)
        whole = memoryview(bytes(rec.record))
        parsed = parse_item_header(whole, "x")
        assert parsed == rec.header and parsed.is_delta and parsed.base_digest == digest
        assert parsed.delta_kind == kind and parsed.shape == tuple(t.shape) and parsed.raw_nbytes == raw.size
        assert whole.tobytes() == ref.header_bytes + b"".join(bytes(c) for c in ref.chunks), f"{t.dtype} {t.shape}"
        assert rec.unchanged == ref.unchanged == bool(np.array_equal(raw, base))
        # planes whose sample does not shrink are stored raw ("none"), as encode_item's probe does
        if rec.unchanged and raw.size:
            assert parsed.plane_codecs == ref.header.plane_codecs == (codec_id("zstd"),) * len(parsed.plane_codecs)
        elif raw.size >= 4096 * t.element_size() and not t.is_floating_point():  # random bytes in every plane
            assert parsed.plane_codecs == (0,) * len(parsed.plane_codecs), f"{t.dtype}"
        _, diff = decode_item(whole, "x", None, t.element_size())
        value = base.copy()
        delta_transform.apply_np(value, diff, kind, t.element_size())
        assert np.array_equal(value, raw), f"{t.dtype} {tuple(t.shape)}"


def _delta_records(seed: int = 0) -> tuple[list[torch.Tensor], list[np.ndarray], list[int], np.ndarray, np.ndarray,
                                           np.ndarray]:
    """Delta records of the delta cases and v1 records of the mixed tensors, interleaved back
    to back after a 5-byte lead: a level of a chain where some items are stored whole."""
    from nvdcp.pipeline.policy import choose_delta_layout

    tensors, bases = _delta_cases(seed)
    digests = [7 + 3 * i for i in range(len(tensors))]
    records = cpu_batch.encode_delta_batch(tensors, bases, digests, [dtype_code(t.dtype) for t in tensors],
                                           functools.partial(choose_delta_layout, codec="zstd"), DEFAULT_CHUNK_BYTES)
    blobs = []
    for rec, t in zip(records, tensors):
        blobs += [bytes(rec.record), _reference(t, "zstd", DEFAULT_CHUNK_BYTES)]
    lengths = np.array([len(b) for b in blobs], dtype=np.int64)
    starts = 5 + np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    buf = np.frombuffer(b"\x00" * 5 + b"".join(blobs), dtype=np.uint8).copy()
    return tensors, bases, digests, buf, starts, lengths


def test_delta_records_parse_and_decode_together_with_whole_ones() -> None:
    """v2 records parse in the same batch as v1 ones, with their base digest and delta kind, and
    decode to the differences that rebuild each item from its base."""
    from nvdcp.transform import delta as delta_transform

    tensors, bases, digests, buf, starts, lengths = _delta_records()
    parsed = cpu_batch.parse_records(buf, starts, lengths)
    assert parsed is not None
    for i, (at, n) in enumerate(zip(starts.tolist(), lengths.tolist())):
        one = parse_item_header(buf[at : at + n].data, "x")
        assert parsed.headers[i] == one and parsed.headers[i].stored_crc == one.stored_crc
        assert parsed.headers[i].is_delta == (i % 2 == 0)
        if i % 2 == 0:
            assert parsed.headers[i].base_digest == digests[i // 2]
            assert parsed.headers[i].delta_kind == delta_transform.kind_for(tensors[i // 2].dtype)
    outs = [np.empty(h.raw_nbytes, dtype=np.uint8) for h in parsed.headers]
    cpu_batch.decode_records(buf, parsed, outs)
    for i, t in enumerate(tensors):
        raw, value = tensor_to_host_bytes(t), bases[i].copy()
        delta_transform.apply_np(value, outs[2 * i], parsed.headers[2 * i].delta_kind, t.element_size())
        assert np.array_equal(value, raw) and np.array_equal(outs[2 * i + 1], raw), f"{t.dtype} {tuple(t.shape)}"


@pytest.mark.parametrize("path", ["in place", "native merge", "numpy"])
def test_delta_records_applied_to_their_bases_as_they_decode(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``apply``: each delta record's planes are interleaved straight into its base's bytes (one
    pass), giving what decoding it and then applying it gives; whole records beside them are
    written as before. Decoded block by block in place, or decoded and then merged with the
    native merge-and-apply or without it."""

    calls = _counting_block_decoder(monkeypatch) if path == "in place" else None
    if path != "in place":
        _without_block_decoder(monkeypatch)
    if path == "numpy":
        monkeypatch.setattr(cpu_batch, "_native_merge_apply_many", lambda: None)
    tensors, bases, _, buf, starts, lengths = _delta_records(seed=3)
    parsed = cpu_batch.parse_records(buf, starts, lengths)
    assert parsed is not None
    outs = [bases[i // 2].copy() if h.is_delta else np.full(h.raw_nbytes, 0xAB, dtype=np.uint8)
            for i, h in enumerate(parsed.headers)]
    apply = [(h.delta_kind, tensors[i // 2].element_size()) if h.is_delta else None for i, h in enumerate(parsed.headers)]
    cpu_batch.decode_records(buf, parsed, outs, apply=apply)
    for i, t in enumerate(tensors):
        raw = tensor_to_host_bytes(t)
        assert np.array_equal(outs[2 * i], raw) and np.array_equal(outs[2 * i + 1], raw), f"{t.dtype} {tuple(t.shape)}"
    assert calls is None or calls  # the in-place path did the decoding


def test_any_damaged_delta_header_sends_the_batch_to_the_one_by_one_path() -> None:
    """The base digest, delta kind and flags of a v2 header are checked like every other field."""
    _, _, _, buf, starts, lengths = _delta_records(seed=1)
    parsed = cpu_batch.parse_records(buf, starts, lengths)
    assert parsed is not None and parsed.headers[2].is_delta
    for at in range(int(starts[2]), int(starts[2]) + parsed.headers[2].header_bytes):
        damaged = buf.copy()
        damaged[at] ^= 0x04
        assert cpu_batch.parse_records(damaged, starts, lengths) is None, at


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("threads", [1, 3])
def test_the_fused_gather_copies_and_checksums_what_the_two_steps_do(threads: int, native: bool,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """copy_ranges_checksummed: the same bytes and CRC32Cs as copy_ranges then checksum_ranges,
    over two sources, empty ranges included and more than a thread's 1 MiB share in all; with
    the native library and without it."""
    from nvdcp.format.crc import checksum_ranges

    if not native:
        monkeypatch.setattr(cpu_batch, "_native_gather_crc", lambda: None)
    elif cpu_batch._native_gather_crc() is None:
        pytest.skip("the native library is not built here")

    rng = np.random.default_rng(threads)
    sources = [rng.integers(0, 256, size=3 << 20, dtype=np.uint8), rng.integers(0, 256, size=70_000, dtype=np.uint8)]
    sizes = rng.integers(0, 65_537, size=90).astype(np.int64)
    sizes[[0, 7, 89]] = 0
    src_of = rng.integers(0, 2, size=90).astype(np.int64)
    src_off = np.array([rng.integers(0, len(sources[b]) - n + 1) for b, n in zip(src_of, sizes)], dtype=np.int64)
    dst = np.concatenate(([0], np.cumsum(sizes + 3)[:-1])).astype(np.int64)  # gaps between ranges
    want = np.zeros(int(dst[-1] + sizes[-1] + 3), dtype=np.uint8)
    cpu_batch.copy_ranges(want, dst, sources, src_of, src_off, sizes)
    got = np.zeros_like(want)
    crcs = cpu_batch.copy_ranges_checksummed(got, dst, sources, src_of, src_off, sizes, threads)
    assert np.array_equal(got, want)
    assert np.array_equal(crcs, checksum_ranges(want, dst, sizes))
    assert int(sizes.sum()) > 1 << 20 and crcs.dtype == np.uint32

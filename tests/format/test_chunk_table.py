"""ChunkTable: a record's chunk table as one uint32 array, still a sequence of (size, crc) pairs."""

from __future__ import annotations

import gc
import pickle

import numpy as np
import pytest

from nvdcp.format.header import ChunkTable, ItemHeader, parse_item_header_only

PAIRS = [(10, 0xDEADBEEF), (65536, 1), (0, 0xFFFFFFFF)]


def test_sequence_of_pairs() -> None:
    t = ChunkTable(PAIRS)
    assert len(t) == 3 and list(t) == PAIRS and t[1] == (65536, 1) and t[-1] == PAIRS[-1] and t[:2] == PAIRS[:2]
    assert [s for s, _ in t] == [10, 65536, 0] and t.total == 65546
    assert t.sizes.tolist() == [10, 65536, 0] and t.crcs.tolist() == [0xDEADBEEF, 1, 0xFFFFFFFF]
    assert np.asarray(t, dtype=np.int64).tolist() == [list(p) for p in PAIRS]
    assert t == tuple(PAIRS) and t == ChunkTable.from_columns([10, 65536, 0], [0xDEADBEEF, 1, 0xFFFFFFFF])
    assert t != ChunkTable(PAIRS[:2]) and t != [(10, 0xDEADBEEF)] * 3
    assert hash(t) == hash(ChunkTable(list(PAIRS)))
    assert pickle.loads(pickle.dumps(t)) == t
    assert len(ChunkTable()) == 0 and ChunkTable().total == 0 and ChunkTable().pack() == b""


def test_pack_is_the_struct_layout_and_unpacks() -> None:
    import struct

    t = ChunkTable(PAIRS)
    assert t.pack() == b"".join(struct.pack("<II", s, c) for s, c in PAIRS)
    assert ChunkTable.unpack(memoryview(t.pack() + b"xx"), 3) == t


def test_bad_values_are_refused() -> None:
    with pytest.raises(ValueError, match="32 bits"):
        ChunkTable([(1 << 32, 0)])
    with pytest.raises(ValueError, match="32 bits"):
        ChunkTable([(-1, 0)])
    with pytest.raises(ValueError, match="2 chunk sizes for 1 CRCs"):
        ChunkTable.from_columns([1, 2], [3])


def test_headers_take_pairs_or_tables_and_round_trip() -> None:
    common = dict(kind=0, dtype_code=1, shape=(4, 2), raw_nbytes=32, transform=1, plane_codecs=(1, 1, 1, 1),
                  chunk_bytes=1024)
    pairs = ((3, 7), (4, 8), (5, 9), (6, 10))
    a = ItemHeader(chunks=pairs, **common)  # type: ignore[arg-type]
    b = ItemHeader(chunks=ChunkTable(pairs), **common)  # type: ignore[arg-type]
    assert isinstance(a.chunks, ChunkTable) and a == b and a.pack() == b.pack() and a.stored_nbytes == 18
    parsed = parse_item_header_only(memoryview(a.pack()), "test")
    assert parsed == a and list(parsed.chunks) == list(pairs)


def test_a_large_table_is_a_few_objects() -> None:
    sizes = np.arange(20_000) % 65536
    gc.collect()
    before = len(gc.get_objects())
    tables = [ChunkTable.from_columns(sizes, sizes[::-1]) for _ in range(5)]
    gc.collect()
    assert len(gc.get_objects()) - before < 50
    assert sum(len(t) for t in tables) == 100_000


def test_parsed_headers_carry_their_digest() -> None:
    from nvdcp.format.digest import digest_of_header, digest_of_record_header

    h = ItemHeader(kind=0, dtype_code=1, shape=(8,), raw_nbytes=32, transform=1, plane_codecs=(1, 1, 1, 1),
                   chunks=ChunkTable([(3, 7), (4, 8), (5, 9), (6, 10)]), chunk_bytes=1024)
    packed = h.pack()
    parsed = parse_item_header_only(memoryview(packed), "t")
    assert h.stored_crc is None and parsed.stored_crc == digest_of_record_header(packed)
    assert digest_of_header(parsed) == digest_of_header(h) == digest_of_record_header(packed)
    assert parsed == h  # the stored CRC is not part of equality

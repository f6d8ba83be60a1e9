"""The CPU load pipeline (batched reads, one CRC call per batch, decoding straight into the
destination tensors, large records in parts) and the batched save path: bit-exact round trips
of odd items, and corruption still detected and named."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

import nvdcp
from nvdcp.dcp import reader as reader_module
from nvdcp.pipeline import encoder as encoder_module
from tests.conftest import bit_equal, random_tensor, weights_like
from tests.dcp.helpers import empty_like_sd, failure_of, item_span, load, save

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")


def _odd_state() -> dict[str, Any]:
    """Many small items of every kind the CPU path special-cases."""
    sd: dict[str, Any] = {f"small.{i}": weights_like((37 + i,), seed=i) for i in range(40)}
    sd.update({
        "bf16": weights_like((300, 7), seed=50).to(torch.bfloat16),
        "int64": random_tensor(torch.int64, (1000,), seed=51),
        "bool": random_tensor(torch.bool, (333,), seed=52),
        "complex": torch.randn(200, dtype=torch.complex64, generator=torch.Generator().manual_seed(53)),
        "scalar": torch.tensor(3.25),
        "empty": torch.empty(0, 5),
        "non_contiguous": weights_like((64, 48), seed=54).t(),
        "multi_block": weights_like((70_000,), seed=55),  # 5 blocks of 64 Ki elements x 4 planes
        "blob": io.BytesIO(b"bytes item " * 1000),
        "extra": {"step": 7, "note": "pickled"},
    })
    return sd


def _check(sd: dict[str, Any], back: dict[str, Any]) -> None:
    for key, value in sd.items():
        if isinstance(value, torch.Tensor):
            assert bit_equal(back[key], value), key
        elif isinstance(value, io.BytesIO):
            assert back[key].getvalue() == value.getvalue(), key
        else:
            assert back[key] == value, key


def _fresh(sd: dict[str, Any]) -> dict[str, Any]:
    out = empty_like_sd(sd)
    out["blob"] = io.BytesIO()
    return out


def test_odd_items_round_trip_bit_exact(tmp_path: Path) -> None:
    sd = _odd_state()
    save(sd, tmp_path)
    back = _fresh(sd)
    load(back, tmp_path)
    _check(sd, back)


def test_small_batches_and_parts_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiny batch and part sizes: every batch boundary and every part of a record is exercised."""
    monkeypatch.setattr(reader_module, "CPU_BATCH_BYTES", 3000)
    monkeypatch.setattr(reader_module, "CPU_BATCH_ITEMS", 3)
    monkeypatch.setattr(reader_module, "CPU_SEGMENT_BYTES", 100_000)
    sd = _odd_state()
    save(sd, tmp_path)
    back = _fresh(sd)
    reader = load(back, tmp_path)
    _check(sd, back)
    assert reader.last_report is not None and reader.last_report.raw_bytes > 0


def test_destination_that_is_not_dense_is_filled_through_a_copy(tmp_path: Path) -> None:
    sd = {"w": weights_like((64, 32), seed=1), "v": weights_like((1000,), seed=2)}
    save(sd, tmp_path)
    base = torch.zeros(32, 64)
    back = {"w": base.t(), "v": torch.zeros(1000)}  # a transposed view: not decoded in place
    load(back, tmp_path)
    assert bit_equal(back["w"], sd["w"]) and bit_equal(back["v"], sd["v"])


def test_partial_load_reads_past_the_items_it_skips(tmp_path: Path) -> None:
    sd = {f"p{i}": weights_like((100 + i,), seed=i) for i in range(30)}
    save(sd, tmp_path)
    back = {k: torch.zeros_like(v) for k, v in sd.items() if int(k[1:]) % 3 == 0}
    load(back, tmp_path)
    for key, value in back.items():
        assert bit_equal(value, sd[key])


def test_thread_count_one(tmp_path: Path) -> None:
    sd = _odd_state()
    save(sd, tmp_path)
    back = _fresh(sd)
    load(back, tmp_path, thread_count=1)
    _check(sd, back)


def _load_error(path: Path, sd: dict[str, Any]) -> BaseException:
    with pytest.raises((CheckpointException, nvdcp.NvdcpError)) as info:
        load(_fresh(sd), path)
    return failure_of(info.value)


@pytest.mark.parametrize("fqn", ["small.17", "multi_block", "blob"])
@pytest.mark.parametrize("parts", [False, True])
def test_flipped_payload_byte_names_file_item_and_chunk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fqn: str, parts: bool
) -> None:
    if parts:
        monkeypatch.setattr(reader_module, "CPU_SEGMENT_BYTES", 100_000)
    sd = _odd_state()
    save(sd, tmp_path)
    f, off, length = item_span(tmp_path, fqn)
    data = bytearray(f.read_bytes())
    data[off + length - 7] ^= 0x04
    f.write_bytes(data)
    err = _load_error(tmp_path, sd)
    assert isinstance(err, nvdcp.CorruptCheckpointError)
    msg = str(err)
    assert f.name in msg and repr(fqn) in msg and "chunk" in msg and "checksum mismatch" in msg, msg
    assert "re-reads" in msg  # damage that stays is read again before it is reported


@pytest.mark.parametrize("fqn", ["small.3", "multi_block"])
def test_flipped_header_byte_names_the_item(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fqn: str) -> None:
    monkeypatch.setattr(reader_module, "CPU_SEGMENT_BYTES", 100_000)
    sd = _odd_state()
    save(sd, tmp_path)
    f, off, _ = item_span(tmp_path, fqn)
    data = bytearray(f.read_bytes())
    data[off + 30] ^= 0x01
    f.write_bytes(data)
    err = _load_error(tmp_path, sd)
    assert isinstance(err, nvdcp.CorruptCheckpointError)
    assert f.name in str(err) and repr(fqn) in str(err)


def test_metadata_shape_mismatch_is_caught(tmp_path: Path) -> None:
    """.metadata and the item header disagree: refused, naming the item (not decoded in place)."""
    save({"w": weights_like((10, 10))}, tmp_path)
    reader = nvdcp.NvcompReader(tmp_path)
    md = reader.read_metadata()
    reader.set_up_storage_reader(md, True)
    index = next(iter(md.storage_data))
    assert reader._cpu_item(index, md.storage_data[index], []).shape == (10, 10)
    reader._chunks = {(index.fqn, tuple(index.offset or ())): (torch.float32, (5, 20))}
    with pytest.raises(nvdcp.CorruptCheckpointError, match=r"'w'.*stored shape \(10, 10\) does not match"):
        reader._load_cpu_batch(reader_module._CpuBatch([reader._cpu_item(index, md.storage_data[index], [])],
                                                       md.storage_data[index].offset + md.storage_data[index].length),
                               nvdcp.report.Report("load", "x"))


def test_truncated_file_names_file_and_item(tmp_path: Path) -> None:
    sd = _odd_state()
    save(sd, tmp_path)
    f, _, _ = item_span(tmp_path, "small.0")
    f.write_bytes(f.read_bytes()[:-10])
    err = _load_error(tmp_path, sd)
    assert isinstance(err, nvdcp.TruncatedCheckpointError)
    assert f.name in str(err)


def test_save_batches_small_items_into_few_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Small records are written in batches, large ones directly; offsets stay right."""
    from nvdcp.storage import local

    calls = []
    original = local._LocalWriteStream.writelines

    def counting(self: Any, parts: Any) -> None:
        calls.append(1)
        original(self, parts)

    monkeypatch.setattr(local._LocalWriteStream, "writelines", counting)
    sd = {f"p{i}": weights_like((50,), seed=i) for i in range(500)}
    sd["big"] = weights_like((200_000,), seed=9)
    save(sd, tmp_path)
    assert len(calls) < 10
    back = empty_like_sd(sd)
    load(back, tmp_path)
    _check(sd, back)


def test_small_item_encodes_match_one_at_a_time(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Batching small items on the pool stores the same bytes as encoding them one by one."""
    sd = {f"p{i}": weights_like((300,), seed=i) for i in range(100)}
    save(sd, tmp_path / "batched")
    monkeypatch.setattr(encoder_module, "SMALL_ITEM_BYTES", 0)  # every item alone, as before
    save(sd, tmp_path / "single")
    a = nvdcp.NvcompReader(tmp_path / "batched").read_metadata().storage_data
    b = nvdcp.NvcompReader(tmp_path / "single").read_metadata().storage_data
    assert [(k.fqn, v.length) for k, v in a.items()] == [(k.fqn, v.length) for k, v in b.items()]


def test_sound_batches_decode_together_and_damage_falls_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sound checkpoint's CPU batches are decoded together (the one-by-one parser is never
    called); a damaged batch goes one by one, which names the item."""
    monkeypatch.setattr(reader_module, "gpu_available", lambda: False)  # the CPU path, GPU or not
    sd = _odd_state()
    save(sd, tmp_path)
    one_by_one = []
    real = reader_module.NvcompReader._parse_in_batch

    def spy(self: Any, item: Any, *args: Any) -> Any:
        one_by_one.append(item.index.fqn)
        return real(self, item, *args)

    monkeypatch.setattr(reader_module.NvcompReader, "_parse_in_batch", spy)
    back = _fresh(sd)
    load(back, tmp_path)
    _check(sd, back)
    assert one_by_one == []
    f, off, length = item_span(tmp_path, "small.5")
    data = bytearray(f.read_bytes())
    data[off + length - 3] ^= 0x20
    f.write_bytes(data)
    err = _load_error(tmp_path, sd)
    assert isinstance(err, nvdcp.CorruptCheckpointError) and repr("small.5") in str(err)
    assert "small.5" in one_by_one


@pytest.mark.parametrize("path", ["together", "one_by_one"])
@pytest.mark.parametrize("parts", [False, True])
def test_cpu_items_decode_into_the_planners_tensors_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str, parts: bool
) -> None:
    """Whole tensors land in the planner's own tensors, bit-exact: by address in batches, through
    a view made on demand on the one-by-one path, and through one shared view for a large item's
    parts (0-d, empty, bool and complex items included); tensors that cannot take the bytes as
    they are (non-contiguous) are filled by copy."""
    monkeypatch.setattr(reader_module, "gpu_available", lambda: False)
    if parts:
        monkeypatch.setattr(reader_module, "CPU_SEGMENT_BYTES", 100_000)
    if path == "one_by_one":
        monkeypatch.setattr(reader_module.NvcompReader, "_decode_together", lambda self, *args: None)
    in_place: dict[str, bool] = {}
    commit = reader_module.NvcompReader._commit_loaded

    def spy(self: Any, reqs: Any, header: Any, data: Any, planner: Any) -> None:
        in_place[reqs[0].dest_index.fqn] = isinstance(data, reader_module._InPlace)
        commit(self, reqs, header, data, planner)

    monkeypatch.setattr(reader_module.NvcompReader, "_commit_loaded", spy)
    sd = _odd_state()
    save(sd, tmp_path)
    back = _fresh(sd)
    back["non_contiguous"] = torch.empty(64, 48).t()  # a destination that cannot take the bytes as they are
    back["small.0"] = torch.nn.Parameter(torch.empty(37), requires_grad=False)  # a frozen parameter: its data
    before = {k: v.data_ptr() for k, v in back.items() if isinstance(v, torch.Tensor)}
    load(back, tmp_path)
    _check(sd, back)
    assert {k: v.data_ptr() for k, v in back.items() if isinstance(v, torch.Tensor)} == before
    dense = [k for k, v in back.items() if isinstance(v, torch.Tensor) and v.is_contiguous() and v.numel()]
    assert all(in_place[k] for k in dense), {k: in_place.get(k) for k in dense}
    assert in_place["non_contiguous"] is False


def test_which_host_bound_records_auto_decodes_on_the_cpu() -> None:
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    from nvdcp.dcp import descriptor

    small, limit = 1000, reader_module.HOST_DECODE_RECORD_BYTES
    for codec, length, expected in [("zstd", small, True), ("none", limit, True), ("zstd", limit + 1, False),
                                    ("gdeflate", small, False), ("ans", small, False)]:
        info = _StorageInfo("f", 0, length, descriptor.descriptors(codec))
        assert reader_module._host_decodes_faster(info) is expected, (codec, length)
    delta = _StorageInfo("f", 0, small, descriptor.descriptors("zstd", 2))
    assert reader_module._host_decodes_faster(delta) is False  # deltas: rebuilt on their own path


def test_small_deltas_encode_together_and_load_bit_exact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Small host items of a delta save (and of the full save that keeps their bytes) go through
    the batch encoder, never one by one; deltas that pay are deltas, an item changed wholesale is
    stored whole, and the chain loads bit-exactly."""
    from nvdcp.dcp import descriptor

    calls: list[str] = []
    original = encoder_module.ItemEncoder.encode_tensor

    def counting(self: Any, tensor: torch.Tensor, where: str, *args: Any, **kwargs: Any) -> Any:
        calls.append(where)
        return original(self, tensor, where, *args, **kwargs)

    monkeypatch.setattr(encoder_module.ItemEncoder, "encode_tensor", counting)
    policy = nvdcp.DeltaPolicy(full_every=4, min_item_bytes=0)
    sd = {f"p{i}": weights_like((300, 20), seed=i) for i in range(40)}
    sd["b16"] = weights_like((64, 64), torch.bfloat16, seed=99)
    saved = []
    for step in range(3):
        save(sd, tmp_path / f"s{step}", delta=policy)
        saved.append({k: v.clone() for k, v in sd.items()})
        g = torch.Generator().manual_seed(step)
        for v in sd.values():
            v.add_((torch.randn(v.shape, generator=g) * 1e-4).to(v.dtype))
        sd["p7"].copy_(weights_like((300, 20), seed=1000 + step))  # changed wholesale: no delta pays
    assert calls == []
    md = nvdcp.NvcompReader(tmp_path / "s2").read_metadata().storage_data
    kinds = {ix.fqn: descriptor.is_delta(info) for ix, info in md.items()}
    assert kinds["p0"] and kinds["b16"] and not kinds["p7"]
    for step, expected in enumerate(saved):
        back = empty_like_sd(expected)
        load(back, tmp_path / f"s{step}")
        _check(expected, back)


@pytest.mark.parametrize("thread_count", [1, 3])
def test_small_host_tensors_reach_the_files_as_record_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, thread_count: int
) -> None:
    """Small host tensors stored whole are written a batch at a time (records back to back, one
    write and one loop of WriteResults each); a large tensor and a bytes item one by one; all of
    it loads bit-exact."""
    from nvdcp.dcp import writer as writer_module

    batched: list[int] = []
    single: list[str] = []
    write_batch, write = writer_module._FileWriter.write_batch, writer_module._FileWriter.write
    write_streamed = writer_module._FileWriter.write_streamed

    def counting_batch(self: Any, batch: Any) -> None:
        batched.append(len(batch))
        write_batch(self, batch)

    def counting_write(self: Any, item: Any, encoded: Any, borrowed: bool = False) -> None:
        single.append(item.index.fqn)
        write(self, item, encoded, borrowed)

    def counting_streamed(self: Any, item: Any, record: Any) -> None:
        single.append(item.index.fqn)
        write_streamed(self, item, record)

    monkeypatch.setattr(writer_module._FileWriter, "write_batch", counting_batch)
    monkeypatch.setattr(writer_module._FileWriter, "write", counting_write)
    monkeypatch.setattr(writer_module._FileWriter, "write_streamed", counting_streamed)
    sd: dict[str, Any] = {f"small{i}": random_tensor(torch.bfloat16 if i % 3 else torch.float32, (64, 9 + i), seed=i)
                          for i in range(300)}
    sd["large"] = weights_like((1100, 1024), seed=7)  # over the small-item size: encoded alone
    sd["blob"] = io.BytesIO(b"not a tensor")
    save(sd, tmp_path, thread_count=thread_count)
    assert sum(batched) == 300
    assert sorted(single) == ["blob", "large"]
    out = empty_like_sd(sd)
    load(out, tmp_path)
    for key, value in sd.items():
        if key == "blob":
            assert out[key].getvalue() == b"not a tensor"
        else:
            assert bit_equal(out[key], value), key

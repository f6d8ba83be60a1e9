"""NvcompWriter / NvcompReader as drop-ins for torch's FileSystemWriter / FileSystemReader (and
FsspecWriter / FsspecReader): the stock constructor arguments in the same positions, and the
scenarios torch's own DCP tests run against stock DCP, with nvdcp's classes in its place.

Mirrors (written here, not copied) test/distributed/checkpoint/ of pytorch/pytorch:

- test_file_system_checkpoint_cpu.py: tensor-only state dicts at thread_count 1 and 2, tensors
  with a Stateful blob (with ``_extensions``), byte items, sharded tensors and resharding
  (in test_dropin_multiprocess.py: 2 gloo ranks save, 3 load);
- test_fsspec.py: save/load through fsspec (``memory://``), and overwrite refusal, raised by stock
  as a RuntimeError "Checkpoint already exists";
- e2e/test_e2e_save_and_load.py: model + optimizer + Stateful objects + a train state holding a
  BytesIO, trained on after the load; stateful vs non-stateful loads; ``{}``; partial loads by key;
  ``async_save`` with ``cache_staged_state_dict``;
- test_format_utils.py: ``torch_save_to_dcp`` writes a stock checkpoint, which NvcompReader
  loads. ``dcp_to_torch_save`` does NOT apply to nvdcp checkpoints: it hard-codes
  ``FileSystemReader``, which refuses nvdcp's items (checked below); the same conversion with
  NvcompReader (torch's ``_load_state_dict`` + ``_EmptyStateDictLoadPlanner``) works.
  ``BroadcastingTorchSaveReader`` / ``DynamicMetaLoadPlanner`` read a ``torch.save`` file, not
  DCP storage: nothing of nvdcp's is involved, so they are not mirrored.
"""

from __future__ import annotations

import inspect
import io
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._extension import ZStandard
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import SerializationFormat
from torch.distributed.checkpoint.format_utils import (
    _EmptyStateDictLoadPlanner,
    dcp_to_torch_save,
    torch_save_to_dcp,
)
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict, _load_state_dict_from_keys

import nvdcp
from nvdcp.dcp import stock_items
from tests.conftest import bit_equal
from tests.dcp.helpers import failure_of

pytestmark = pytest.mark.timeout(120)

NVDCP_KEYWORD_ONLY = ("codec", "chunk_bytes", "codec_threads", "storage_options", "gpu", "stager", "encoder")


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sees the one-time warnings afresh."""
    monkeypatch.setattr(stock_items, "_warned", set())


def _params(cls: type) -> list[inspect.Parameter]:
    return list(inspect.signature(cls.__init__).parameters.values())[1:]  # type: ignore[misc]


def _positional(cls: type) -> list[inspect.Parameter]:
    return [p for p in _params(cls) if p.kind == p.POSITIONAL_OR_KEYWORD]


# -- constructors ----------------------------------------------------------------------------------
@pytest.mark.parametrize("stock, ours", [(FileSystemWriter, nvdcp.NvcompWriter), (FileSystemReader, nvdcp.NvcompReader)])
def test_stock_positional_arguments_in_the_same_positions(stock: type, ours: type) -> None:
    theirs, mine = _positional(stock), _positional(ours)
    assert [p.name for p in mine[: len(theirs)]] == [p.name for p in theirs]
    for a, b in zip(theirs, mine):
        # serialization_format: stock TORCH_SAVE, ours None (the same); thread_count: stock 1,
        # ours None (chosen per save: several data files on local storage)
        if a.name not in ("serialization_format", "thread_count"):
            assert a.default == b.default, a.name
    assert len(mine) == len(theirs), "nvdcp's own arguments must come after, keyword-only"


def test_fsspec_arguments_accepted() -> None:
    """FsspecWriter's positions agree up to per_thread_copy_ahead; the rest are accepted by
    keyword; both take **kwargs (fsspec options) as FsspecWriter/FsspecReader do."""
    for stock, ours in ((FsspecWriter, nvdcp.NvcompWriter), (FsspecReader, nvdcp.NvcompReader)):
        names = {p.name for p in _params(ours)}
        theirs = [p for p in _params(stock) if p.kind == p.POSITIONAL_OR_KEYWORD]
        assert {p.name for p in theirs} <= names
        assert any(p.kind == p.VAR_KEYWORD for p in _params(ours))
    assert [p.name for p in _positional(FsspecWriter)[:4]] == [p.name for p in _positional(nvdcp.NvcompWriter)[:4]]


def test_nvdcp_arguments_stay_keyword_only() -> None:
    kinds = {p.name: p.kind for p in _params(nvdcp.NvcompWriter)}
    assert all(kinds[n] == inspect.Parameter.KEYWORD_ONLY for n in NVDCP_KEYWORD_ONLY)
    kinds = {p.name: p.kind for p in _params(nvdcp.NvcompReader)}
    assert all(kinds[n] == inspect.Parameter.KEYWORD_ONLY for n in ("thread_count", "codec_threads", "storage_options", "gpu"))


def test_positional_construction_as_with_stock(tmp_path: Path) -> None:
    sd = {f"t{i}": torch.randn(100, 10) for i in range(6)}
    args = (True, False, 2, 10_000_000, False, True, None, SerializationFormat.TORCH_SAVE)
    stock = FileSystemWriter(tmp_path / "stock", *args)
    writer = nvdcp.NvcompWriter(tmp_path / "nv", *args)
    for attr in ("single_file_per_rank", "sync_files", "thread_count", "per_thread_copy_ahead", "overwrite"):
        assert getattr(writer, attr) == getattr(stock, attr), attr
    dcp.save(sd, storage_writer=writer)
    assert len([p for p in (tmp_path / "nv").iterdir() if p.suffix == ".nvdcp"]) == 2  # thread_count=2 files
    out = {k: torch.zeros(100, 10) for k in sd}
    dcp.load(out, storage_reader=nvdcp.NvcompReader(tmp_path / "nv", None))
    assert all(bit_equal(out[k], sd[k]) for k in sd)
    assert nvdcp.NvcompWriter(tmp_path / "nv2", True).single_file_per_rank is True  # what failed before


def test_stock_keywords_accepted_and_warned_once(tmp_path: Path) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(2):
            nvdcp.NvcompWriter(
                path=tmp_path / f"w{i}", single_file_per_rank=False, sync_files=False, thread_count=2,
                per_thread_copy_ahead=1 << 20, cache_staged_state_dict=True, overwrite=True,
                _extensions=[ZStandard()], serialization_format=SerializationFormat.SAFETENSORS, codec="zstd",
            )
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    for arg in ("single_file_per_rank", "per_thread_copy_ahead", "cache_staged_state_dict", "_extensions", "serialization_format"):
        assert sum(arg in m for m in messages) == 1, (arg, messages)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        nvdcp.NvcompWriter(tmp_path / "w", True, True, 1, 10_000_000, False, True, None, SerializationFormat.TORCH_SAVE)
        nvdcp.NvcompReader(tmp_path, None)
    assert not [w for w in caught if issubclass(w.category, UserWarning)], "stock defaults must not warn"


def test_stock_extensions_are_not_applied_and_the_checkpoint_is_nvdcp(tmp_path: Path) -> None:
    sd = {"t": torch.arange(1000, dtype=torch.float32)}
    with pytest.warns(UserWarning, match="_extensions"):
        writer = nvdcp.NvcompWriter(tmp_path, _extensions=[ZStandard()])
    dcp.save(sd, storage_writer=writer)
    assert nvdcp.is_nvdcp_checkpoint(tmp_path)
    out = {"t": torch.zeros(1000)}
    dcp.load(out, storage_reader=nvdcp.NvcompReader(tmp_path))
    assert bit_equal(out["t"], sd["t"])


def test_codec_passed_positionally_is_a_clear_type_error(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="codec="):
        nvdcp.NvcompWriter(tmp_path, "zstd")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        nvdcp.NvcompWriter(tmp_path, True, True, 1, 10_000_000, False, True, None, None, "zstd")  # type: ignore[misc]


def test_fsspec_options_for_a_local_path_are_ignored_with_a_warning(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="auto_mkdir"):
        writer = nvdcp.NvcompWriter(tmp_path, auto_mkdir=True)
    assert writer.storage_options == {}
    with pytest.raises(TypeError, match="endpoint_url"):
        nvdcp.NvcompReader("memory://x", storage_options={"endpoint_url": "a"}, endpoint_url="b")


# -- overwrite -------------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["local", "memory"])
def test_overwrite_false_refuses_with_what_stock_raises(tmp_path: Path, where: str) -> None:
    """test_fsspec.py's test_overwrite: overwrite=False on an empty location saves, True replaces,
    False on a checkpoint raises a RuntimeError saying it already exists."""
    path = str(tmp_path) if where == "local" else f"memory://ow-{uuid.uuid4().hex[:8]}"
    t1, t2 = torch.randn(10), torch.randn(10)
    dcp.save({"random": t1}, storage_writer=nvdcp.NvcompWriter(path, overwrite=False))
    dcp.save({"random": t2}, storage_writer=nvdcp.NvcompWriter(path, overwrite=True))
    sd = {"random": torch.zeros(10)}
    dcp.load(sd, storage_reader=nvdcp.NvcompReader(path))
    assert bit_equal(sd["random"], t2)
    with pytest.raises(CheckpointException, match="Checkpoint already exists") as info:
        dcp.save({"random": t1}, storage_writer=nvdcp.NvcompWriter(path, True, True, 1, 10_000_000, False, False))
    err = failure_of(info.value)
    assert isinstance(err, RuntimeError) and isinstance(err, nvdcp.CheckpointExistsError)
    assert isinstance(err, FileExistsError)  # as before, for nvdcp's own callers
    assert path.removeprefix("memory://") in str(err)
    dcp.load(sd, storage_reader=nvdcp.NvcompReader(path))
    assert bit_equal(sd["random"], t2), "a refused save leaves the checkpoint as it was"


# -- test_file_system_checkpoint_cpu.py --------------------------------------------------------------
class MyTestModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(5, 5)
        self.linear_2 = nn.Linear(5, 1)
        self.emb = nn.EmbeddingBag(5, 10)


class BlobState:
    """A Stateful holding bytes (saved as a byte item)."""

    def __init__(self, value: bytes) -> None:
        self.state = {"blob": value}

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.state = state_dict

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BlobState) and self.state == other.state


def _assert_sd_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for k, v in a.items():
        if isinstance(v, torch.Tensor):
            assert bit_equal(v, b[k]), k
        else:
            assert v == b[k], k


@pytest.mark.parametrize("thread_count", [1, 2])
def test_read_write_only_tensor(tmp_path: Path, thread_count: int) -> None:
    to_save = MyTestModule().state_dict()
    dcp.save(to_save, storage_writer=nvdcp.NvcompWriter(path=tmp_path, thread_count=thread_count))
    to_load = MyTestModule().state_dict()
    with pytest.raises(AssertionError):
        _assert_sd_equal(to_load, to_save)
    dcp.load(to_load, storage_reader=nvdcp.NvcompReader(path=tmp_path))
    _assert_sd_equal(to_load, to_save)


@pytest.mark.parametrize("thread_count", [1, 2])
def test_read_write_tensor_and_blob(tmp_path: Path, thread_count: int) -> None:
    to_save: dict[str, Any] = dict(MyTestModule().state_dict())
    to_save["test_blob"] = BlobState(b"SomeBlobForTesting")
    with pytest.warns(UserWarning, match="_extensions"):
        writer = nvdcp.NvcompWriter(path=tmp_path, thread_count=thread_count, _extensions=[ZStandard()])
    dcp.save(to_save, storage_writer=writer)
    to_load: dict[str, Any] = dict(MyTestModule().state_dict())
    to_load["test_blob"] = BlobState(b"")
    dcp.load(to_load, storage_reader=nvdcp.NvcompReader(path=tmp_path))
    _assert_sd_equal(to_load, to_save)


def test_save_load_bytes(tmp_path: Path) -> None:
    dcp.save({"bytes0": [1], "bytes1": "string"}, storage_writer=nvdcp.NvcompWriter(tmp_path))
    sd: dict[str, Any] = {"bytes0": [2], "bytes1": "other"}
    dcp.load(sd, storage_reader=nvdcp.NvcompReader(tmp_path))
    assert sd == {"bytes0": [1], "bytes1": "string"}


def test_nested_state_dict_of_tensors_bytes_ints_and_lists(tmp_path: Path) -> None:
    sd: dict[str, Any] = {
        "a": {"b": {"c": torch.arange(12).reshape(3, 4), "n": 7}, "lst": [torch.ones(2), torch.zeros(3, dtype=torch.int8)]},
        "ints": [1, 2, 3], "f": 2.5, "s": "text", "raw": b"\x00\x01", "none": None, "tup": (1, "x"),
        "io": io.BytesIO(b"stream bytes"),
    }
    dcp.save(sd, storage_writer=nvdcp.NvcompWriter(tmp_path, thread_count=2))
    out: dict[str, Any] = {
        "a": {"b": {"c": torch.zeros(3, 4, dtype=torch.int64), "n": 0}, "lst": [torch.zeros(2), torch.ones(3, dtype=torch.int8)]},
        "ints": [], "f": 0.0, "s": "", "raw": b"", "none": 1, "tup": (), "io": io.BytesIO(),
    }
    dcp.load(out, storage_reader=nvdcp.NvcompReader(tmp_path))
    assert torch.equal(out["a"]["b"]["c"], sd["a"]["b"]["c"]) and out["a"]["b"]["n"] == 7
    assert torch.equal(out["a"]["lst"][0], sd["a"]["lst"][0]) and torch.equal(out["a"]["lst"][1], sd["a"]["lst"][1])
    assert (out["ints"], out["f"], out["s"], out["raw"], out["none"], out["tup"]) == ([1, 2, 3], 2.5, "text", b"\x00\x01", None, (1, "x"))
    out["io"].seek(0)
    assert out["io"].read() == b"stream bytes"


# -- test_fsspec.py ----------------------------------------------------------------------------------
def test_fsspec_memory_round_trip_and_stock_fsspec_reader_refuses() -> None:
    url = f"memory://dropin-{uuid.uuid4().hex[:8]}"
    sd = dict(MyTestModule().state_dict())
    dcp.save(sd, storage_writer=nvdcp.NvcompWriter(url, True, True, 2), planner=dcp.DefaultSavePlanner())
    out = dict(MyTestModule().state_dict())
    dcp.load(out, storage_reader=nvdcp.NvcompReader(url), planner=dcp.DefaultLoadPlanner())
    _assert_sd_equal(out, sd)
    # stock FsspecReader knows no nvdcp descriptor: an nvdcp checkpoint needs NvcompReader
    with pytest.raises(CheckpointException, match="nvdcp"):
        dcp.load(dict(MyTestModule().state_dict()), storage_reader=FsspecReader(url))


# -- e2e/test_e2e_save_and_load.py -------------------------------------------------------------------
class DummyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net1, self.net2, self.net3, self.net4 = nn.Linear(8, 16), nn.Linear(16, 32), nn.Linear(32, 64), nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.net4(F.relu(self.net3(F.relu(self.net2(F.relu(self.net1(x))))))))


class StatefulObj:
    def __init__(self) -> None:
        self.data = torch.rand(10, 10)

    def state_dict(self) -> dict[str, Any]:
        return {"data": self.data}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.data = state_dict["data"]


@dataclass
class TrainState:
    step: int = 0
    current_loss: float = -1.0
    losses: list[float] = field(default_factory=list)

    def state_dict(self) -> dict[str, Any]:
        buf = io.BytesIO()
        torch.save(self.losses, buf)
        return {"step": torch.tensor(self.step, dtype=torch.int32),
                "current_loss": torch.tensor(self.current_loss, dtype=torch.float32), "losses": buf}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"].item())
        self.current_loss = float(state_dict["current_loss"].item())
        state_dict["losses"].seek(0)
        self.losses = torch.load(state_dict["losses"])


def _train(model: nn.Module, optim: torch.optim.Optimizer, steps: int) -> tuple[torch.Tensor, TrainState]:
    torch.manual_seed(0)
    state = TrainState()
    loss = torch.tensor(0.0)
    for _ in range(steps):
        loss = model(torch.rand(8, 8)).sum()
        loss.backward()
        state.step += 1
        state.current_loss = torch.rand(1).item()
        state.losses.append(state.current_loss)
        optim.step()
        optim.zero_grad()
    return loss, state


def test_e2e_model_optimizer_and_stateful_objects(tmp_path: Path) -> None:
    model = DummyModel()
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    _, train_state = _train(model, optim, 2)
    obj = StatefulObj()
    msd, osd = get_state_dict(model, optim)
    saved = {k: v.detach().clone() for k, v in msd.items()}
    dcp.save({"model": msd, "optimizer": osd, "s": obj, "train_state": train_state},
             storage_writer=nvdcp.NvcompWriter(tmp_path, True, True, 2))

    model2 = DummyModel()
    optim2 = torch.optim.Adam(model2.parameters(), lr=0.1)
    msd2, osd2 = get_state_dict(model2, optim2)
    obj2, train_state2 = StatefulObj(), TrainState()
    dcp.load({"model": msd2, "optimizer": osd2, "s": obj2, "train_state": train_state2},
             storage_reader=nvdcp.NvcompReader(tmp_path))
    set_state_dict(model2, optim2, model_state_dict=msd2, optim_state_dict=osd2)
    assert torch.equal(obj.data, obj2.data) and train_state == train_state2
    # training on gives the same loss
    loss, _ = _train(model, optim, 1)
    loss2, _ = _train(model2, optim2, 1)
    assert torch.equal(loss, loss2)

    # partial loads by key (torch's _load_state_dict_from_keys), through NvcompReader
    only_model = _load_state_dict_from_keys("model", storage_reader=nvdcp.NvcompReader(tmp_path))["model"]
    assert only_model.keys() == saved.keys()
    for k, v in saved.items():
        assert bit_equal(only_model[k], v), k
    state = _load_state_dict_from_keys("optimizer.state", storage_reader=nvdcp.NvcompReader(tmp_path))["optimizer"]["state"]
    assert "param_groups" not in state and state


def test_stateful_and_non_stateful_loads(tmp_path: Path) -> None:
    class StateDict(dict):  # type: ignore[type-arg]
        def __init__(self) -> None:
            super().__init__()
            self.set_item_called = False

        def __setitem__(self, key: Any, value: Any) -> None:
            self.set_item_called = True
            super().__setitem__(key, value)

    class Foo:
        def __init__(self) -> None:
            self.loaded = False

        def state_dict(self) -> dict[str, Any]:
            return {}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            self.loaded = True

    foo = Foo()
    sd = StateDict()
    sd["foo"] = foo
    sd.set_item_called = False
    dcp.save(sd, storage_writer=nvdcp.NvcompWriter(tmp_path / "a"))
    dcp.load(sd, storage_reader=nvdcp.NvcompReader(tmp_path / "a"))
    assert foo.loaded and not sd.set_item_called  # loaded in place

    sd = StateDict()
    sd["foo"] = {"replicated": torch.rand(10, 10), "bytes": [1, 2, 3, 4]}
    sd.set_item_called = False
    dcp.save(sd, storage_writer=nvdcp.NvcompWriter(tmp_path / "b"))
    dcp.load(sd, storage_reader=nvdcp.NvcompReader(tmp_path / "b"))
    assert sd.set_item_called  # replaced by the loaded state dict


def test_empty_state_dict(tmp_path: Path) -> None:
    dcp.save({}, storage_writer=nvdcp.NvcompWriter(tmp_path))
    dcp.load({}, storage_reader=nvdcp.NvcompReader(tmp_path))
    assert nvdcp.is_nvdcp_checkpoint(tmp_path) is False  # no item to mark it: nothing to tell apart


def test_async_save_with_cache_staged_state_dict(tmp_path: Path) -> None:
    model = DummyModel()
    sd = {"model": model.state_dict(), "step": 3}
    with pytest.warns(UserWarning, match="cache_staged_state_dict"):
        writer = nvdcp.NvcompWriter(tmp_path, cache_staged_state_dict=True)
    for _ in range(2):  # the writer's stager is reused, as a cached stock stager is
        dcp.async_save(sd, storage_writer=writer).result()
    out = {"model": DummyModel().state_dict(), "step": 0}
    for v in out["model"].values():
        v.zero_()
    dcp.load(out, storage_reader=nvdcp.NvcompReader(tmp_path))
    assert out["step"] == 3 and all(torch.equal(out["model"][k], v) for k, v in sd["model"].items())


# -- test_format_utils.py ----------------------------------------------------------------------------
class SimpleModelUneven(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net1, self.net2, self.net3, self.net4 = nn.Linear(5, 10), nn.Linear(10, 15), nn.Linear(15, 30), nn.Linear(30, 5)


def test_torch_save_to_dcp_loads_with_nvcomp_reader(tmp_path: Path) -> None:
    sd = {"model": SimpleModelUneven().state_dict()}
    torch.save(sd, tmp_path / "model.pt")
    torch_save_to_dcp(tmp_path / "model.pt", tmp_path / "dcp")  # writes with stock FileSystemWriter
    assert not nvdcp.is_nvdcp_checkpoint(tmp_path / "dcp")
    model = SimpleModelUneven()
    for p in model.parameters():
        p.data.zero_()
    dcp.load({"model": model}, storage_reader=nvdcp.NvcompReader(tmp_path / "dcp"))
    _assert_sd_equal(model.state_dict(), sd["model"])


def test_dcp_to_torch_save_needs_nvcomp_reader_for_nvdcp_checkpoints(tmp_path: Path) -> None:
    model = SimpleModelUneven()
    dcp.save({"model": model}, storage_writer=nvdcp.NvcompWriter(tmp_path / "dcp"))
    # torch's converter reads with FileSystemReader, which cannot decode nvdcp items
    with pytest.raises(CheckpointException, match="nvdcp"):
        dcp_to_torch_save(tmp_path / "dcp", tmp_path / "model.pt")
    # the same conversion with NvcompReader
    sd: dict[str, Any] = {}
    _load_state_dict(sd, storage_reader=nvdcp.NvcompReader(tmp_path / "dcp"), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    torch.save(sd, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt")
    assert loaded.keys() == {"model"}
    _assert_sd_equal(loaded["model"], model.state_dict())

"""nvdcp in torchtitan (``nvdcp.integrations.torchtitan``), against the torchtitan release on PyPI.

torchtitan's trainer needs CUDA, so its ``CheckpointManager`` is driven here the way
``Trainer.__init__`` / ``Trainer.train`` drive it: built from its config with the dataloader,
model parts, optimizers and LR schedulers containers, ``states={"train_state": trainer}`` and
the dump folder; ``load(step=config.load_step)`` before the loop; ``maybe_wait_for_staging()``
before each optimizer step; ``save(step, last_step=step == steps)`` after each step. The model
is a tiny FSDP2 (``fully_shard``) transformer whose attention runs on the CPU
(``scaled_dot_product_attention``), on gloo ranks on 127.0.0.1.

Two spawns (tests/_dist.py), phases in order:

    2 ranks  R   torchtitan's own manager (stock DCP): steps 1-12, saves 4 and 8, model-only
                 export at 12: the uninterrupted run, and a stock checkpoint
             S   nvdcp manager, empty folder, ``initial_load_path`` = R's stock step-8 (full state):
                 steps 9-12, last save exported as Hugging Face safetensors (torchtitan's writer),
                 which a further nvdcp manager then loads (``initial_load_in_hf``)
             A.m nvdcp manager in mode m (disabled, async, async_with_pinned_mem): steps 1-10,
                 saves 4 and 8, then the job "dies"
    3 ranks  B.m nvdcp manager in mode m on A.m's folder: ``load(step=-1)`` finds step-8; steps
                 9-12; the last save is a model-only nvdcp export

Skipped (with the reason) where ``nvdcp.integrations.torchtitan`` cannot import torchtitan.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.stateful import Stateful

from tests._dist import run_ranks
from tests.training.fsdp_worker import full_state, mismatches, stop_checkpoint_process

try:
    from nvdcp.integrations import torchtitan as nvdcp_titan
except ImportError as exc:  # torchtitan, or a package its import needs, is missing
    nvdcp_titan = None  # type: ignore[assignment]
    MISSING = str(exc)
else:
    MISSING = ""

needs_torchtitan = pytest.mark.skipif(nvdcp_titan is None, reason=f"torchtitan is not importable: {MISSING}")

MODES = ("disabled", "async", "async_with_pinned_mem")
VOCAB, DIM, HEADS, SEQ, GLOBAL_BATCH = 61, 24, 2, 8, 12  # 61 embedding rows: uneven on 2 and 3 ranks
STEPS, INTERVAL, DIES_AFTER = 12, 4, 10
#: Losses at another world size differ only by float summation order (as tests/training).
CROSS_WORLD_RTOL = 1e-5


# -- the model, data and trainer state ---------------------------------------------------------
class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(DIM)
        self.wqkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)
        self.ffn_norm = nn.RMSNorm(DIM)
        self.w1 = nn.Linear(DIM, 2 * DIM)
        self.w2 = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.wqkv(self.attention_norm(x)).view(b, t, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # the CPU's SDPA kernel
        x = x + self.wo(a.transpose(1, 2).reshape(b, t, DIM))
        return x + self.w2(F.silu(self.w1(self.ffn_norm(x))))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({"0": Block(), "1": Block()})
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))


class TokenLoader(Stateful):
    """Batch ``n`` of the run is fixed (the same global batch whatever the world size); the
    position is checkpointed, so a resumed run reads on where the saved one stopped."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world, self.position = rank, world, 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.position += 1
        tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(self.position))
        per = GLOBAL_BATCH // self.world
        mine = tokens[self.rank * per : (self.rank + 1) * per]
        return mine[:, :-1], mine[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.position = state_dict["position"]


class TrainState(Stateful):
    """What ``Trainer.state_dict`` checkpoints as ``train_state``."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = state_dict["step"]
        self.ntokens_seen = state_dict["ntokens_seen"]


class HFAdapter:
    """A state-dict adapter as torchtitan's models have (renamed keys, one safetensors file)."""

    fqn_to_index_mapping = None
    hf_assets_path = None

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return {f"model.{k}": v for k, v in state_dict.items()}

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        return {k.removeprefix("model."): v for k, v in hf_state_dict.items()}

    def get_hf_storage_reader(self, path: str, from_quantized: bool = False) -> Any:
        from torch.distributed.checkpoint import HuggingFaceStorageReader

        return HuggingFaceStorageReader(path)


@dataclass
class Job:
    """What ``Trainer.__init__`` builds around the checkpointer."""

    model: nn.Module
    optimizers: Any
    lr_schedulers: Any
    dataloader: TokenLoader
    state: TrainState
    checkpointer: Any
    config: Any
    losses: dict[int, float] = field(default_factory=dict)


def sharded_model(world: int, seed: int) -> TinyLM:
    """The model as torchtitan's FSDP2 path wraps it: each block, then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = TinyLM()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def build_job(config: Any, root: Path, rank: int, world: int, seed: int) -> Job:
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    model = sharded_model(world, seed)
    optimizers = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=r".*", optimizer_name="AdamW",
                                       optimizer_kwargs={"lr": 3e-3, "betas": (0.9, 0.95), "weight_decay": 0.1})],
        implementation="for-loop",
    ).build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=3, decay_type="cosine").build(
        optimizers=optimizers, training_steps=STEPS)
    dataloader, state = TokenLoader(rank, world), TrainState()
    checkpointer = config.build(
        dataloader=dataloader, model_parts=[model], optimizers=optimizers, lr_schedulers=lr_schedulers,
        states={"train_state": state}, sd_adapter=HFAdapter(), base_folder=str(root),
    )
    return Job(model, optimizers, lr_schedulers, dataloader, state, checkpointer, config)


def train(job: Job, world: int, until: int = STEPS, on_step: Any = None, after_load: Any = None) -> None:
    """``Trainer.train``: load, then step and save until ``until`` (a job killed there)."""
    job.checkpointer.load(step=job.config.load_step)
    if after_load is not None:
        after_load(job)
    while job.state.step < STEPS:
        job.state.step += 1
        inputs, labels = job.dataloader.next_batch()
        logits = job.model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss.backward()
        job.checkpointer.maybe_wait_for_staging()
        job.optimizers.step()
        job.lr_schedulers.step()
        job.optimizers.zero_grad()
        job.state.ntokens_seen += GLOBAL_BATCH * SEQ
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        job.losses[job.state.step] = float(mean) / world
        if on_step is not None:
            on_step(job)  # before save: what the save must hold, whatever training does next
        job.checkpointer.save(job.state.step, last_step=job.state.step == STEPS)
        if job.state.step == until:
            break


def finish(job: Job) -> None:
    """The end of a run: wait for its last upload, end torch's checkpoint process, close."""
    job.checkpointer.maybe_wait_for_saving()
    stop_checkpoint_process(None)
    job.checkpointer.close()


def saved_view(job: Job) -> dict[str, Any]:
    """Every entry the checkpointer saves (its flattened states, Stateful objects asked), gathered."""
    from torchtitan.components.checkpointer import MODEL

    states = job.checkpointer.states
    sd = {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in states.items() if k != MODEL}
    sd.update(states[MODEL].state_dict())
    return full_state(sd)


def model_view(model: nn.Module) -> dict[str, Any]:
    from torchtitan.components.checkpointer import ModelWrapper

    return full_state(ModelWrapper([model]).state_dict())


def snapshot_at(step: int, path: Path, rank: int) -> Any:
    def hook(job: Job) -> None:
        if job.state.step == step:
            view = saved_view(job)
            if rank == 0:
                torch.save(view, path)
    return hook


class compare_after_load:  # noqa: N801 (used as a callback)
    """After the checkpointer's load: the entries that differ from a saved view (``bad``)."""

    def __init__(self, want: Path) -> None:
        self.want = want
        self.bad: list[str] = ["never loaded"]

    def __call__(self, job: Job) -> None:
        self.bad = mismatches(saved_view(job), torch.load(self.want, weights_only=False))


def record(root: Path, name: str, rank: int, **data: Any) -> None:
    if rank == 0:
        (root / f"{name}.json").write_text(json.dumps(data))


def stock_config(**kw: Any) -> Any:
    from torchtitan.components.checkpointer import CheckpointManager

    return CheckpointManager.Config(**{"enable": True, "interval": INTERVAL, "keep_latest_k": 0, **kw})


def nvdcp_config(**kw: Any) -> Any:
    from nvdcp.integrations.torchtitan import NvdcpCheckpointManager

    return NvdcpCheckpointManager.Config(
        **{"enable": True, "interval": INTERVAL, "keep_latest_k": 0, "codec_threads": 1, **kw})


def fresh(path: Path) -> Path:
    """A phase's folder, emptied (a phase run again after a crashed attempt starts over)."""
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
    dist.barrier()
    return path


# -- the two spawns ----------------------------------------------------------------------------
def run_two(rank: int, world: int, d: str) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # torch's PROCESS-mode checkpoint process
    root = Path(d)

    # R: torchtitan's own manager, the uninterrupted run.
    r = fresh(root / "R")
    job = build_job(stock_config(), r, rank, world, seed=0)
    train(job, world, on_step=snapshot_at(8, root / "R_step8.pt", rank))
    finish(job)
    stock_ckpt = r / "checkpoint" / "step-8"
    record(root, "R", rank, losses=job.losses, metadata=[p.name for p in sorted(stock_ckpt.iterdir())])

    # S: the nvdcp manager starts from R's stock checkpoint; its last save is a HF export.
    s = fresh(root / "S")
    job = build_job(nvdcp_config(initial_load_path=str(stock_ckpt), initial_load_model_only=False,
                                 last_save_in_hf=True), s, rank, world, seed=1)
    loaded = compare_after_load(root / "R_step8.pt")
    train(job, world, after_load=loaded)
    finish(job)
    final = model_view(job.model)
    export = s / "checkpoint" / f"step-{STEPS}"
    hf_files = sorted(p.name for p in export.iterdir() if p.suffix in (".safetensors", ".json"))
    hf_bad: list[str] = []
    if rank == 0:
        from safetensors.torch import load_file

        flat: dict[str, torch.Tensor] = {}
        for name in hf_files:
            if name.endswith(".safetensors"):
                flat.update(load_file(export / name))
        hf_bad = mismatches({k.removeprefix("model."): v for k, v in flat.items()}, final)
    # ... and an nvdcp manager loads the HF export back (initial_load_in_hf, model only).
    back = build_job(nvdcp_config(initial_load_path=str(export), initial_load_in_hf=True, folder="none"),
                     s, rank, world, seed=2)
    assert back.checkpointer.load() is True
    hf_back = mismatches(model_view(back.model), final)
    back.checkpointer.close()
    record(root, "S", rank, loaded=loaded.bad, losses=job.losses, hf_files=hf_files, hf_bad=hf_bad, hf_back=hf_back)

    # A.m: the nvdcp manager in each mode; the job dies after step 10.
    for mode in MODES:
        a = fresh(root / f"A.{mode}")
        job = build_job(nvdcp_config(async_mode=mode), a, rank, world, seed=0)
        train(job, world, until=DIES_AFTER, on_step=snapshot_at(8, root / f"A.{mode}_step8.pt", rank))
        finish(job)
        stats = job.checkpointer.stager.last_stats if job.checkpointer.stager is not None else None
        record(root, f"A.{mode}", rank, losses=job.losses,
               steps=sorted(p.name for p in (a / "checkpoint").iterdir()),
               files=sorted(p.name for p in (a / "checkpoint" / "step-8").iterdir()),
               staged_shards=None if stats is None else stats.shards)


def run_three(rank: int, world: int, d: str) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    root = Path(d)
    import torch.distributed.checkpoint as dcp
    from torchtitan.components.checkpointer import ModelWrapper

    import nvdcp

    for mode in MODES:
        a = root / f"A.{mode}"
        job = build_job(nvdcp_config(async_mode=mode), a, rank, world, seed=3)
        loaded = compare_after_load(root / f"A.{mode}_step8.pt")
        train(job, world, after_load=loaded)  # load(step=-1) finds step-8
        resumed_at = min(job.losses)
        finish(job)
        # The last save: a model-only export, nvdcp-compressed, that loads with NvcompReader.
        target = ModelWrapper([sharded_model(world, seed=4)]).state_dict()
        dcp.load(target, storage_reader=nvdcp.NvcompReader(str(a / "checkpoint" / f"step-{STEPS}")))
        export_bad = mismatches(full_state(target), model_view(job.model))
        record(root, f"B.{mode}", rank, loaded=loaded.bad, losses=job.losses, resumed_at=resumed_at,
               export_bad=export_bad)


# -- the tests ---------------------------------------------------------------------------------
def _run(world: int, fn: Any, root: Path) -> None:
    from torch.multiprocessing.spawn import ProcessExitedException

    for attempt in range(3):
        try:
            run_ranks(world, fn, str(root))
            return
        except ProcessExitedException as exc:
            # As tests/training/test_fsdp_resume.py: a rank killed by a signal at a gloo phase's
            # exit reruns the spawn (each phase starts from an emptied folder).
            if exc.signal_name is None or attempt == 2:
                raise
            warnings.warn(f"{fn.__name__}: {exc}; running it again", stacklevel=1)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("torchtitan")
    _run(2, run_two, root)
    _run(3, run_three, root)
    out = {}
    for p in root.glob("*.json"):
        rec = json.loads(p.read_text())
        if "losses" in rec:
            rec["losses"] = {int(k): v for k, v in rec["losses"].items()}
        out[p.stem] = rec
    return out


def _close(got: dict[int, float], want: dict[int, float]) -> bool:
    return got.keys() == want.keys() and all(math.isclose(got[k], want[k], rel_tol=CROSS_WORLD_RTOL) for k in got)


@needs_torchtitan
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", MODES)
def test_save_on_two_resume_on_three(runs: dict[str, Any], mode: str) -> None:
    a, b, r = runs[f"A.{mode}"], runs[f"B.{mode}"], runs["R"]
    assert a["steps"] == ["step-4", "step-8"]  # the job died after step 10
    assert any(f.endswith(".nvdcp") for f in a["files"]) and ".metadata" in a["files"]
    assert not any(f.endswith(".distcp") for f in a["files"])
    # Saving (in the background, in the async modes) changed nothing in training.
    assert a["losses"] == {k: v for k, v in r["losses"].items() if k <= DIES_AFTER}
    if mode != "disabled":
        assert a["staged_shards"] > 0  # staged through the manager's NvcompStager
    assert b["loaded"] == []  # step 8 back on 3 ranks, bit-exact: model, optimizer, lr, data, step
    assert b["resumed_at"] == 9
    assert _close(b["losses"], {k: v for k, v in r["losses"].items() if k > 8})
    assert b["export_bad"] == []  # the last step's model-only export


@needs_torchtitan
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_loads_a_stock_checkpoint_and_keeps_the_hf_export(runs: dict[str, Any]) -> None:
    r, s = runs["R"], runs["S"]
    assert any(f.endswith(".distcp") for f in r["metadata"])  # R's checkpoint is stock DCP
    assert s["loaded"] == []
    # Same world size, same state: training continues exactly as the uninterrupted run.
    assert s["losses"] == {k: v for k, v in r["losses"].items() if k > 8}
    assert any(f.endswith(".safetensors") for f in s["hf_files"])
    assert s["hf_bad"] == [] and s["hf_back"] == []


@needs_torchtitan
def test_switching_by_override_or_config_with_torchtitans_config_manager(tmp_path: Path) -> None:
    from torchtitan.config import ConfigManager
    from torchtitan.config.override import apply_overrides

    from nvdcp.integrations.torchtitan import NvdcpCheckpointManager

    base = ["--module", __name__, "--config"]
    # One flag on a stock config: the override swaps the checkpoint config, keeping its fields.
    cfg = ConfigManager().parse_args([*base, "stock_job_config", "--checkpoint.async_mode", "async",
                                      "--override.imports", f"{nvdcp_titan.__name__}.nvdcp_checkpoint"
                                      '={"codec": "zstd", "thread_count": 2}'])
    assert type(cfg.checkpoint) is CheckpointManager.Config
    apply_overrides(cfg.override, cfg)  # what Trainer.__init__ does before building anything
    ck = cfg.checkpoint
    assert isinstance(ck, NvdcpCheckpointManager.Config)
    assert (ck.enable, ck.interval, ck.async_mode, ck.codec, ck.thread_count) == (True, 7, "async", "zstd", 2)
    assert ck._owner is NvdcpCheckpointManager
    # The config class in a config function: the nvdcp fields are --checkpoint.* flags.
    cfg = ConfigManager().parse_args([*base, "nvdcp_job_config", "--checkpoint.codec", "gdeflate",
                                      "--checkpoint.async_mode", "async_with_pinned_mem",
                                      "--checkpoint.thread_count", "3"])
    ck = cfg.checkpoint
    assert isinstance(ck, NvdcpCheckpointManager.Config)
    assert (ck.codec, ck.thread_count, ck.async_mode, ck.interval) == ("gdeflate", 3, "async_with_pinned_mem", 7)
    with pytest.raises(SystemExit):  # tyro's usage error
        ConfigManager().parse_args([*base, "nvdcp_job_config", "--checkpoint.thread_count", "x"])
    with pytest.raises(ValueError, match="codec"):
        NvdcpCheckpointManager.Config(codec="lzma")


if nvdcp_titan is not None:
    from torchtitan.components.checkpointer import BaseCheckpointManager, CheckpointManager
    from torchtitan.config import Configurable
    from torchtitan.config.override import OverrideConfig

    class JobConfigs(Configurable):
        """The checkpoint section of ``Trainer.Config`` (whose import needs triton; its
        parsing is the same), with the fields ``ConfigManager`` itself reads."""

        @dataclass(kw_only=True, slots=True)
        class Config(Configurable.Config):
            hf_assets_path: str = "."
            dump_folder: str = "./outputs"
            checkpoint: BaseCheckpointManager.Config = field(default_factory=CheckpointManager.Config)
            override: OverrideConfig = field(default_factory=OverrideConfig)


def stock_job_config() -> Any:
    """A config function, as in a torchtitan ``config_registry``: the stock manager."""
    return JobConfigs.Config(checkpoint=stock_config(interval=7))


def nvdcp_job_config() -> Any:
    """A config function selecting the nvdcp manager."""
    return JobConfigs.Config(checkpoint=nvdcp_config(interval=7))


def test_nvdcp_imports_without_torchtitan_and_the_integration_says_how_to_install() -> None:
    code = (
        "import sys; sys.modules['torchtitan'] = None\n"
        "import nvdcp, nvdcp.integrations\n"
        "assert 'nvdcp.integrations.torchtitan' not in sys.modules\n"
        "try:\n"
        "    import nvdcp.integrations.torchtitan\n"
        "except ImportError as e:\n"
        "    print(e)\n"
        "else:\n"
        "    raise SystemExit('imported without torchtitan')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "pip install 'nvdcp[torchtitan]'" in out.stdout

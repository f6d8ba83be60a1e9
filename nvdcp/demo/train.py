"""FSDP2 training worker that checkpoints with nvdcp; launch with torchrun.

    torchrun --standalone --nproc-per-node 2 -m nvdcp.demo.train --ckpt-root ./ckpt --steps 20
    torchrun ... -m nvdcp.demo.train --ckpt-root s3://bucket/run1 --async-save

It resumes from the latest usable checkpoint under ``--ckpt-root`` (at any world size: DCP
reshards), trains to ``--steps``, saves every ``--save-every`` steps with ``NvcompWriter`` (with
``dcp.async_save`` when ``--async-save``) and keeps the last ``--keep-last``. NCCL on GPUs
("cpu:gloo,cuda:nccl"), gloo on CPUs; async saves run their collectives on a separate gloo group,
so they never interleave with training's. The global batch of a step is fixed and split across
ranks, so runs at different world sizes see the same data.

``--ckpt-root`` may be any URL nvdcp opens (``s3://bucket/prefix``...): credentials and endpoint
come from the standard ``AWS_*`` environment, backend options from ``--storage-option KEY=VALUE``.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import shutil
import tempfile
import time
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import nvdcp
from nvdcp.demo.model import GPT, GPTConfig, batch_for_step, lr_at, stdlib_bytes
from nvdcp.demo.teardown import release_dtensor_caches
from nvdcp.manage import broadcast_latest_checkpoint, checkpoint_path, prune_checkpoints
from nvdcp.report import Report


def parse_storage_options(pairs: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs; values are JSON when they parse as JSON (numbers, booleans), else strings."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"--storage-option wants KEY=VALUE, got {pair!r}")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt-root", default="./checkpoints/demo", help="directory or URL (s3://bucket/prefix)")
    p.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                   help="backend option for URLs, e.g. endpoint_url=http://127.0.0.1:9000 (repeatable)")
    p.add_argument("--steps", type=int, default=20, help="train until this global step")
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument("--global-batch", type=int, default=12, help="sequences per step, split across ranks")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--codec", default="auto")
    p.add_argument("--compare-stock", action="store_true",
                   help="also save each checkpoint with torch's FileSystemWriter (to a local temp dir) and print both")
    p.add_argument("--async-save", action="store_true", help="checkpoint with dcp.async_save (nvdcp's stager)")
    p.add_argument("--async-mode", choices=["thread", "process"], default="thread",
                   help="where async_save uploads: a thread, or a checkpoint process per rank")
    p.add_argument("--loss-log", default=None, help="append {step, loss} JSON lines here (rank 0)")
    p.add_argument("--digest-log", default=None, help="append {step, event, digest} JSON lines here (rank 0)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.storage_options = parse_storage_options(args.storage_option)
    return args


def setup() -> tuple[int, int, torch.device]:
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dist.init_process_group("cpu:gloo,cuda:nccl")
        return dist.get_rank(), dist.get_world_size(), torch.device("cuda", local)
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), torch.device("cpu")


def build(args: argparse.Namespace, world: int, device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(args.seed)
    cfg = GPTConfig(d_model=args.d_model, n_layers=args.layers, n_heads=args.heads, context=args.context)
    model = GPT(cfg).to(device)
    mesh = init_device_mesh(device.type, (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=6e-4, weight_decay=0.1, foreach=False)
    return model, optim


def state_digest(state: dict[str, Any]) -> str:
    """SHA-256 over every tensor's full (unsharded) bytes, in key order; a collective."""
    h = hashlib.sha256()

    def walk(prefix: str, obj: Any) -> None:
        if isinstance(obj, dict):
            for k in sorted(obj, key=str):
                walk(f"{prefix}.{k}", obj[k])
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(f"{prefix}.{i}", v)
        elif isinstance(obj, torch.Tensor):
            full = obj.full_tensor() if isinstance(obj, DTensor) else obj
            h.update(prefix.encode())
            h.update(full.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(f"{prefix}={obj!r}".encode())

    walk("", state)
    return h.hexdigest()


def log_json(path: str | None, record: dict[str, Any]) -> None:
    if path and dist.get_rank() == 0:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def stored_bytes(path: str, storage_options: dict[str, Any] | None = None) -> int:
    """Bytes of every object of the checkpoint at ``path`` (a directory or a URL)."""
    from nvdcp.storage import open_storage

    storage = open_storage(path, **(storage_options or {}))
    return sum(storage.size(n) for n in storage.list())


def _timed(fn: Any) -> float:
    # A full garbage collection of this process's heap (torch, the model) takes ~0.3 s on the
    # CPU machine, and the allocations of ten training steps leave one pending: it landed in
    # whichever save ran first after them (nvdcp's saves at steps 20 and 30 took 0.7 s against
    # 0.3 s, stock's never did). Collected here, outside every timing, for both writers alike.
    gc.collect()
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def _temp_dir_on_all_ranks() -> str:
    holder = [tempfile.mkdtemp(prefix="stock-") if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


class Checkpointer:
    """Saves (sync or async), compares with stock, prunes; one per training run."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.options = args.storage_options
        self.mode = AsyncCheckpointerType.PROCESS if args.async_mode == "process" else AsyncCheckpointerType.THREAD
        # Async saves plan and commit with collectives from a background thread: give them their
        # own group so they never interleave with training's collectives on the default group.
        self.group = dist.new_group(backend="gloo") if args.async_save else None
        self.pending: dict[str, Any] | None = None

    def writer(self, path: str) -> nvdcp.NvcompWriter:
        return nvdcp.NvcompWriter(path, codec=self.args.codec, storage_options=self.options or None)

    def save(self, model: torch.nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
        model_sd, optim_sd = get_state_dict(model, optim)
        state = {"model": model_sd, "optim": optim_sd, "trainer": {"step": step}}
        if self.args.async_save:
            self._save_async(state, step)
        else:
            self._save_sync(state, step)
        # The saved state is `state` as of now (an async save staged it already).
        log_json(self.args.digest_log, {"step": step, "event": "save", "digest": state_digest(state),
                                         "world": dist.get_world_size()})

    def finish(self) -> None:
        """Wait for the last async save (at the end of training)."""
        self._finish_pending()

    # -- sync ----------------------------------------------------------------------------------
    def _save_sync(self, state: dict[str, Any], step: int) -> None:
        path = checkpoint_path(self.args.ckpt_root, step)
        writer = self.writer(path)
        elapsed = _timed(lambda: dcp.save(state, storage_writer=writer))
        line = f"step {step:5d} nvdcp save: {elapsed:.2f}s"
        if dist.get_rank() == 0 and writer.last_report is not None:
            report = writer.last_report
            ours = stored_bytes(path, self.options)  # every object, .metadata included (as for stock)
            line = f"step {step:5d} nvdcp save: {ours / 1e6:8.2f} MB, ratio {report.ratio:.3f}, {elapsed:.2f}s"
        if self.args.compare_stock:
            line += self._compare_sync(state, path, elapsed)
        if dist.get_rank() == 0:
            print(line, flush=True)
            prune_checkpoints(self.args.ckpt_root, self.args.keep_last, self.options or None)
        dist.barrier()

    def _compare_sync(self, state: dict[str, Any], path: str, nvdcp_save_s: float) -> str:
        """Save the same state with torch's FileSystemWriter, load both back, log the four timings."""
        stock = _temp_dir_on_all_ranks()
        stock_save_s = _timed(lambda: dcp.save(state, storage_writer=dcp.FileSystemWriter(stock)))
        stock_load_s = _timed(lambda: dcp.load(state, storage_reader=dcp.FileSystemReader(stock)))
        nvdcp_load_s = _timed(lambda: dcp.load(state, storage_reader=nvdcp.NvcompReader(
            path, storage_options=self.options or None)))
        line = ""
        if dist.get_rank() == 0:
            stock_bytes = stored_bytes(stock)
            ours = stored_bytes(path, self.options)
            log_json(self.args.digest_log, {
                "event": "compare", "mode": "sync", "step": state["trainer"]["step"], "world": dist.get_world_size(),
                "nvdcp_bytes": ours, "stock_bytes": stock_bytes,
                "nvdcp_save_s": nvdcp_save_s, "stock_save_s": stock_save_s,
                "nvdcp_load_s": nvdcp_load_s, "stock_load_s": stock_load_s,
            })
            line = f" | stock FileSystemWriter: {stock_bytes / 1e6:8.2f} MB, {stock_save_s:.2f}s"
            shutil.rmtree(stock, ignore_errors=True)
        dist.barrier()
        return line

    # -- async ---------------------------------------------------------------------------------
    def _save_async(self, state: dict[str, Any], step: int) -> None:
        self._finish_pending()  # the next save waits for the previous upload, never piles up
        stock = self._stock_async(state) if self.args.compare_stock else None
        path = checkpoint_path(self.args.ckpt_root, step)
        done: list[float] = []
        t0 = time.perf_counter()
        fut = dcp.async_save(state, storage_writer=self.writer(path), process_group=self.group,
                             async_checkpointer_type=self.mode)
        assert isinstance(fut, Future)  # nvdcp's stager stages synchronously: no AsyncSaveResponse
        blocked = time.perf_counter() - t0
        fut.add_done_callback(lambda _: done.append(time.perf_counter()))
        self.pending = {"future": fut, "step": step, "path": path, "t0": t0, "blocked": blocked, "done": done,
                        "stock": stock}

    def _stock_async(self, state: dict[str, Any]) -> dict[str, float]:
        """torch's async_save + FileSystemWriter (DefaultStager), alone, into a local temp dir."""
        stock = _temp_dir_on_all_ranks()
        dist.barrier()
        t0 = time.perf_counter()
        fut = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(stock), process_group=self.group,
                             async_checkpointer_type=self.mode)
        blocked = time.perf_counter() - t0
        (fut if isinstance(fut, Future) else fut.upload_completion).result()
        durable = time.perf_counter() - t0
        nbytes = stored_bytes(stock) if dist.get_rank() == 0 else 0
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(stock, ignore_errors=True)
        return {"blocked": blocked, "durable": durable, "bytes": nbytes}

    def _finish_pending(self) -> None:
        p, self.pending = self.pending, None
        if p is None:
            return
        p["future"].result()
        durable = (p["done"][0] if p["done"] else time.perf_counter()) - p["t0"]
        dist.barrier()
        if dist.get_rank() != 0:
            return
        reader = nvdcp.NvcompReader(p["path"], storage_options=self.options or None)
        report = Report.from_metadata("save", reader.storage.url, reader.read_metadata())
        ours = stored_bytes(p["path"], self.options)  # every object, .metadata included (as for stock)
        line = (f"step {p['step']:5d} nvdcp async_save: {ours / 1e6:8.2f} MB, ratio "
                f"{report.ratio:.3f}, training blocked {p['blocked']:.3f}s, durable after {durable:.2f}s")
        stock = p["stock"]
        if stock is not None:
            line += (f" | stock async_save: {stock['bytes'] / 1e6:8.2f} MB, blocked {stock['blocked']:.3f}s, "
                     f"durable after {stock['durable']:.2f}s")
            log_json(self.args.digest_log, {
                "event": "compare", "mode": "async", "step": p["step"], "world": dist.get_world_size(),
                "nvdcp_bytes": ours, "stock_bytes": stock["bytes"],
                "nvdcp_blocked_s": p["blocked"], "stock_blocked_s": stock["blocked"],
                "nvdcp_save_s": durable, "stock_save_s": stock["durable"],
            })
        print(line, flush=True)
        prune_checkpoints(self.args.ckpt_root, self.args.keep_last, self.options or None)


def resume(args: argparse.Namespace, model: torch.nn.Module, optim: torch.optim.Optimizer) -> int:
    latest = broadcast_latest_checkpoint(args.ckpt_root, args.storage_options or None)
    if latest is None:
        return 0
    model_sd, optim_sd = get_state_dict(model, optim)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd, "trainer": {"step": -1}}
    t0 = time.perf_counter()
    dcp.load(state, storage_reader=nvdcp.NvcompReader(latest.path, storage_options=args.storage_options or None))
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    step = int(state["trainer"]["step"])
    digest = state_digest({"model": state["model"], "optim": state["optim"], "trainer": {"step": step}})
    log_json(args.digest_log, {"step": step, "event": "load", "digest": digest, "world": dist.get_world_size()})
    if dist.get_rank() == 0:
        print(f"resumed from {latest.path} (step {step}) on {dist.get_world_size()} ranks "
              f"in {time.perf_counter() - t0:.2f}s", flush=True)
    return step


def train(args: argparse.Namespace) -> None:
    rank, world, device = setup()
    try:
        if args.global_batch % world:
            raise ValueError(f"--global-batch {args.global_batch} must divide by the world size {world}")
        model, optim = build(args, world, device)
        checkpointer = Checkpointer(args)
        step = resume(args, model, optim)
        data = stdlib_bytes()
        per_rank = args.global_batch // world
        while step < args.steps:
            x, y = batch_for_step(data, step, 0, 1, args.global_batch, args.context, args.seed)
            x, y = x[rank * per_rank : (rank + 1) * per_rank].to(device), y[rank * per_rank : (rank + 1) * per_rank].to(device)
            for group in optim.param_groups:
                group["lr"] = lr_at(step)
            loss = model(x, y)
            loss.backward()
            optim.step()
            optim.zero_grad(set_to_none=True)
            step += 1
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            mean = float(mean) / world
            log_json(args.loss_log, {"step": step, "loss": mean, "world": world})
            if rank == 0 and (step % 5 == 0 or step == args.steps):
                print(f"step {step:5d} loss {mean:.4f}", flush=True)
            if step % args.save_every == 0 or step == args.steps:
                checkpointer.save(model, optim, step)
        checkpointer.finish()
        dist.barrier()
    finally:
        release_dtensor_caches()  # else the gloo group outlives destroy_process_group (teardown.py)
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    train(parse_args(argv))


if __name__ == "__main__":
    main()

"""FSDP2 training worker that checkpoints with nvdcp; launch with torchrun.

    torchrun --standalone --nproc-per-node 2 -m nvdcp.demo.train --ckpt-root ./ckpt --steps 20

It resumes from the latest complete checkpoint under ``--ckpt-root`` (at any world size: DCP
reshards), trains to ``--steps``, saves every ``--save-every`` steps with ``NvcompWriter`` and
keeps the last ``--keep-last``. NCCL on GPUs ("cpu:gloo,cuda:nccl"), gloo on CPUs. The global
batch of a step is fixed and split across ranks, so runs at different world sizes see the same data.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import nvdcp
import nvdcp.report
from nvdcp.demo.model import GPT, GPTConfig, batch_for_step, lr_at, stdlib_bytes
from nvdcp.manage import checkpoint_path, latest_checkpoint, prune_checkpoints


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt-root", default="./checkpoints/demo", help="directory or s3://bucket/prefix")
    p.add_argument("--steps", type=int, default=20, help="train until this global step")
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument("--global-batch", type=int, default=12, help="sequences per step, split across ranks")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--codec", default="auto")
    p.add_argument("--compare-stock", action="store_true", help="also save with torch's FileSystemWriter and print both")
    p.add_argument("--async-save", action="store_true", help="checkpoint with dcp.async_save")
    p.add_argument("--loss-log", default=None, help="append {step, loss} JSON lines here (rank 0)")
    p.add_argument("--digest-log", default=None, help="append {step, event, digest} JSON lines here (rank 0)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


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


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))


def save(args: argparse.Namespace, model: torch.nn.Module, optim: torch.optim.Optimizer, step: int,
         pending: Any) -> Any:
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd, "trainer": {"step": step}}
    path = checkpoint_path(args.ckpt_root, step)
    writer = nvdcp.NvcompWriter(path, codec=args.codec)
    if pending is not None:
        pending.result()  # the next save waits for the previous upload, never piles up
    t0 = time.perf_counter()
    if args.async_save:
        pending = dcp.async_save(state, storage_writer=writer)
        blocked = time.perf_counter() - t0
        line = f"step {step:5d} async save started, training blocked {blocked:.3f}s"
    else:
        dcp.save(state, storage_writer=writer)
        elapsed = time.perf_counter() - t0
        report = writer.last_report
        line = (f"step {step:5d} nvdcp save: {report.stored_bytes/1e6:8.2f} MB, ratio {report.ratio:.3f}, "
                f"{elapsed:.2f}s" if report else f"step {step} saved in {elapsed:.2f}s")
        if args.compare_stock and report is not None:
            line += compare_with_stock(args, state, path, elapsed, report)
    digest = state_digest(state)
    log_json(args.digest_log, {"step": step, "event": "save", "digest": digest, "world": dist.get_world_size()})
    if dist.get_rank() == 0:
        print(line, flush=True)
        if not args.async_save:
            prune_checkpoints(args.ckpt_root, args.keep_last)
    return pending


def _timed(fn: Any) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def compare_with_stock(args: argparse.Namespace, state: dict[str, Any], path: str, nvdcp_save_s: float,
                       report: nvdcp.report.Report) -> str:
    """Save the same state with torch's FileSystemWriter, load both back, log the four timings."""
    holder = [tempfile.mkdtemp(prefix="stock-") if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(holder, src=0)
    stock = holder[0]
    stock_save_s = _timed(lambda: dcp.save(state, storage_writer=dcp.FileSystemWriter(stock)))
    stock_load_s = _timed(lambda: dcp.load(state, storage_reader=dcp.FileSystemReader(stock)))
    nvdcp_load_s = _timed(lambda: dcp.load(state, storage_reader=nvdcp.NvcompReader(path)))
    line = ""
    if dist.get_rank() == 0:
        stock_bytes = dir_bytes(stock)
        ours = dir_bytes(path)
        log_json(args.digest_log, {
            "event": "compare", "step": state["trainer"]["step"], "world": dist.get_world_size(),
            "raw_bytes": report.raw_bytes, "nvdcp_bytes": ours, "stock_bytes": stock_bytes,
            "nvdcp_save_s": nvdcp_save_s, "stock_save_s": stock_save_s,
            "nvdcp_load_s": nvdcp_load_s, "stock_load_s": stock_load_s,
        })
        line = f" | stock FileSystemWriter: {stock_bytes/1e6:8.2f} MB, {stock_save_s:.2f}s"
        shutil.rmtree(stock, ignore_errors=True)
    dist.barrier()
    return line


def resume(args: argparse.Namespace, model: torch.nn.Module, optim: torch.optim.Optimizer) -> int:
    latest = latest_checkpoint(args.ckpt_root)
    if latest is None:
        return 0
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd, "trainer": {"step": -1}}
    t0 = time.perf_counter()
    dcp.load(state, storage_reader=nvdcp.NvcompReader(latest.path))
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
        step = resume(args, model, optim)
        data = stdlib_bytes()
        pending = None
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
            log_json(args.loss_log, {"step": step, "loss": mean})
            if rank == 0 and (step % 5 == 0 or step == args.steps):
                print(f"step {step:5d} loss {mean:.4f}", flush=True)
            if step % args.save_every == 0 or step == args.steps:
                pending = save(args, model, optim, step, pending)
        if pending is not None:
            pending.result()
            if rank == 0:
                prune_checkpoints(args.ckpt_root, args.keep_last)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    train(parse_args(argv))


if __name__ == "__main__":
    main()

"""Run a function on N real gloo processes on 127.0.0.1 (torch.multiprocessing spawn)."""

from __future__ import annotations

import os
import socket
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from nvdcp.demo.teardown import release_dtensor_caches

#: Names (Linux ``comm``) of the threads a gloo process group and its TCPStore run.
GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop", "pt_tcpstore_uv")
#: How long those threads get to exit after destroy_process_group before the rank fails.
GLOO_EXIT_GRACE_S = 5.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def live_gloo_threads() -> list[str]:
    """Names of this process's gloo/TCPStore threads (Linux; empty elsewhere)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return []
    names = []
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        if name.startswith(GLOO_THREADS):
            names.append(name)
    return sorted(names)


def _entry(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    warnings.filterwarnings("ignore")
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        fn(rank, world, *args)
        # No rank tears its groups down while a peer still talks on one (gloo aborts the
        # process when a connection closes under a pending operation).
        dist.barrier()
    finally:
        # Without this the groups outlive destroy_process_group (see release_dtensor_caches).
        release_dtensor_caches()
        dist.destroy_process_group()
    # gloo's loop thread exits shortly after the group ends, not within destroy_process_group: a
    # leaked group keeps it for good (a fresh-clone CI run under load saw it still exiting).
    deadline = time.monotonic() + GLOO_EXIT_GRACE_S
    while (left := live_gloo_threads()) and time.monotonic() < deadline:
        time.sleep(0.05)
    if left:
        raise RuntimeError(f"rank {rank}: gloo threads outlive destroy_process_group: {left}")


def run_ranks(world: int, fn: Callable[..., Any], *args: Any) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` processes; raises if any rank fails.

    ``fn`` must be a module-level function (it is pickled into the children).
    """
    mp.start_processes(_entry, args=(world, free_port(), fn, args), nprocs=world, join=True, start_method="spawn")

"""Fault injection for the reliability tests: a writer that SIGKILLs its own process at a named
phase or after N bytes, worker processes for 2-rank gloo saves, and outcome checks.

Nothing here mocks torch: the writer is a test-only subclass of ``NvcompWriter`` whose storage
is the real backend behind a thin wrapper that counts bytes and can stop (kill or pause) the
process at a point. Workers are real processes forked from a forkserver that has torch and
nvdcp imported once, so a 2-rank save costs about a second instead of two torch imports.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import nvdcp
from nvdcp.dcp.metadata_io import METADATA_NAME
from nvdcp.testing import bit_equal, empty_like_sd, failure_of, weights_like

#: Where a writer can be stopped. ``bytes`` points are given as a byte count instead.
PHASES = (
    "local_plan",      # every rank: plan made, nothing written
    "global_plan",     # coordinator: file prefixes chosen, in-progress marker written
    "write_start",     # a rank is about to create its data files
    "write_end",       # a rank's data files are complete, results not yet gathered
    "finish_start",    # coordinator: all data written, .metadata not yet built
    "metadata_tmp",    # coordinator: .metadata's temp file written, not renamed
    "after_commit",    # coordinator: .metadata committed, old files not yet deleted
    "during_cleanup",  # coordinator: the first file of the cleanup deleted
)
COMMITTED_PHASES = {"after_commit", "during_cleanup"}


def die() -> None:
    """SIGKILL this process: no handler, no flush, no atexit."""
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


class Stopper:
    """Stops the process (``action``) at phase ``at`` or once ``after_bytes`` bytes are written."""

    def __init__(self, at: str | None = None, after_bytes: int | None = None,
                 action: Callable[[], None] = die) -> None:
        if at is not None and at not in PHASES:
            raise ValueError(f"unknown phase {at!r}")
        self.at = at
        self.after_bytes = after_bytes
        self.action = action
        self.written = 0
        self._lock = threading.Lock()

    def phase(self, name: str) -> None:
        if name == self.at:
            self.action()

    def allow(self, n: int) -> int:
        """How many of the next ``n`` bytes may be written before the process stops."""
        with self._lock:
            if self.after_bytes is None:
                self.written += n
                return n
            room = max(0, self.after_bytes - self.written)
            self.written += min(n, room)
            return min(n, room)

    def exhausted(self) -> bool:
        return self.after_bytes is not None and self.written >= self.after_bytes


class _Stream:
    def __init__(self, inner: Any, stopper: Stopper) -> None:
        self.inner, self.stopper = inner, stopper
        self.fills_in = inner.fills_in  # room left and filled in later (a streamed record's header)

    def write(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        ok = self.stopper.allow(len(view))
        if ok:
            self.inner.write(view[:ok])
        if ok < len(view) or self.stopper.exhausted():
            self.stopper.action()

    def writelines(self, parts: Any) -> None:
        for part in parts:
            self.write(part)

    def write_gather(self, gather: Any) -> None:
        self.writelines(gather)

    def write_spans(self, head: Any, spans: Any, parallel: bool = True) -> None:
        self.write(head)  # byte by byte through the stop point, as WriteStream.write_spans does
        self.writelines(spans)

    def tell(self) -> int:
        return self.inner.tell()

    def skip(self, nbytes: int) -> int:
        return int(self.inner.skip(nbytes))

    def write_at(self, offset: int, data: Any) -> None:
        """Through the stop point as a write: a stop here leaves the header's room unfilled."""
        view = memoryview(data).cast("B")
        ok = self.stopper.allow(len(view))
        if ok:
            self.inner.write_at(offset, view[:ok])
        if ok < len(view) or self.stopper.exhausted():
            self.stopper.action()

    def commit(self) -> None:
        self.inner.commit()

    def abort(self) -> None:
        self.inner.abort()


class StoppingStorage:
    """The real storage, with byte counting and stop points on create/write_atomic/delete."""

    def __init__(self, inner: Any, stopper: Stopper) -> None:
        self.inner, self.stopper = inner, stopper

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def create(self, name: str) -> _Stream:
        stream = _Stream(self.inner.create(name), self.stopper)
        if self.stopper.exhausted():  # a count of 0: die with the file created, empty
            self.stopper.action()
        return stream

    def write_atomic(self, name: str, data: bytes) -> None:
        if name == METADATA_NAME and self.stopper.at == "metadata_tmp":
            # What LocalStorage.write_atomic leaves when killed between write and rename.
            tmp = self.inner.create(f"{name}.{uuid.uuid4().hex[:8]}.tmp")
            tmp.write(data)
            tmp.commit()
            self.stopper.phase("metadata_tmp")
        self.inner.write_atomic(name, data)
        if name == METADATA_NAME:
            self.stopper.phase("after_commit")

    def delete(self, names: Any) -> None:
        names = list(names)
        if names and self.stopper.at == "during_cleanup":
            self.inner.delete(names[:1])
            self.stopper.phase("during_cleanup")
        self.inner.delete(names)


class StoppingWriter(nvdcp.NvcompWriter):
    """``NvcompWriter`` that stops at ``stopper``'s point (test only)."""

    def __init__(self, path: str | os.PathLike[str], *, stopper: Stopper | None = None, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.stopper = stopper or Stopper()
        self.storage = StoppingStorage(self.storage, self.stopper)  # type: ignore[assignment]

    def reset(self, checkpoint_id: Any = None) -> None:
        super().reset(checkpoint_id)
        if not isinstance(self.storage, StoppingStorage):
            self.storage = StoppingStorage(self.storage, self.stopper)  # type: ignore[assignment]

    def prepare_local_plan(self, plan: Any) -> Any:
        plan = super().prepare_local_plan(plan)
        self.stopper.phase("local_plan")
        return plan

    def prepare_global_plan(self, plans: Any) -> Any:
        plans = super().prepare_global_plan(plans)
        self.stopper.phase("global_plan")
        return plans

    def write_data(self, plan: Any, planner: Any) -> Any:
        self.stopper.phase("write_start")
        fut = super().write_data(plan, planner)
        self.stopper.phase("write_end")
        return fut

    def finish(self, metadata: Any, results: Any) -> None:
        self.stopper.phase("finish_start")
        super().finish(metadata, results)


# -- state dicts ------------------------------------------------------------------------------

def rank_state(rank: int, seed: int) -> dict[str, Any]:
    """What rank ``rank`` saves: its own tensors, one replicated tensor, and a bytes item."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return {
        f"r{rank}.w": weights_like((128, 256), seed=seed * 10 + rank),
        f"r{rank}.ids": torch.randint(0, 50_000, (8192,), generator=g),
        f"r{rank}.b16": weights_like((100, 300), torch.bfloat16, seed=seed * 10 + rank + 5),
        "shared.emb": weights_like((64, 128), seed=seed),
        "meta": {"seed": seed, "note": "bytes item"},
    }


def full_state(seed: int, world: int = 2) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for r in range(world):
        out.update(rank_state(r, seed))
    return out


def same_state(got: dict[str, Any], want: dict[str, Any]) -> bool:
    for k, v in want.items():
        if isinstance(v, dict):
            if not same_state(got[k], v):
                return False
        elif isinstance(v, torch.Tensor):
            if not bit_equal(got[k], v):
                return False
        elif got[k] != v:
            return False
    return True


def outcome(path: str | os.PathLike[str], candidates: dict[str, dict[str, Any]]) -> str:
    """Load ``path`` and name which candidate state it holds: a key of ``candidates``,
    ``"incomplete"`` (no .metadata), ``"mixed"`` (loads but matches none), or ``"error: ..."``."""
    like = next(iter(candidates.values()))
    sd = empty_like_sd(like)
    try:  # dcp.load reports a missing .metadata as an AssertionError text: ask the reader first
        nvdcp.NvcompReader(path).read_metadata()
    except nvdcp.IncompleteCheckpointError:
        return "incomplete"
    except nvdcp.NvdcpError as exc:
        return f"error: {type(exc).__name__}: {exc}"
    try:
        dcp.load(sd, storage_reader=nvdcp.NvcompReader(path, thread_count=2, codec_threads=1))
    except (CheckpointException, nvdcp.NvdcpError) as exc:
        err = failure_of(exc)
        if isinstance(err, nvdcp.IncompleteCheckpointError):
            return "incomplete"
        return f"error: {type(err).__name__}: {err}"
    for name, state in candidates.items():
        if same_state(sd, state):
            return name
    return "mixed"


def tree_digest(path: str | os.PathLike[str]) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(Path(path).iterdir())}


def checkpoint_files(path: str | os.PathLike[str]) -> tuple[set[str], set[str]]:
    """(names ``.metadata`` references, names present) of a committed checkpoint."""
    md = nvdcp.NvcompReader(path).read_metadata()
    referenced = {info.relative_path for info in md.storage_data.values()} | {METADATA_NAME}
    return referenced, {p.name for p in Path(path).iterdir()}


# -- processes ---------------------------------------------------------------------------------

_CTX: Any = None


def context() -> Any:
    """A forkserver context whose server has torch, DCP and nvdcp imported (forks are cheap)."""
    global _CTX
    if _CTX is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed.checkpoint", "nvdcp", __name__])
        _CTX = ctx
    return _CTX


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def save_worker(rank: int, world: int, port: int, path: str, seed: int, stop: dict[str, Any] | None,
                writer_kwargs: dict[str, Any]) -> None:
    """One rank of a gloo save of :func:`rank_state`; ``stop`` = {"rank", "at" | "after_bytes"}."""
    import torch.distributed as dist

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=30))
    try:
        stopper = None
        if stop and stop["rank"] == rank:
            stopper = Stopper(at=stop.get("at"), after_bytes=stop.get("after_bytes"))
        kwargs = {"thread_count": 2, "sync_files": False, "codec_threads": 1, "codec": "zstd", **writer_kwargs}
        writer = StoppingWriter(path, stopper=stopper, **kwargs)
        dcp.save(rank_state(rank, seed), storage_writer=writer)
    except BaseException:
        if not os.environ.get("NVDCP_FAULTS_QUIET"):  # the sweep expects thousands of these
            traceback.print_exc()
        sys.exit(1)
    finally:
        dist.destroy_process_group()


def run_group(path: str | os.PathLike[str], seed: int, stop: dict[str, Any] | None = None, *,
              world: int = 2, timeout: float = 60.0, **writer_kwargs: Any) -> list[int | None]:
    """Save :func:`rank_state` of ``seed`` on ``world`` processes; returns their exit codes
    (-9: killed; a survivor that is still running after ``timeout`` is killed and reads None)."""
    ctx = context()
    port = _free_port()
    procs = [
        ctx.Process(target=save_worker, args=(r, world, port, os.fspath(path), seed, stop, writer_kwargs))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    return join_within(procs, timeout)


def join_within(procs: list[Any], timeout: float) -> list[int | None]:
    """Wait up to ``timeout`` seconds in all for started ``procs``; returns their exit codes,
    None for one still running then (it is killed)."""
    deadline = time.monotonic() + timeout
    codes: list[int | None] = []
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
            codes.append(None)
        else:
            codes.append(p.exitcode)
    return codes


def call_in_process(fn: Callable[..., Any], *args: Any, timeout: float = 60.0) -> Any:
    """Run ``fn(*args)`` in a forked worker and return its result (exceptions come back as
    ``("raised", type name, message, errno, filename)``; a signal death as ``("signal", n)``)."""
    ctx = context()
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_call_entry, args=(child, fn, args))
    proc.start()
    child.close()
    result: Any = None
    if parent.poll(timeout):
        try:
            result = parent.recv()
        except EOFError:
            result = None
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join()
        return ("timeout",)
    if result is None:
        return ("signal", -(proc.exitcode or 0))
    return result


def _call_entry(conn: Any, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    try:
        out: Any = ("ok", fn(*args))
    except BaseException as exc:
        err = failure_of(exc)
        out = ("raised", type(err).__name__, str(err), getattr(err, "errno", None), getattr(err, "filename", None))
    conn.send(out)
    conn.close()

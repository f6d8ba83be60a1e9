"""Shared benchmark plumbing: machine description, timing, result files."""

from __future__ import annotations

import datetime
import gc
import json
import os
import platform
import shutil
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "hostname": socket.gethostname(), "cores": os.cpu_count(), "arch": platform.machine(),
        "python": platform.python_version(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name()
    except ImportError:
        pass
    return info


def dir_bytes(path: str | os.PathLike[str]) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def fresh_dir(path: str | os.PathLike[str]) -> str:
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path, exist_ok=True)
    return os.fspath(path)


def timed(fn: Callable[[], Any], sync: Callable[[], None] | None = None) -> float:
    """Seconds ``fn`` takes, after a full garbage collection outside the timing: one left
    pending by earlier work otherwise lands in whichever timed call comes first (about 0.3 s
    for a process holding torch and a model, on the CPU machine; see nvdcp/demo/train.py)."""
    gc.collect()
    if sync:
        sync()
    t0 = time.perf_counter()
    fn()
    if sync:
        sync()
    return time.perf_counter() - t0


def drop_page_cache() -> bool:
    """Best effort: flush dirty pages and drop the page cache (root only)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def command_line() -> str:
    """How this process was started: ``python3 -m benchmarks.X ARGS`` for a module run with -m."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    argv = ["-m", spec.name, *sys.argv[1:]] if spec is not None else sys.argv
    return " ".join([Path(sys.executable).name, *argv])


def pinned_peak(*owners: Any) -> int:
    """Peak pinned bytes of the pools behind these nvdcp writers, stagers (their encoder's pool)
    and readers (the shared pool of their ``pinned_memory_bytes``), each pool counted once; other
    objects count 0. Pools outlive a save: call :func:`nvdcp.release_resources` first for a
    fresh peak."""
    import nvdcp
    from nvdcp.gpu.pinned import shared_pool

    pools = {}
    for owner in owners:
        if isinstance(owner, nvdcp.NvcompReader):
            pinned = shared_pool(owner.gpu.pinned_bytes(load=True))
        else:
            pinned = getattr(getattr(owner, "encoder", None), "pinned", None)
        if pinned is not None:
            pools[id(pinned)] = pinned
    return sum(p.peak for p in pools.values())


def write_results(name: str, payload: dict[str, Any], out_dir: str | os.PathLike[str] | None = None,
                  suffix: str = "") -> Path:
    """Write ``<out_dir>/<name>_<date><suffix>.json`` with the date, machine and command line."""
    day = datetime.date.today().isoformat()
    payload = {"date": day, "machine": machine(), "command": command_line(), **payload}
    target = Path(out_dir or RESULTS) / f"{name}_{day}{suffix}.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    return target


def markdown_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(c)) for c in columns) + " |")
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3f}"
    if isinstance(v, int) and v > 10_000:
        return f"{v:,}"
    return "" if v is None else str(v)

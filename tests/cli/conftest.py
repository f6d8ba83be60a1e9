"""Fixtures for the command-line tests: real checkpoints and two ways to run ``nvdcp``.

``cli(...)`` runs ``python -m nvdcp`` in a subprocess, as a user would. ``invoke(...)`` runs the
same entry point in this process through click's CliRunner (argv in, exit status and both
streams out): each subprocess pays ~2 s of torch import on these 2-core machines, so the many
error-path checks use it and every command still runs at least once in a real process.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner
from torch.distributed.checkpoint import FileSystemWriter

import nvdcp
from tests._dist import run_ranks
from tests.cli.states import blank_like, make_state

REPO = Path(__file__).resolve().parents[2]


def load_nvdcp(path: str | os.PathLike[str]) -> dict[str, Any]:
    sd = blank_like(make_state())
    dcp.load(sd, storage_reader=nvdcp.NvcompReader(path))
    return sd


# -- running the command -----------------------------------------------------------------------
@dataclass
class Ran:
    exit_code: int
    stdout: str
    stderr: str

    def json(self) -> Any:
        import json

        return json.loads(self.stdout)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("COLUMNS", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def cli(*args: str | os.PathLike[str], timeout: float = 120) -> Ran:
    """``python -m nvdcp ARGS`` in a subprocess."""
    proc = subprocess.run(
        [sys.executable, "-m", "nvdcp", *map(os.fspath, args)], check=False, capture_output=True, text=True,
        timeout=timeout, env=_env(), cwd=REPO,
    )
    return Ran(proc.returncode, proc.stdout, proc.stderr)


def invoke(*args: str | os.PathLike[str]) -> Ran:
    """The same command line, run in this process (see the module docstring)."""
    from nvdcp.cli.app import cli as group

    result = CliRunner().invoke(group, [os.fspath(a) for a in args], prog_name="nvdcp", catch_exceptions=False)
    return Ran(result.exit_code, result.stdout, result.stderr)


# -- checkpoints -------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``make_state()`` saved by NvcompWriter (auto codec, 2 data files) and by stock FileSystemWriter.

    Session-wide and read-only: tests that damage or overwrite copy them first.
    """
    root = tmp_path_factory.mktemp("ckpts")
    paths = {"nvdcp": root / "nvdcp", "stock": root / "stock"}
    dcp.save(make_state(), storage_writer=nvdcp.NvcompWriter(paths["nvdcp"], thread_count=2))
    dcp.save(make_state(), storage_writer=FileSystemWriter(paths["stock"]))
    return paths


def _full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(99)
    return {
        "rows": torch.randn(64, 48, generator=g) * 0.02,
        "cols": (torch.randn(10, 40, generator=g) * 0.02).bfloat16(),
        "ids": torch.arange(1000, dtype=torch.int64),
    }


def _save_sharded(rank: int, world: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = _full()
    sd = {
        "rows": distribute_tensor(full["rows"], mesh, [Shard(0)]),
        "cols": distribute_tensor(full["cols"], mesh, [Shard(1)]),
        "ids": distribute_tensor(full["ids"], mesh, [Shard(0)]),
    }
    dcp.save(sd, storage_writer=FileSystemWriter(os.path.join(root, "stock")))
    dcp.save(sd, storage_writer=nvdcp.NvcompWriter(os.path.join(root, "nvdcp")))


@pytest.fixture(scope="session")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A DTensor state saved by 2 real gloo ranks (each tensor in 2 stored chunks), stock and nvdcp."""
    root = tmp_path_factory.mktemp("sharded")
    run_ranks(2, _save_sharded, str(root))
    return {"stock": root / "stock", "nvdcp": root / "nvdcp", "full": _full()}


def load_full(path: str | os.PathLike[str], reader: Any) -> dict[str, torch.Tensor]:
    """Load a sharded checkpoint into plain full-size tensors in this one process."""
    sd = {k: torch.zeros_like(v) for k, v in _full().items()}
    dcp.load(sd, storage_reader=reader(path))
    return sd


# -- damage ------------------------------------------------------------------------------------
def records(path: str | os.PathLike[str]) -> dict[str, Any]:
    """``fqn -> _StorageInfo`` of a checkpoint (first chunk of each item)."""
    with open(os.path.join(path, ".metadata"), "rb") as f:
        md = pickle.load(f)
    out: dict[str, Any] = {}
    for index, info in md.storage_data.items():
        out.setdefault(index.fqn, info)
    return out


def flip_byte(path: str | os.PathLike[str], fqn: str, where: int) -> str:
    """Flip one byte of item ``fqn`` at ``where`` bytes into its record (negative: from its end);
    returns the data file's name."""
    info = records(path)[fqn]
    pos = info.offset + (where if where >= 0 else info.length + where)
    file = os.path.join(path, info.relative_path)
    with open(file, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0xFF]))
    return str(info.relative_path)


# S3: the session's moto server on loopback and a fresh bucket per test (tests/s3/s3_testkit.py).
from tests.s3.s3_testkit import moto_s3, s3env  # noqa: E402, F401

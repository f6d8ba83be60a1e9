"""Real disk errors from the kernel: a full file system (ENOSPC, a 2 MiB tmpfs), a file size limit
(EFBIG, RLIMIT_FSIZE) and a read-only file system (EROFS). Each surfaces as a StorageError naming
the path, no ``.metadata`` is written, and a checkpoint already there stays loadable."""

from __future__ import annotations

import errno
import os
import resource
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import nvdcp
from nvdcp.testing import failure_of, random_tensor
from nvdcp.testing import faults as F

pytestmark = pytest.mark.timeout(120)

KW: dict[str, Any] = {"sync_files": True, "codec_threads": 1, "thread_count": 2}


def _mount(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["mount", *args], capture_output=True, text=True, timeout=30, check=False)


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs of our own (needs root or CAP_SYS_ADMIN; skipped otherwise)."""
    where = tmp_path / "disk"
    where.mkdir()
    try:
        done = _mount("-t", "tmpfs", "-o", "size=2m", "tmpfs", str(where))
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot run mount: {exc}")
    if done.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here ({done.stderr.strip()}): needs root")
    try:
        yield where
    finally:
        if subprocess.run(["umount", str(where)], capture_output=True, check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], capture_output=True, check=False)


def _big() -> dict[str, torch.Tensor]:
    return {"noise": random_tensor(torch.uint8, (3 << 20,), seed=5)}  # 3 MiB, incompressible


def _small(seed: int = 1) -> dict[str, torch.Tensor]:
    return {"noise": random_tensor(torch.uint8, (64 << 10,), seed=seed)}


def _save_error(path: Path, sd: dict[str, Any], **kw: Any) -> BaseException:
    with pytest.raises((CheckpointException, nvdcp.NvdcpError)) as info:
        dcp.save(sd, storage_writer=F.StoppingWriter(path, **{**KW, **kw}))
    return failure_of(info.value)


def _assert_names_a_file_in(err: BaseException, root: Path, code: int) -> None:
    assert isinstance(err, nvdcp.StorageError), repr(err)
    assert err.errno == code, (err.errno, err)
    assert err.filename and str(err.filename).startswith(str(root)), err.filename
    assert str(err.filename) in str(err)


def test_disk_full_while_writing_data(tmpfs: Path) -> None:
    target = tmpfs / "ckpt"
    err = _save_error(target, _big())
    _assert_names_a_file_in(err, target, errno.ENOSPC)
    assert "disk full" in str(err)
    assert not (target / ".metadata").exists()


def test_disk_full_keeps_the_previous_checkpoint(tmpfs: Path) -> None:
    target = tmpfs / "ckpt"
    dcp.save(_small(), storage_writer=nvdcp.NvcompWriter(target, **KW))
    before = F.tree_digest(target)
    err = _save_error(target, _big())
    _assert_names_a_file_in(err, target, errno.ENOSPC)
    assert {n: d for n, d in F.tree_digest(target).items() if n in before} == before
    assert F.outcome(target, {"old": _small()}) == "old"


def _fill(where: Path) -> None:
    fd = os.open(where / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)


def test_disk_full_while_committing_metadata(tmpfs: Path) -> None:
    """Data fits; the disk fills before .metadata is written: nothing is committed."""
    target = tmpfs / "ckpt"
    dcp.save(_small(1), storage_writer=nvdcp.NvcompWriter(target, **KW))
    err = _save_error(target, _small(2), stopper=F.Stopper(at="finish_start", action=lambda: _fill(tmpfs)))
    _assert_names_a_file_in(err, target, errno.ENOSPC)
    assert ".metadata" in os.path.basename(str(getattr(err, "filename", "")))
    (tmpfs / "filler").unlink()
    assert F.outcome(target, {"old": _small(1), "new": _small(2)}) == "old"
    assert not [n for n in os.listdir(target) if n.startswith(".metadata.") and "pending" not in n]


def test_read_only_file_system(tmpfs: Path) -> None:
    target = tmpfs / "ckpt"
    dcp.save(_small(), storage_writer=nvdcp.NvcompWriter(target, **KW))
    assert _mount("-o", "remount,ro", str(tmpfs)).returncode == 0
    try:
        err = _save_error(target, _small(2))
        _assert_names_a_file_in(err, target, errno.EROFS)
        assert F.outcome(target, {"old": _small()}) == "old"  # loads from the read-only disk
    finally:
        _mount("-o", "remount,rw", str(tmpfs))


def _save_under_fsize_limit(path: str, limit: int) -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills us instead of EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    dcp.save({"noise": random_tensor(torch.uint8, (1 << 20,), seed=9)},
             storage_writer=nvdcp.NvcompWriter(path, **KW))


def test_file_size_limit(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    result = F.call_in_process(_save_under_fsize_limit, str(target), 256 << 10)
    assert result[0] == "raised", result
    _, name, msg, code, filename = result
    assert name == "StorageError" and code == errno.EFBIG, result
    assert filename and filename.startswith(str(target)) and filename in msg
    assert not (target / ".metadata").exists()

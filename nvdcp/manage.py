"""Checkpoint management: find the latest usable checkpoint, keep the last K, delete safely.

A training run writes one checkpoint per save under a *root* (a directory, or an object-store
prefix such as ``s3://bucket/run1``), each in a child named ``step_{N:08d}``
(:func:`checkpoint_path`). The rules:

- A checkpoint is *complete* once its ``.metadata`` exists: writers put it there last, atomically.
- It is *usable* when, in addition, ``.metadata`` loads and every data file it names is present
  and long enough (:func:`checkpoint_problem`). :func:`latest_checkpoint` returns the newest
  usable one and logs why it skipped newer ones.
- Deleting removes ``.metadata`` first, so a half-deleted checkpoint never looks complete; then
  only files a DCP writer makes (nvdcp and stock data files, ``.metadata`` temp files); a
  directory is removed only once empty, so nothing else under it is ever lost.
- :func:`prune_checkpoints` keeps the newest ``keep_last`` usable checkpoints and deletes what is
  older than the newest of them. Checkpoints newer than that are never touched: an incomplete
  one may be a save in progress. With no usable checkpoint it deletes nothing.

Run pruning from one process (rank 0) after the save it follows has completed. Object stores are
listed through :meth:`nvdcp.storage.Storage.list_children`.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from typing import Any

from nvdcp.dcp.metadata_io import METADATA_NAME

logger = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step_(\d+)$")
#: What DCP writers put in a checkpoint: nvdcp data files, stock FileSystemWriter data files,
#: ``.metadata`` and its temp files. Deleting touches nothing else.
_CHECKPOINT_FILE = re.compile(
    r"^(__\d+_[0-9a-f]+_\d+\.nvdcp|__\d+_\d+\.distcp|\.metadata|\.metadata\.[0-9a-zA-Z]+\.tmp|\.metadata\.tmp)$"
)

Options = dict[str, Any] | None


@dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint under a root: its step, where it is, whether ``.metadata`` is there."""

    step: int
    path: str
    complete: bool


def checkpoint_path(root: str | os.PathLike[str], step: int) -> str:
    """Where the checkpoint of ``step`` lives under ``root``."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"{os.fspath(root).rstrip('/')}/step_{step:08d}"


def _spec(root: str | os.PathLike[str]) -> str:
    return os.fspath(root).removeprefix("file://")


def _is_url(spec: str) -> bool:
    return "://" in spec


def _open(path: str, options: Options) -> Any:
    from nvdcp.storage import open_storage

    return open_storage(path, **(options or {}))


def _children(spec: str, options: Options) -> list[str]:
    if not _is_url(spec):
        if not os.path.isdir(spec):
            return []
        return [n for n in os.listdir(spec) if os.path.isdir(os.path.join(spec, n))]
    storage = _open(spec, options)
    if not hasattr(storage, "list_children"):
        raise NotImplementedError(f"{type(storage).__name__} cannot list the checkpoints under {spec}")
    return list(storage.list_children())


def list_checkpoints(root: str | os.PathLike[str], storage_options: Options = None) -> list[CheckpointInfo]:
    """Every ``step_N`` checkpoint under ``root``, oldest first, complete or not."""
    spec = _spec(root)
    infos = []
    for name in _children(spec, storage_options):
        m = _STEP_DIR.match(name)
        if not m:
            continue
        path = f"{spec.rstrip('/')}/{name}"
        if _is_url(spec):
            complete = _open(path, storage_options).exists(METADATA_NAME)
        else:
            complete = os.path.isfile(os.path.join(path, METADATA_NAME))
        infos.append(CheckpointInfo(int(m.group(1)), path, complete))
    return sorted(infos, key=lambda c: (c.step, c.path))


def checkpoint_problem(path: str, storage_options: Options = None) -> str | None:
    """Why the checkpoint at ``path`` cannot be loaded, or None if it looks usable.

    Checks that ``.metadata`` loads and that every data file it names exists and holds at least
    the bytes its records point at. It does not read or checksum the data (that is
    :func:`nvdcp.verify_checkpoint`). ``.metadata`` goes through nvdcp's restricted unpickler,
    which refuses the ``PosixPath`` that stock ``FileSystemWriter`` checkpoints pickle: manage
    those with ``verify=False``.
    """
    from nvdcp.dcp.metadata_io import load_metadata
    from nvdcp.errors import NvdcpError

    try:
        storage = _open(path, storage_options)
        metadata = load_metadata(storage)
        needed: dict[str, int] = {}
        for info in (metadata.storage_data or {}).values():
            name = getattr(info, "relative_path", None)
            if name is None:
                return f"{path}: .metadata has a storage record without a file name"
            end = int(getattr(info, "offset", 0)) + int(getattr(info, "length", 0))
            needed[name] = max(needed.get(name, 0), end)
        present = set(storage.list())
        for name, end in sorted(needed.items()):
            if name not in present:
                return f"{storage.describe(name)} is missing"
            size = storage.size(name)
            if size < end:
                return f"{storage.describe(name)} holds {size} bytes, .metadata needs {end}"
    except (NvdcpError, OSError) as exc:
        return f"{path}: {exc}"
    return None


def latest_checkpoint(root: str | os.PathLike[str], storage_options: Options = None, *,
                      verify: bool = True) -> CheckpointInfo | None:
    """The newest complete checkpoint under ``root``, or None.

    Incomplete ones (no ``.metadata``) are skipped; with ``verify`` (the default) so are complete
    ones that fail :func:`checkpoint_problem`, each logged at WARNING.
    """
    for info in reversed(list_checkpoints(root, storage_options)):
        if not info.complete:
            logger.info("skipping incomplete checkpoint %s (no %s)", info.path, METADATA_NAME)
            continue
        problem = checkpoint_problem(info.path, storage_options) if verify else None
        if problem is None:
            return info
        logger.warning("skipping unusable checkpoint %s: %s", info.path, problem)
    return None


def broadcast_latest_checkpoint(root: str | os.PathLike[str], storage_options: Options = None, *,
                                verify: bool = True, group: Any = None) -> CheckpointInfo | None:
    """:func:`latest_checkpoint` decided on rank 0 of ``group`` and sent to every rank, so all
    ranks resume from the same checkpoint even if one appears while they look (a collective)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return latest_checkpoint(root, storage_options, verify=verify)
    holder: list[CheckpointInfo | None] = [None]
    if dist.get_rank(group) == 0:
        holder[0] = latest_checkpoint(root, storage_options, verify=verify)
    dist.broadcast_object_list(holder, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return holder[0]


def delete_checkpoint(path: str, storage_options: Options = None) -> list[str]:
    """Delete one checkpoint: ``.metadata`` first, then the files DCP writers make.

    Returns the names left behind because nvdcp did not recognise them (the directory of a local
    checkpoint is removed only when nothing is left).
    """
    spec = _spec(path)
    storage = _open(spec, storage_options)
    storage.delete([METADATA_NAME])
    names = storage.list()
    ours = [n for n in names if _CHECKPOINT_FILE.match(n)]
    others = sorted(set(names) - set(ours))
    storage.delete(ours)
    if not _is_url(spec) and os.path.isdir(spec):
        others = sorted(os.listdir(spec))  # subdirectories too
        if not others:
            os.rmdir(spec)
    if others:
        logger.warning("left %d unrecognised entries in %s: %s", len(others), spec, ", ".join(others[:5]))
    return others


def prune_checkpoints(root: str | os.PathLike[str], keep_last: int, storage_options: Options = None, *,
                      verify: bool = True, dry_run: bool = False) -> list[CheckpointInfo]:
    """Keep the newest ``keep_last`` usable checkpoints under ``root``; delete older ones.

    Also deleted: incomplete or unusable checkpoints older than the newest kept one (leftovers of
    failed saves). Never deleted: anything newer than the newest usable checkpoint (it may be a
    save in progress), and anything at all when no checkpoint is usable. ``verify`` as in
    :func:`latest_checkpoint`. Returns what was (or, with ``dry_run``, would be) deleted, oldest
    first.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    infos = list_checkpoints(root, storage_options)
    kept: list[CheckpointInfo] = []
    for info in reversed(infos):
        if len(kept) == keep_last:
            break
        if info.complete and (not verify or checkpoint_problem(info.path, storage_options) is None):
            kept.append(info)
    if not kept:
        if infos:
            logger.warning("no usable checkpoint under %s: deleting nothing", _spec(root))
        return []
    newest = (kept[0].step, kept[0].path)
    doomed = [c for c in infos if c not in kept and (c.step, c.path) < newest]
    for c in doomed:
        if dry_run:
            continue
        logger.info("deleting checkpoint %s", c.path)
        delete_checkpoint(c.path, storage_options)
    return doomed


__all__ = [
    "CheckpointInfo", "broadcast_latest_checkpoint", "checkpoint_path", "checkpoint_problem",
    "delete_checkpoint", "latest_checkpoint", "list_checkpoints", "prune_checkpoints",
]

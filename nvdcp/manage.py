"""Checkpoint management: find the latest complete checkpoint, keep the last K, delete safely.

A training run writes one checkpoint per save under a root, named ``step_{N:08d}``. A checkpoint
is complete once its ``.metadata`` exists (written last). Deleting removes ``.metadata`` first,
so a half-deleted checkpoint is never mistaken for a complete one.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from dataclasses import dataclass

from nvdcp.dcp.metadata_io import METADATA_NAME

logger = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step_(\d+)$")


@dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint under a root."""

    step: int
    path: str
    complete: bool


def checkpoint_path(root: str | os.PathLike[str], step: int) -> str:
    """Where the checkpoint of ``step`` lives under ``root``."""
    return f"{os.fspath(root).rstrip('/')}/step_{step:08d}"


def _is_url(root: str) -> bool:
    return "://" in root and not root.startswith("file://")


def list_checkpoints(root: str | os.PathLike[str], storage_options: dict[str, object] | None = None) -> list[CheckpointInfo]:
    """Every ``step_N`` checkpoint under ``root``, oldest first, complete or not."""
    spec = os.fspath(root).removeprefix("file://")
    if _is_url(spec):
        from nvdcp.storage import open_storage

        storage = open_storage(spec, **(storage_options or {}))
        children = storage.list_children()  # type: ignore[attr-defined]
        infos = []
        for name in children:
            m = _STEP_DIR.match(name)
            if m:
                sub = open_storage(checkpoint_path(spec, int(m.group(1))), **(storage_options or {}))
                infos.append(CheckpointInfo(int(m.group(1)), checkpoint_path(spec, int(m.group(1))), sub.exists(METADATA_NAME)))
        return sorted(infos, key=lambda c: c.step)
    if not os.path.isdir(spec):
        return []
    infos = []
    for name in os.listdir(spec):
        m = _STEP_DIR.match(name)
        full = os.path.join(spec, name)
        if m and os.path.isdir(full):
            infos.append(CheckpointInfo(int(m.group(1)), full, os.path.exists(os.path.join(full, METADATA_NAME))))
    return sorted(infos, key=lambda c: c.step)


def latest_checkpoint(root: str | os.PathLike[str], storage_options: dict[str, object] | None = None) -> CheckpointInfo | None:
    """The newest complete checkpoint under ``root`` (incomplete ones are skipped), or None."""
    complete = [c for c in list_checkpoints(root, storage_options) if c.complete]
    return complete[-1] if complete else None


def delete_checkpoint(path: str, storage_options: dict[str, object] | None = None) -> None:
    """Delete one checkpoint: ``.metadata`` first, then its data files."""
    from nvdcp.storage import open_storage

    storage = open_storage(path, **(storage_options or {}))
    storage.delete([METADATA_NAME])
    storage.delete([n for n in storage.list() if n != METADATA_NAME])
    if not _is_url(path):
        shutil.rmtree(path.removeprefix("file://"), ignore_errors=True)


def prune_checkpoints(root: str | os.PathLike[str], keep_last: int, storage_options: dict[str, object] | None = None) -> list[CheckpointInfo]:
    """Keep the newest ``keep_last`` complete checkpoints; delete older ones.

    Incomplete checkpoints older than the newest complete one are leftovers of failed saves and
    are deleted too; newer incomplete ones may be a save in progress and are left alone.
    Returns what was deleted.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    infos = list_checkpoints(root, storage_options)
    complete = [c for c in infos if c.complete]
    if not complete:
        return []
    keep = {c.step for c in complete[-keep_last:]}
    newest = complete[-1].step
    doomed = [c for c in infos if c.step not in keep and (c.complete or c.step < newest)]
    for c in doomed:
        logger.info("deleting checkpoint %s", c.path)
        delete_checkpoint(c.path, storage_options)
    return doomed

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
- Delta checkpoints (:class:`nvdcp.DeltaPolicy`) need their base, and its base, down the chain:
  pruning never deletes a checkpoint that one it keeps depends on, :func:`delete_checkpoint`
  refuses one that others under the same root depend on (unless forced), and a delta whose base
  is gone or replaced is not usable (:func:`checkpoint_problem`). A base is found where a load
  finds it (:func:`nvdcp.format.delta.base_candidates`: relative to the delta first, then where
  the save recorded it) and must be the very save the delta was written against; bases outside
  the root are left alone (nothing of theirs is deleted here).

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
from nvdcp.errors import CheckpointInUseError, NvdcpError
from nvdcp.format.delta import BaseRef, base_candidates, read_delta, same_location

logger = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step_(\d+)$")
#: Bound on the bases followed from one checkpoint (a chain is far shorter; this stops a loop).
_MAX_CHAIN_WALK = 1024
#: What DCP writers put in a checkpoint: nvdcp data files, stock FileSystemWriter data files,
#: ``.metadata`` and its temp files. Deleting touches nothing else.
_CHECKPOINT_FILE = re.compile(
    r"^(__\d+_[0-9a-f]+_\d+\.nvdcp|__\d+_\d+\.distcp|\.metadata|\.metadata\.[0-9a-zA-Z]+\.tmp|\.metadata\.tmp)$"
)

Options = dict[str, Any] | None


@dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint under a root: its step, where it is, whether ``.metadata`` is there, and
    (with ``list_checkpoints(..., bases=True)``) where the base of a delta checkpoint was
    recorded (None: saved whole, incomplete, or not asked)."""

    step: int
    path: str
    complete: bool
    base: str | None = None


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


def list_checkpoints(root: str | os.PathLike[str], storage_options: Options = None, *,
                     bases: bool = False) -> list[CheckpointInfo]:
    """Every ``step_N`` checkpoint under ``root``, oldest first, complete or not.

    ``bases``: also read each complete checkpoint's ``.metadata`` and fill
    :attr:`CheckpointInfo.base` for delta checkpoints (one more read per checkpoint)."""
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
        base = None
        if bases and complete:
            ref = _delta_ref(path, storage_options)
            base = ref.location if isinstance(ref, BaseRef) else None
        infos.append(CheckpointInfo(int(m.group(1)), path, complete, base))
    return sorted(infos, key=lambda c: (c.step, c.path))


# -- delta chains --------------------------------------------------------------------------------
def _read_metadata(path: str, options: Options) -> Any:
    from nvdcp.dcp.metadata_io import load_metadata

    return load_metadata(_open(path, options))


def _delta_ref(path: str, options: Options) -> BaseRef | None | str:
    """The base record of the checkpoint at ``path``: None when saved whole, a string saying why
    it cannot be told (``.metadata`` unreadable)."""
    try:
        return read_delta(_read_metadata(path, options), path)
    except (NvdcpError, OSError) as exc:
        return str(exc)


def _base_mismatch(metadata: Any, ref: BaseRef) -> str | None:
    from nvdcp.dcp.reader import base_problem

    return base_problem(metadata, ref)


def find_base(path: str, ref: BaseRef, storage_options: Options = None) -> tuple[str | None, str | None]:
    """Where the base ``ref`` of the delta checkpoint at ``path`` is, as a load finds it.

    Returns ``(location, None)``, or ``(None, why)`` when no candidate location holds the save
    the delta was written against (gone, or replaced by another save)."""
    found: list[str] = []
    for location in base_candidates(path, ref):
        try:
            metadata = _read_metadata(location, storage_options)
        except (NvdcpError, OSError):
            continue  # nothing committed there (or unreadable): the next candidate
        problem = _base_mismatch(metadata, ref)
        if problem is None:
            return location, None
        found.append(f"{location} holds {problem}")
    tried = ", ".join(base_candidates(path, ref))
    if found:
        return None, (f"is a delta against save {ref.save_id} of {ref.location}, but {'; '.join(found)}: "
                      "that base was replaced")
    return None, f"is a delta against {ref.location} (save {ref.save_id}), which is gone (looked at {tried})"


def checkpoint_base(path: str | os.PathLike[str], storage_options: Options = None) -> str | None:
    """Where the base of the delta checkpoint at ``path`` is (None: it was saved whole).

    Raises:
        MissingBaseError: it is a delta and its base is gone or was replaced.
        IncompleteCheckpointError, CorruptCheckpointError: ``.metadata`` cannot be read.
    """
    from nvdcp.errors import MissingBaseError

    spec = _spec(path)
    ref = read_delta(_read_metadata(spec, storage_options), spec)
    if ref is None:
        return None
    location, why = find_base(spec, ref, storage_options)
    if location is None:
        raise MissingBaseError(f"{spec}: {why}")
    return location


def _save_id(metadata: Any) -> str:
    return str(getattr(getattr(metadata, "storage_meta", None), "save_id", "") or "")


def _dependency_graph(infos: list[CheckpointInfo], options: Options) -> dict[str, list[str]]:
    """For each complete checkpoint of ``infos``, the paths of those of ``infos`` it is a direct
    delta of (its base, when that lives among them: the first base candidate that holds the save
    the delta names, as a load picks it)."""
    metadata: dict[str, Any] = {}
    for info in infos:
        if info.complete:
            try:
                metadata[info.path] = _read_metadata(info.path, options)
            except (NvdcpError, OSError):
                pass
    graph: dict[str, list[str]] = {}
    for path, md in metadata.items():
        try:
            ref = read_delta(md, path)
        except NvdcpError:
            continue
        if ref is None:
            continue
        for location in base_candidates(path, ref):
            match = next((p for p in metadata if same_location(p, location)), None)
            if match is None:
                continue  # not committed here, or outside the root: nothing here to protect for it
            if _base_mismatch(metadata[match], ref) is None:
                graph[path] = [match]
                break
    return graph


def _closure(starts: list[str], graph: dict[str, list[str]]) -> set[str]:
    """Every checkpoint that ``starts`` depend on, down their chains."""
    seen: set[str] = set()
    todo = [b for s in starts for b in graph.get(s, [])]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        todo.extend(graph.get(path, []))
    return seen


def checkpoint_problem(path: str, storage_options: Options = None, *, _seen: set[str] | None = None) -> str | None:
    """Why the checkpoint at ``path`` cannot be loaded, or None if it looks usable.

    Checks that ``.metadata`` loads and that every data file it names exists and holds at least
    the bytes its records point at; for a delta checkpoint, that its base is where a load looks
    for it, is the save the delta was written against, and passes these checks in turn (down
    the chain). It does not read or checksum the data (that is
    :func:`nvdcp.verify_checkpoint`). ``.metadata`` goes through nvdcp's restricted unpickler,
    which refuses the ``PosixPath`` that stock ``FileSystemWriter`` checkpoints pickle: manage
    those with ``verify=False``.
    """
    from nvdcp.dcp.metadata_io import load_metadata

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
        ref = read_delta(metadata, path)
    except (NvdcpError, OSError) as exc:
        return f"{path}: {exc}"
    if ref is None:
        return None
    seen = _seen or set()
    if any(same_location(path, s) for s in seen) or len(seen) > _MAX_CHAIN_WALK:
        return f"{path}: its chain of bases loops back on itself"
    location, why = find_base(path, ref, storage_options)
    if location is None:
        return f"{path}: {why}"
    problem = checkpoint_problem(location, storage_options, _seen=seen | {path})
    return None if problem is None else f"{path}: its base is unusable: {problem}"


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


def dependents(path: str | os.PathLike[str], storage_options: Options = None) -> list[str]:
    """The checkpoints next to ``path`` (the other ``step_N`` of its root) that are deltas
    against it, directly or down their chain: deleting it would make them unloadable. Oldest
    first."""
    spec = _spec(path).rstrip("/")
    root, _, name = spec.rpartition("/")
    if not root or not _STEP_DIR.match(name):
        return []  # not under a root of step_N checkpoints: no siblings to know of
    infos = list_checkpoints(root, storage_options)
    graph = _dependency_graph(infos, storage_options)
    return [
        i.path for i in infos
        if not same_location(i.path, spec) and any(same_location(spec, b) for b in _closure([i.path], graph))
    ]


def delete_checkpoint(path: str, storage_options: Options = None, *, force: bool = False) -> list[str]:
    """Delete one checkpoint: ``.metadata`` first, then the files DCP writers make.

    Returns the names left behind because nvdcp did not recognise them (the directory of a local
    checkpoint is removed only when nothing is left).

    Raises:
        CheckpointInUseError: other checkpoints of the same root are deltas against this one
            (:func:`dependents`, named in the message); ``force=True`` deletes it anyway, and
            they can no longer be loaded.
    """
    spec = _spec(path)
    if not force:
        users = dependents(spec, storage_options)
        if users:
            raise CheckpointInUseError(
                f"{spec} is the base of {len(users)} delta checkpoint(s) that need it to load: "
                f"{', '.join(users)}; delete those first, or pass force=True", users,
            )
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
    save in progress), anything at all when no checkpoint is usable, and the bases of what is
    not deleted (delta checkpoints, down their chains), however old. ``verify`` as in
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
    if doomed:
        # Bases of what stays (kept, or newer and untouched), down their chains, stay too.
        graph = _dependency_graph(infos, storage_options)
        needed = _closure([c.path for c in infos if c not in doomed], graph)
        for c in doomed:
            if c.path in needed:
                logger.info("keeping checkpoint %s: a kept delta checkpoint needs it as its base", c.path)
        doomed = [c for c in doomed if c.path not in needed]
    for c in doomed:
        if dry_run:
            continue
        logger.info("deleting checkpoint %s", c.path)
        delete_checkpoint(c.path, storage_options, force=True)
    return doomed


__all__ = [
    "CheckpointInUseError", "CheckpointInfo", "broadcast_latest_checkpoint", "checkpoint_base", "checkpoint_path",
    "checkpoint_problem", "delete_checkpoint", "dependents", "find_base", "latest_checkpoint", "list_checkpoints",
    "prune_checkpoints",
]

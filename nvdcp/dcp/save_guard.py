"""Saves racing on one location: in-progress markers, the pre-commit check, and cleanup.

Each save marks itself in progress with a small object ``.metadata.pending<token>.tmp`` before
any of its data files (``__<rank>_<token>_<i>.nvdcp``) exists, and removes it after its commit.
Cleanup after a commit never deletes the files of a save whose marker is live
(:meth:`SaveGuard.is_alive`), and :meth:`SaveGuard.check_data_files` checks, before a commit,
that every data file the new ``.metadata`` references is there, whole. ``NvcompWriter`` and
``nvdcp convert`` both follow it, so neither deletes the other's files (docs/RELIABILITY.md).
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from itertools import groupby
from operator import add, attrgetter, itemgetter
from typing import Any

from nvdcp.dcp.collector import gc_paused
from nvdcp.dcp.metadata_io import METADATA_NAME
from nvdcp.errors import CorruptCheckpointError, MissingDataFileError, TruncatedCheckpointError
from nvdcp.storage import Storage

logger = logging.getLogger(__name__)

#: An nvdcp data file; group 1 is the token of the save that wrote it.
DATA_FILE = re.compile(r"^__\d+_([0-9a-f]+)_\d+\.nvdcp$")
#: Marker of a save in progress (its token); matches ``.metadata.*.tmp`` on purpose, so tools
#: that clean up after DCP writers (nvdcp.manage) remove a crashed save's marker too.
PENDING = re.compile(r"^\.metadata\.pending([0-9a-f]+)\.tmp$")
_METADATA_TMP = re.compile(r"^\.metadata\.[0-9A-Za-z]+\.tmp$")
#: A marker written on another machine is taken as abandoned after this long (no save lasts a day).
ASSUME_DEAD_AFTER_S = 24 * 3600

#: Guards with a save in progress in this process, by token (weak: a dropped guard's save is over).
_LIVE: weakref.WeakValueDictionary[str, SaveGuard] = weakref.WeakValueDictionary()


class SaveGuard:
    """One save's side of the protocol at ``storage``: mark, check, commit cleanup."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self.token: str | None = None

    def mark(self, token: str) -> None:
        """Mark the save ``token`` in progress here (before any of its data files exists)."""
        self.token = token
        _LIVE[token] = self
        self.storage.write_atomic(pending_name(token), json.dumps(_owner(token)).encode())

    def abandon(self) -> None:
        """This process no longer runs the save (its marker is left for cleanup by others)."""
        self.token = None

    def unmark(self) -> None:
        """Remove this save's marker (a failed save that deleted its own files)."""
        if self.token is not None:
            self.storage.delete([pending_name(self.token)])
            _LIVE.pop(self.token, None)
            self.token = None

    def check_data_files(self, records: dict[Any, Any]) -> None:
        """Before committing: every data file the new ``.metadata`` names is there and whole.

        With more than one file, one listing (:meth:`~nvdcp.storage.Storage.list_sizes`) answers
        for all of them: 16,384 ranks' files are one directory scan, or 17 ListObjectsV2 pages,
        instead of 16,384 size requests (docs/SCALE.md). A file the listing lacks or sizes
        differently is asked again on its own before the save fails, so a listing that lags a
        write costs a request, never a save.
        """
        # Where each file's last item ends. Records come grouped by file (each rank's results
        # in order): a Python step per group, map/max over the records of a group.
        infos = records.values()
        spans = zip(map(attrgetter("relative_path"), infos),
                    map(add, map(attrgetter("offset"), infos), map(attrgetter("length"), infos)))
        ends: dict[str, int] = {}
        with gc_paused():  # a tuple per record: no collector passes over the coordinator's heap
            for name, group in groupby(spans, key=itemgetter(0)):
                end = max(map(itemgetter(1), group))
                prior = ends.get(name)
                if prior is None or end > prior:
                    ends[name] = max(end, 0)
        unconfirmed = list(ends.items())
        listed = self._list_sizes() if len(unconfirmed) > 1 else None
        if listed is not None:
            unconfirmed = [(name, end) for name, end in unconfirmed if listed.get(name) != end]

        def check(item: tuple[str, int]) -> None:
            name, end = item
            try:
                size = self.storage.size(name)
            except FileNotFoundError:
                raise MissingDataFileError(
                    f"{self.storage.describe(name)} was written by this save but is gone; "
                    "another save to the same location may have deleted it. .metadata not written"
                ) from None
            if size != end:
                cls = TruncatedCheckpointError if size < end else CorruptCheckpointError
                raise cls(
                    f"{self.storage.describe(name)} holds {size} bytes, this save wrote {end}; "
                    "another writer changed it. .metadata not written"
                )

        if len(unconfirmed) == 1:
            check(unconfirmed[0])
        elif unconfirmed:
            with ThreadPoolExecutor(min(16, len(unconfirmed)), thread_name_prefix="nvdcp-check") as pool:
                list(pool.map(check, unconfirmed))

    def _list_sizes(self) -> dict[str, int] | None:
        """The storage's one-pass listing with sizes, or None (then every file is asked alone)."""
        try:
            return self.storage.list_sizes()
        except Exception as exc:  # noqa: BLE001 - a listing is an optimization; size() decides
            logger.debug("listing %s failed (%s); checking data files one by one", self.storage.url, exc)
            return None

    def cleanup(self, keep: set[str], committed: bytes | None = None) -> bool:
        """After the new ``.metadata`` (``committed``) is committed, remove data files of earlier saves.

        Files of a save still in progress at this location (a live marker) are kept. The order
        makes that race-free on any store with read-after-write listing: data files are listed
        before markers, and ``.metadata`` is read again after both. A marker missing from the
        second listing for a file present in the first means that save committed in between;
        then ``.metadata`` is no longer ours and we delete only our own files (superseded). After
        our marker is gone we look once more: a save that committed over ours while our marker
        still stood kept our files, so they are ours to delete. Returns whether a later save
        committed over ours (then nothing but our own files was touched).
        """
        own = self.token
        names = self.storage.list()
        markers = {m.group(1): n for n in self.storage.list() if (m := PENDING.match(n))}
        live = {t for t, n in markers.items() if t != own and self.is_alive(t, n)}
        superseded = committed is not None and self._superseded(committed)
        if superseded:
            stale = [n for n in names if (m := DATA_FILE.match(n)) and m.group(1) == own]
        else:
            stale = [n for n in names if (m := DATA_FILE.match(n)) and n not in keep and m.group(1) not in live]
            stale += [n for t, n in markers.items() if t != own and t not in live]
            if not live:  # a temp file of a live save's commit may be in flight otherwise
                stale += [n for n in names if _METADATA_TMP.match(n) and not PENDING.match(n)]
        if stale:
            logger.debug("deleting %d files of earlier saves under %s", len(stale), self.storage.url)
            self.storage.delete(stale)
        if own is None:
            return superseded
        self.storage.delete([pending_name(own)])
        self.token = None
        _LIVE.pop(own, None)
        if not superseded and committed is not None and self._superseded(committed):
            self.storage.delete([n for n in names if (m := DATA_FILE.match(n)) and m.group(1) == own])
            superseded = True
        if live:
            logger.info("kept the files of %d save(s) in progress under %s", len(live), self.storage.url)
        return superseded

    def _superseded(self, committed: bytes) -> bool:
        """Whether ``.metadata`` is no longer the one this save committed."""
        try:
            current = self.storage.read(METADATA_NAME)
        except FileNotFoundError:
            current = b""  # deleted under us (nvdcp.manage): nothing here is referenced any more
        if current != committed:
            logger.warning("a later save committed over %s; removing this save's files", self.storage.url)
            return True
        return False

    def is_alive(self, token: str, marker: str) -> bool:
        """Whether the save that wrote ``marker`` may still write or commit.

        Same process: it is live while its guard has not finished or moved on to another save.
        Same machine and PID namespace: while its process runs (PID and start time match).
        Elsewhere: for ``ASSUME_DEAD_AFTER_S`` after it started. An unreadable marker is dead
        (markers are written atomically, so it is not one being written).
        """
        try:
            info = json.loads(self.storage.read(marker))
            where, pid, start, created = info["machine"], int(info["pid"]), info["start"], float(info["created"])
        except FileNotFoundError:
            return False
        except (ValueError, KeyError, TypeError):
            return False
        if where == _machine() and where:
            if pid == os.getpid() and start == _process_start(pid):
                guard = _LIVE.get(token)
                return guard is not None and guard.token == token
            return start is not None and _process_start(pid) == start
        return time.time() - created < ASSUME_DEAD_AFTER_S


def pending_name(token: str) -> str:
    return f"{METADATA_NAME}.pending{token}.tmp"


def _process_start(pid: int) -> str | None:
    """Start time of process ``pid`` (clock ticks since boot), or None if it is not running."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return None


_MACHINE_LOCK = threading.Lock()
_MACHINE: list[str] = []


def _machine() -> str:
    """This kernel and PID namespace ("" where /proc cannot tell): where PIDs mean the same thing."""
    with _MACHINE_LOCK:
        if not _MACHINE:
            try:
                with open("/proc/sys/kernel/random/boot_id") as f:
                    boot = f.read().strip()
                ns = os.readlink("/proc/self/ns/pid")
                _MACHINE.append(f"{socket.gethostname()}/{boot}/{ns}")
            except OSError:
                _MACHINE.append("")
        return _MACHINE[0]


def _owner(token: str) -> dict[str, object]:
    return {
        "token": token, "machine": _machine(), "pid": os.getpid(),
        "start": _process_start(os.getpid()), "created": time.time(),
    }

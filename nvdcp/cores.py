"""How many CPU cores one rank's threads may keep busy: the default for every thread count.

``os.cpu_count()`` is the machine's count, which is wrong in the two places training runs:

- a container (a Kubernetes pod with ``limits.cpu: 16`` on a 192-core node) may run on every
  core but only for its CPU quota's worth of time (cgroup ``cpu.max``); and a ``cpuset`` may
  narrow the cores it runs on, which only the affinity mask shows;
- torchrun starts one process per GPU on the same cores (``LOCAL_WORLD_SIZE`` of them): eight
  ranks each sizing their pools by the whole machine run eight times as many threads as cores.

:func:`usable_cores` takes all three into account. The standard library has the affinity
(``os.sched_getaffinity``) but nothing for cgroups, and no chosen dependency reads them: hence
this module.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

CGROUP_ROOT = Path("/sys/fs/cgroup")
_T = TypeVar("_T")


@functools.cache
def usable_cores() -> int:
    """The cores this process's CPU work should be sized for (at least 1).

    The cores it may run on (its affinity), shared evenly with the other ranks torchrun started
    on this host when they may run on the same cores (a rank pinned to fewer cores than its
    container has is taken to be pinned on its own), and capped by the container's CPU quota,
    which all local ranks share.
    """
    return cores_for(_affinity(), os.cpu_count() or 1, _local_ranks(), _own_limits())


def pinned_alone() -> bool:
    """Whether this process may run on fewer cores than its container (or the machine) has:
    pinned to cores of its own, which it need not share with the other local ranks."""
    return _pinned(_affinity(), os.cpu_count() or 1, _own_limits())


def cores_for(affinity: int, machine: int, local_ranks: int, limits: CgroupLimits) -> int:
    """:func:`usable_cores` from what it reads: ``affinity`` cores to run on, ``machine``
    cores online, ``local_ranks`` ranks on this host, and the cgroup's ``limits``."""
    cores = affinity if _pinned(affinity, machine, limits) else affinity // local_ranks
    if limits.quota is not None:
        cores = min(cores, math.ceil(limits.quota / local_ranks))
    return max(1, cores)


def _pinned(affinity: int, machine: int, limits: CgroupLimits) -> bool:
    """Fewer cores to run on than the container's cpuset (or the machine) has, which every
    rank in it may use: this rank was pinned on its own."""
    return affinity < (limits.cpuset or machine)


@dataclass(frozen=True)
class CgroupLimits:
    """A cgroup's CPU limits, the tightest over it and its ancestors: ``quota`` in cores
    (``cpu.max``; None when unlimited) and the size of its ``cpuset`` (None when not set)."""

    quota: float | None = None
    cpuset: int | None = None


def cgroup_limits(root: Path, groups: dict[str, str]) -> CgroupLimits:
    """The CPU limits of this process's cgroups under ``root`` (``/sys/fs/cgroup``), given its
    group per controller as :func:`own_cgroups` reads them (``""``: the v2 group). cgroup v1's
    ``cpu`` and ``cpuset`` hierarchies are read where ``root`` mounts them, else v2's files;
    unreadable or malformed files count as no limit."""
    cpu_v1 = next((root / d for d in ("cpu", "cpu,cpuacct") if (root / d / "cpu.cfs_quota_us").exists()), None)
    quotas: list[float] = []
    cpusets: list[int] = []
    if cpu_v1 is not None:
        for group in _self_and_ancestors(groups.get("cpu", "/")):
            quotas += _found(_v1_quota(_read(cpu_v1 / group / "cpu.cfs_quota_us"),
                                       _read(cpu_v1 / group / "cpu.cfs_period_us")))
    else:
        for group in _self_and_ancestors(groups.get("", "/")):
            quotas += _found(_v2_quota(_read(root / group / "cpu.max")))
    if (root / "cpuset" / "cpuset.effective_cpus").exists():
        for group in _self_and_ancestors(groups.get("cpuset", "/")):
            cpusets += _found(_cpuset_size(_read(root / "cpuset" / group / "cpuset.effective_cpus")))
    else:
        for group in _self_and_ancestors(groups.get("", "/")):
            cpusets += _found(_cpuset_size(_read(root / group / "cpuset.cpus.effective")))
    return CgroupLimits(min(quotas, default=None), min(cpusets, default=None))


def own_cgroups(text: str) -> dict[str, str]:
    """This process's group per controller, from ``/proc/self/cgroup`` lines such as
    ``0::/kubepods/pod1/c1`` (v2: controller ``""``) or ``4:cpu,cpuacct:/docker/abc`` (v1)."""
    groups: dict[str, str] = {}
    for line in text.splitlines():
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        for controller in fields[1].split(","):
            groups.setdefault(controller, fields[2])
    return groups


def _found(value: _T | None) -> list[_T]:
    return [] if value is None else [value]


def _self_and_ancestors(cgroup: str) -> list[str]:
    """``a/b``, ``a``, ``""`` for ``/a/b``: relative, to join under a hierarchy's mount."""
    parts = [p for p in cgroup.split("/") if p]
    return ["/".join(parts[:n]) for n in range(len(parts), -1, -1)]


def _v2_quota(text: str | None) -> float | None:
    """``cpu.max``: ``"max 100000"`` (no limit) or ``"<quota_us> <period_us>"``."""
    fields = (text or "").split()
    if len(fields) != 2 or fields[0] == "max":
        return None
    return _ratio(fields[0], fields[1])


def _v1_quota(quota: str | None, period: str | None) -> float | None:
    """``cpu.cfs_quota_us`` (-1: no limit) over ``cpu.cfs_period_us``."""
    if quota is None or period is None or quota.strip() == "-1":
        return None
    return _ratio(quota, period)


def _ratio(quota: str, period: str) -> float | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def _cpuset_size(text: str | None) -> int | None:
    """Cores in a cpuset list such as ``"0-3,8,10-11"`` (None when empty or malformed)."""
    count = 0
    for part in (text or "").strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        try:
            count += int(hi or lo) - int(lo) + 1
        except ValueError:
            return None
    return count or None


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def _own_limits() -> CgroupLimits:
    return cgroup_limits(CGROUP_ROOT, own_cgroups(_read(Path("/proc/self/cgroup")) or ""))


def _affinity() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def _local_ranks() -> int:
    """Processes of this job on this host, as torchrun (or torch.multiprocessing with it set) says."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1

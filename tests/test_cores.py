"""The cores a rank sizes its threads for: affinity, local ranks, cgroup quota and cpuset."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from nvdcp.cores import CgroupLimits, cgroup_limits, cores_for, own_cgroups, usable_cores

NO_LIMITS = CgroupLimits()


def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.mark.parametrize(("affinity", "machine", "ranks", "limits", "expected"), [
    (16, 16, 1, NO_LIMITS, 16),
    (16, 16, 8, NO_LIMITS, 2),  # torchrun: 8 ranks share the host's cores
    (16, 16, 32, NO_LIMITS, 1),  # never below one
    (4, 16, 4, NO_LIMITS, 4),  # pinned to 4 cores of its own (numactl per rank)
    (16, 64, 2, CgroupLimits(cpuset=16), 8),  # a container's cpuset, shared by its 2 ranks
    (192, 192, 1, CgroupLimits(quota=16.0), 16),  # a pod with limits.cpu 16 on a 192-core node
    (192, 192, 8, CgroupLimits(quota=16.0), 2),
    (192, 192, 1, CgroupLimits(quota=1.5), 2),  # a fractional quota still runs 2 threads part time
])
def test_cores_for(affinity: int, machine: int, ranks: int, limits: CgroupLimits, expected: int) -> None:
    assert cores_for(affinity, machine, ranks, limits) == expected


def test_cgroup_v2_takes_the_tightest_limit_up_the_tree(tmp_path: Path) -> None:
    _write(tmp_path, "cpu.max", "max 100000\n")
    _write(tmp_path, "cpuset.cpus.effective", "0-63\n")
    _write(tmp_path, "kubepods/cpu.max", "800000 100000\n")
    _write(tmp_path, "kubepods/pod1/cpu.max", "1600000 100000\n")  # looser than its parent's
    _write(tmp_path, "kubepods/pod1/c1/cpuset.cpus.effective", "0-3,8,10-11\n")
    limits = cgroup_limits(tmp_path, own_cgroups("0::/kubepods/pod1/c1\n"))
    assert limits == CgroupLimits(quota=8.0, cpuset=7)


def test_cgroup_v2_inside_its_namespace(tmp_path: Path) -> None:
    """A private cgroup namespace: /proc/self/cgroup says ``/``; the mount is the pod's group."""
    _write(tmp_path, "cpu.max", "250000 100000\n")
    assert cgroup_limits(tmp_path, own_cgroups("0::/\n")) == CgroupLimits(quota=2.5)


def test_cgroup_v1(tmp_path: Path) -> None:
    _write(tmp_path, "cpu,cpuacct/cpu.cfs_quota_us", "-1\n")
    _write(tmp_path, "cpu,cpuacct/cpu.cfs_period_us", "100000\n")
    _write(tmp_path, "cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "400000\n")
    _write(tmp_path, "cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000\n")
    _write(tmp_path, "cpuset/cpuset.effective_cpus", "0-31\n")
    _write(tmp_path, "cpuset/docker/abc/cpuset.effective_cpus", "4-11\n")
    groups = own_cgroups("12:cpuset:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/\n")
    assert cgroup_limits(tmp_path, groups) == CgroupLimits(quota=4.0, cpuset=8)


@pytest.mark.parametrize("text", ["", "garbage\n", "-5 100000\n", "100000\n", "max\n"])
def test_malformed_or_missing_quota_is_no_limit(tmp_path: Path, text: str) -> None:
    _write(tmp_path, "cpu.max", text)
    _write(tmp_path, "cpuset.cpus.effective", "0-x\n")
    assert cgroup_limits(tmp_path, own_cgroups("0::/\n")) == NO_LIMITS


def test_no_cgroup_files_at_all(tmp_path: Path) -> None:
    assert cgroup_limits(tmp_path / "absent", {}) == NO_LIMITS


def _usable_cores_with(env: dict[str, str]) -> int:
    code = "from nvdcp.cores import usable_cores; print(usable_cores())"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                         check=True, timeout=60)
    return int(out.stdout)


def test_a_process_under_torchrun_shares_the_host() -> None:
    """Real processes, as torchrun starts them: LOCAL_WORLD_SIZE halves what each one takes."""
    alone = _usable_cores_with({"LOCAL_WORLD_SIZE": "1"})
    assert alone == usable_cores() or "LOCAL_WORLD_SIZE" in os.environ
    assert 1 <= alone <= (os.cpu_count() or 1)
    from nvdcp import cores

    if alone >= 2 and not cores.pinned_alone():
        assert 1 <= _usable_cores_with({"LOCAL_WORLD_SIZE": "2"}) <= -(-alone // 2)
    assert _usable_cores_with({"LOCAL_WORLD_SIZE": "not a number"}) == alone


def _writable_cpu_cgroup_v1() -> Path | None:
    root = Path("/sys/fs/cgroup/cpu")
    return root if (root / "cpu.cfs_quota_us").exists() and os.access(root, os.W_OK) else None


@pytest.mark.skipif(_writable_cpu_cgroup_v1() is None, reason="needs a writable cgroup v1 cpu hierarchy (root)")
def test_a_real_cpu_quota_caps_a_process(tmp_path: Path) -> None:
    """A process moved into a real cgroup with a one-CPU quota sizes its pools for one core."""
    if _usable_cores_with({"LOCAL_WORLD_SIZE": "1"}) < 2:
        pytest.skip("one core: a one-CPU quota changes nothing")
    root = _writable_cpu_cgroup_v1()
    assert root is not None
    group = root / f"nvdcp-test-{os.getpid()}"
    group.mkdir()
    try:
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text("100000")
        code = "from nvdcp.cores import usable_cores; print(usable_cores())"
        script = f'echo $$ > {group}/cgroup.procs && exec "{sys.executable}" -c "{code}"'
        out = subprocess.run(["sh", "-c", script], env={**os.environ, "LOCAL_WORLD_SIZE": "1"},
                             capture_output=True, text=True, check=True, timeout=60)
        assert int(out.stdout) == 1
    finally:
        group.rmdir()

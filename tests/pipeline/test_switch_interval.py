"""The GIL switch interval held while GPU work is launched (nvdcp.gpu.gil): set, shared, restored."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator

import pytest

from nvdcp.gpu import gil


@pytest.fixture(autouse=True)
def default_interval(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("NVDCP_SWITCH_INTERVAL", raising=False)
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield
    sys.setswitchinterval(before)


def test_the_interval_is_short_inside_and_the_callers_after() -> None:
    with gil.short_switch_interval():
        assert sys.getswitchinterval() == pytest.approx(gil.GPU_SWITCH_INTERVAL)
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_nested_holders_restore_only_when_the_last_leaves() -> None:
    with gil.short_switch_interval():
        with gil.short_switch_interval():
            pass
        assert sys.getswitchinterval() == pytest.approx(gil.GPU_SWITCH_INTERVAL)
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_concurrent_holders_on_threads_share_one_setting() -> None:
    entered, release = threading.Barrier(3), threading.Event()

    def hold() -> None:
        with gil.short_switch_interval():
            entered.wait()
            release.wait()

    threads = [threading.Thread(target=hold) for _ in range(2)]
    for t in threads:
        t.start()
    entered.wait()
    assert sys.getswitchinterval() == pytest.approx(gil.GPU_SWITCH_INTERVAL)
    release.set()
    for t in threads:
        t.join()
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_a_lower_interval_of_the_caller_is_kept() -> None:
    sys.setswitchinterval(0.0001)
    with gil.short_switch_interval():
        assert sys.getswitchinterval() == pytest.approx(0.0001)
    assert sys.getswitchinterval() == pytest.approx(0.0001)


def test_an_interval_set_meanwhile_is_not_undone() -> None:
    with gil.short_switch_interval():
        sys.setswitchinterval(0.002)
    assert sys.getswitchinterval() == pytest.approx(0.002)


def test_an_error_in_the_block_still_restores() -> None:
    with pytest.raises(RuntimeError), gil.short_switch_interval():
        raise RuntimeError("boom")
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_the_environment_sets_or_disables_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NVDCP_SWITCH_INTERVAL", "0.001")
    with gil.short_switch_interval():
        assert sys.getswitchinterval() == pytest.approx(0.001)
    monkeypatch.setenv("NVDCP_SWITCH_INTERVAL", "0")
    with gil.short_switch_interval():
        assert sys.getswitchinterval() == pytest.approx(0.005)


@pytest.mark.parametrize("raw", ["fast", "-1"])
def test_a_bad_environment_value_is_named(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("NVDCP_SWITCH_INTERVAL", raw)
    with pytest.raises(ValueError, match="NVDCP_SWITCH_INTERVAL"), gil.short_switch_interval():
        pass
    assert sys.getswitchinterval() == pytest.approx(0.005)

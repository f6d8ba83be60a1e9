"""A shorter GIL switch interval while a save's GPU encode launches work.

Every torch operator releases the GIL around its dispatch and takes it back after. While another
thread runs Python (a file thread building its write list, the main thread turning a finished
bucket into records), the thread giving the GPU its next kernel waits for the GIL for up to the
interpreter's switch interval (5 ms by default) after each operator: a bucket's launch of a few
dozen operators then stretches over tens of milliseconds while the GPU idles. A 0.5 ms interval
bounds each wait ten times lower. Measured in session 32, same tree, alternating (docs/BENCHMARKS.md,
"Thirty-second session"): saves of 20,000 small GPU tensors 2.13 against 2.33 s (H100, medians of two)
and 2.36 against 2.76 s (H200, medians of four); fp32 delta saves 208 / 174 against 240 / 205 ms on the
H100, neutral on the H200; 4 GB of large tensors neutral. Loads do not use it: small-tensor loads
were faster in half the pairs, fp32 delta loads 3-9% slower in both.

The interval is process-wide, so it is set only while a save has GPU work in flight,
and the caller's value comes back when the last of them ends (nested and concurrent saves share
one setting). An interval the caller set lower is kept, and one set while a save runs is not
undone. During an ``async_save`` the training thread runs under it too: its own operators then
wait less for the GIL behind the save's threads. ``NVDCP_SWITCH_INTERVAL`` (seconds) sets the
value; ``0`` leaves the interpreter's alone.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

#: The switch interval while GPU work is launched, in seconds (the interpreter's default is 5 ms).
GPU_SWITCH_INTERVAL = 0.0005

_lock = threading.Lock()
_holders = 0
_saved: float | None = None  # the interval before the first holder set ours
_applied: float | None = None  # the interval the first holder set (None: it kept the caller's)


def wanted_interval() -> float | None:
    """The interval to set (None: leave the interpreter's), from ``NVDCP_SWITCH_INTERVAL``."""
    raw = os.environ.get("NVDCP_SWITCH_INTERVAL")
    if raw is None:
        return GPU_SWITCH_INTERVAL
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"NVDCP_SWITCH_INTERVAL must be a number of seconds, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"NVDCP_SWITCH_INTERVAL must be >= 0 seconds, got {raw!r}")
    return value or None


@contextmanager
def short_switch_interval() -> Iterator[None]:
    """Hold the shorter switch interval for the ``with`` block (see the module's docstring)."""
    global _holders, _saved, _applied
    wanted = wanted_interval()
    if wanted is None:
        yield
        return
    with _lock:
        if _holders == 0:
            _saved = sys.getswitchinterval()
            _applied = None
            if wanted < _saved:
                sys.setswitchinterval(wanted)
                _applied = sys.getswitchinterval()
        _holders += 1
    try:
        yield
    finally:
        with _lock:
            _holders -= 1
            # the caller's value back, unless someone set another meanwhile (theirs stays)
            if _holders == 0 and _saved is not None and _applied is not None and sys.getswitchinterval() == _applied:
                sys.setswitchinterval(_saved)
            if _holders == 0:
                _saved = _applied = None

"""Python's cyclic garbage collector paused while nvdcp's storage steps run on the main thread.

Why: a save or load of many items allocates a few container objects per item, and every 700
allocations start a collection; each full collection walks every tracked object in the process
(the state dict, DCP's ``Metadata``: hundreds of thousands of objects for 20,000 items). Measured
on the CPU machine (``benchmarks/phase_probe.py``, 20,000 tensors): the collector took 2.1 s of a
7.4 s load, two full passes of 0.6-0.8 s each, one of them inside ``read_data``. torch's own
``get_state_dict``/``set_state_dict`` pause it the same way (``state_dict._gc_context``).

Only on the main thread, where a blocking ``dcp.save``/``dcp.load`` runs and training waits for it:
``dcp.async_save`` runs the storage steps on a background thread while training goes on, and there
the collector keeps running. Objects are still freed by reference counting while it is paused;
only cycles wait, and the collector resumes (with its counts) when the step returns. Set
``NVDCP_PAUSE_GC=0`` to leave it alone.
"""

from __future__ import annotations

import functools
import gc
import os
import threading
from collections.abc import Callable
from typing import ParamSpec, TypeVar

ENV_VAR = "NVDCP_PAUSE_GC"

_P = ParamSpec("_P")
_T = TypeVar("_T")


def pausing_here() -> bool:
    """Whether a storage step called now pauses the collector."""
    return (
        os.environ.get(ENV_VAR, "1") != "0"
        and threading.current_thread() is threading.main_thread()
        and gc.isenabled()
    )


def collector_paused(step: Callable[_P, _T]) -> Callable[_P, _T]:
    """Run ``step`` with the collector paused (see the module's doc for when)."""

    @functools.wraps(step)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> _T:
        if not pausing_here():
            return step(*args, **kwargs)
        gc.disable()
        try:
            return step(*args, **kwargs)
        finally:
            gc.enable()

    return run

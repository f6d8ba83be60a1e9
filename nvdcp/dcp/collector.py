"""Python's cyclic garbage collector paused while nvdcp's storage steps run on the main thread.

Why: a save or load of many items allocates a few container objects per item, and every 700
allocations start a collection; each full collection walks every tracked object in the process
(the state dict, DCP's ``Metadata``: hundreds of thousands of objects for 20,000 items). Measured
on the CPU machine (``benchmarks/phase_probe.py``, 20,000 tensors): the collector took 2.0-2.4 s
of a 7.1-8.3 s load, with full passes of 0.7-0.9 s inside ``read_data``; paused there, loads took
5.7-6.0 s (``benchmarks/results/phase_probe_gc_pause_2026-12-02_cpu_session15.json``). torch's own
``get_state_dict``/``set_state_dict`` pause it the same way (``state_dict._gc_context``).
``write_data``, ``finish``, ``read_data`` and the stager's ``stage`` are wrapped
(:func:`collector_paused`); ``read_metadata`` is not: :func:`~nvdcp.dcp.metadata_io.load_metadata`
pauses it for the unpickling (:func:`gc_paused`) and then runs one young pass on purpose.

Only on the main thread, where a blocking ``dcp.save``/``dcp.load`` runs and training waits for it:
``dcp.async_save`` runs the storage steps on a background thread while training goes on, and there
the collector keeps running. Objects are still freed by reference counting while it is paused;
only cycles wait, and the collector resumes (with its counts) when the step returns. Set
``NVDCP_PAUSE_GC=0`` to leave it alone.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import threading
from collections.abc import Callable, Iterator
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


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Run the block with the collector off, on any thread (restored after, if it was on).

    For blocks that build or walk objects by the million, none of which can form a cycle:
    unpickling and checking a ``.metadata``, pickling one, a save report's tuples.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def collector_paused(step: Callable[_P, _T]) -> Callable[_P, _T]:
    """Run the storage step ``step`` with the collector paused when called on the main thread
    (see the module's doc)."""

    @functools.wraps(step)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> _T:
        if not pausing_here():
            return step(*args, **kwargs)
        with gc_paused():
            return step(*args, **kwargs)

    return run

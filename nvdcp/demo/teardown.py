"""Ending a process group for real after DTensor / FSDP2 work.

torch's DTensor sharding-propagation caches keep DeviceMeshes, and through them ProcessGroups,
alive: once any DTensor op has run, ``destroy_process_group`` only unregisters the group, and
its gloo worker, transport and TCPStore threads run on until the interpreter tears down, where
a C++ thread still running can abort the process ("terminate called without an active
exception"), failing a job that finished its work. Call :func:`release_dtensor_caches` right
before ``destroy_process_group``, while every peer is still there.
"""

from __future__ import annotations

import gc

import torch


def release_dtensor_caches() -> None:
    """Drop torch's DTensor sharding-propagation caches.

    Their entries hold DeviceMeshes (through DTensorSpecs, redistribute planners, mesh topology
    info), and a DeviceMesh holds its ProcessGroups: once any DTensor op has run,
    ``destroy_process_group`` only unregisters the group, and its gloo worker, transport and
    TCPStore threads keep running until the process exits. The C++ fast-path cache is never
    cleared at exit, so the gloo group was never destroyed and its threads were still running
    while the process tore down (the suspected source of the rare SIGABRT "terminate called
    without an active exception" at a training phase's exit).
    """
    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_native is not None:
        clear_native()
    # The Python-side caches (private torch API: each is looked up, and skipped if it moved).
    from torch.distributed.tensor import DTensor, _collective_utils, _redistribute

    for clear in (
        getattr(DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding, "cache_clear", None),
        getattr(_redistribute, "clear_redistribute_planner_cache", None),
        getattr(getattr(_redistribute, "_gen_transform_infos", None), "cache_clear", None),
        getattr(getattr(getattr(_collective_utils, "MeshTopoInfo", None), "build_from_mesh", None),
                "cache_clear", None),
    ):
        if clear is not None:
            clear()
    gc.collect()


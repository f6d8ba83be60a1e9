"""Helpers around the reference workload for the benchmarks.

The workload itself (the demo's byte-level GPT trained with AdamW on the Python stdlib) is
:func:`nvdcp.demo.workload.train_state`, shared with ``nvdcp bench``; it is re-exported here.
"""

from __future__ import annotations

from typing import Any

import torch

from nvdcp.demo.workload import train_state

__all__ = ["states_equal", "tensor_bytes", "to_bf16", "train_state", "zeros_like_state"]


def to_bf16(state: dict[str, Any]) -> dict[str, Any]:
    """The bf16 variant: every floating tensor (params and moments) cast to bf16."""

    def cast(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return obj.to(torch.bfloat16) if obj.is_floating_point() and obj.dim() > 0 else obj
        if isinstance(obj, dict):
            return {k: cast(v) for k, v in obj.items()}
        return obj

    return cast(state)


def tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor in a nested state (dicts, lists, tuples), in order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors(v)]
    return []


def tensor_bytes(state: Any) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(tensor_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(tensor_bytes(v) for v in state)
    return 0


def zeros_like_state(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: zeros_like_state(v) for k, v in state.items()}
    if isinstance(state, list):
        return [zeros_like_state(v) for v in state]
    return state


def states_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
            a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
        ) if a.numel() else True
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(states_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(states_equal(x, y) for x, y in zip(a, b))
    return a == b

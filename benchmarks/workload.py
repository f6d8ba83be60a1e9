"""The reference workload (BRIEF.md): a byte-level GPT trained with AdamW on the Python stdlib.

GPU: d=768, 12 layers, 85.6 M parameters, 400 steps of 32x512 under bf16 autocast (1.03 GB of
fp32 params + exp_avg + exp_avg_sq). CPU: d=256, 4 layers, a few dozen steps.
"""

from __future__ import annotations

from typing import Any

import torch

from nvdcp.demo.model import GPT, GPTConfig, batch_for_step, lr_at, stdlib_bytes


def train_state(device: str, *, cfg: GPTConfig, steps: int, batch: int, seed: int = 0) -> tuple[dict[str, Any], float]:
    """Train and return ``({"model": ..., "optim": ...}, final loss)`` with tensors on ``device``."""
    torch.manual_seed(seed)
    model = GPT(cfg).to(device)
    fused = device.startswith("cuda")
    optim = torch.optim.AdamW(model.parameters(), lr=6e-4, weight_decay=0.1, fused=fused)
    data = stdlib_bytes(32 << 20)
    loss = torch.tensor(0.0)
    for step in range(steps):
        x, y = batch_for_step(data, step, 0, 1, batch, cfg.context, seed)
        x, y = x.to(device), y.to(device)
        for g in optim.param_groups:
            g["lr"] = lr_at(step, total=steps)
        with torch.autocast(device_type="cuda" if fused else "cpu", dtype=torch.bfloat16, enabled=fused):
            loss = model(x, y)
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
    return {"model": model.state_dict(), "optim": optim.state_dict()}, float(loss)


def to_bf16(state: dict[str, Any]) -> dict[str, Any]:
    """The bf16 variant: every floating tensor (params and moments) cast to bf16."""

    def cast(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return obj.to(torch.bfloat16) if obj.is_floating_point() and obj.dim() > 0 else obj
        if isinstance(obj, dict):
            return {k: cast(v) for k, v in obj.items()}
        return obj

    return cast(state)


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

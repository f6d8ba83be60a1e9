"""The reference workload: the demo's byte-level GPT trained a few steps with AdamW on the Python
stdlib, in one process. Its weights and both AdamW moments are what the benchmarks checkpoint.

GPU: ``GPTConfig.reference()`` (d=768, 12 layers, 85.6 M parameters), 400 steps of 32x512 under
bf16 autocast (1.03 GB of fp32 params + exp_avg + exp_avg_sq). CPU: d=256, 4 layers, a few dozen
steps. Used by ``nvdcp bench`` (:func:`nvdcp.codec_bench.reference_state`) and by benchmarks/.
"""

from __future__ import annotations

from typing import Any

import torch

from nvdcp.demo.model import GPT, GPTConfig, batch_for_step, lr_at, stdlib_bytes


def train_state(
    device: str, *, cfg: GPTConfig, steps: int, batch: int, seed: int = 0, data_bytes: int = 32 << 20,
) -> tuple[dict[str, Any], float]:
    """Train and return ``({"model": ..., "optim": ...}, final loss)`` with tensors on ``device``.

    On CUDA, AdamW is fused and the forward runs under bf16 autocast. Batches are drawn from the
    first ``data_bytes`` bytes of the stdlib sources (:func:`nvdcp.demo.model.stdlib_bytes`).
    """
    torch.manual_seed(seed)
    model = GPT(cfg).to(device)
    fused = device.startswith("cuda")
    optim = torch.optim.AdamW(model.parameters(), lr=6e-4, weight_decay=0.1, fused=fused)
    data = stdlib_bytes(data_bytes)
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
    return {"model": model.state_dict(), "optim": optim.state_dict()}, float(loss.detach())


__all__ = ["train_state"]

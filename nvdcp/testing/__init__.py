"""The reliability test kit shared by tests/ and benchmarks/ (like ``numpy.testing``): not runtime API.

Nothing in nvdcp imports this package; it is here so that the test suite and the benchmarks
(benchmarks/reliability_sweep.py runs the heavy versions of tests/reliability) share one copy
without the benchmarks importing ``tests``.

- this module: state-dict helpers (random and weight-like tensors, bit-exact comparison, empty
  load targets) and :func:`failure_of`, which unwraps DCP's ``CheckpointException``;
- :mod:`nvdcp.testing.faults`: fault injection (a writer that SIGKILLs its process at a named
  phase or after N bytes), 2-rank gloo save workers, outcome checks;
- :mod:`nvdcp.testing.damage`: byte flips and truncations of a saved checkpoint, classified;
- :mod:`nvdcp.testing.fuzz_targets`: hypothesis fuzz targets (needs ``hypothesis``, from the
  ``test`` extra).
"""

from __future__ import annotations

from typing import Any

import torch


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality for any dtype (NaNs and float8 included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    from nvdcp.pipeline.tensors import flat_bytes

    return torch.equal(flat_bytes(a), flat_bytes(b))


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random bits of any dtype: every bit pattern, NaNs and infs included."""
    g = torch.Generator().manual_seed(seed)
    numel = 1
    for s in shape:
        numel *= s
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * size,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw & 1
    return raw.view(dtype).reshape(shape)


def weights_like(shape: tuple[int, ...], dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 0.02).to(dtype)


def empty_like_sd(sd: dict[str, Any]) -> dict[str, Any]:
    """A load target shaped like ``sd``: zero tensors, nested dicts, None for everything else."""
    out: dict[str, Any] = {}
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            out[k] = torch.zeros(v.shape, dtype=v.dtype) if v.dtype != torch.bool else torch.zeros(v.shape, dtype=torch.bool)
        elif isinstance(v, dict):
            out[k] = empty_like_sd(v)
        else:
            out[k] = None
    return out


def failure_of(exc: BaseException) -> BaseException:
    """The first rank's underlying exception inside DCP's CheckpointException."""
    failures = getattr(exc, "failures", None)
    if not failures:
        return exc
    wrapped = next(iter(failures.values()))
    # torch wraps each rank's failure as (exception, traceback summary)
    return wrapped[0] if isinstance(wrapped, tuple) else wrapped


def clear_plan_caches() -> None:
    """Empty torch's save-plan caches (``DefaultSavePlanner(enable_plan_caching=True)``), which
    live on the ``SavePlanner`` class for the whole process."""
    from torch.distributed.checkpoint.planner import SavePlanner

    for name in ("_cached_save_plan", "_cached_final_save_plan", "_cached_all_plans", "_cached_global_plan",
                 "_cached_metadata"):
        getattr(SavePlanner, name, {}).clear()


__all__ = ["bit_equal", "clear_plan_caches", "empty_like_sd", "failure_of", "random_tensor", "weights_like"]

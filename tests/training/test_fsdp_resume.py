"""FSDP2 model and optimizer state through get_state_dict/set_state_dict, saved with
``dcp.async_save`` + nvdcp on N gloo ranks and loaded on M (4 -> 2, 2 -> 3, 4 -> 1), bit-exactly,
with uneven and empty shards; training resumes exactly where it stopped.

One chain of real multi-process runs (tests/training/fsdp_worker.py), shared by the tests below:

    a (4 ranks): steps 1-3, async save a3 (THREAD, NvcompWriter as its own stager), steps 4-6
    b (2 ranks): load a3, steps 4-6, async save b6 (THREAD, NvcompStager compressing on the CPU),
                 steps 7-9, async save b9 (PROCESS), step 10
    c (2 ranks): restart: load b6, steps 7-9; load b9
    d (3 ranks): load b6, steps 7-9
    e (1 rank):  load a3, steps 4-6
"""

from __future__ import annotations

import json
import math
import warnings
from typing import Any

import pytest
from torch.multiprocessing.spawn import ProcessExitedException

from tests._dist import run_ranks
from tests.training import fsdp_worker

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

#: Losses at another world size differ only by float summation order (gradient reduce-scatter,
#: loss all-reduce): measured up to 1.2e-7 relative here; the bound leaves room for other CPUs.
CROSS_WORLD_RTOL = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("fsdp")
    for name, world in (("a", 4), ("b", 2), ("c", 2), ("d", 3), ("e", 1)):
        for attempt in range(3):
            try:
                run_ranks(world, getattr(fsdp_worker, f"run_{name}"), str(root))
                break
            except ProcessExitedException as exc:
                # A rank killed by a signal (seen: SIGABRT "terminate called without an active
                # exception" from a 3-rank gloo phase, about one CI run in three, cause not yet
                # found) reruns its phase; each phase is idempotent and every assertion below
                # runs on the rerun's results.
                if exc.signal_name is None or attempt == 2:
                    raise
                warnings.warn(f"phase {name}: {exc}; running it again", stacklevel=1)
    return {name: json.loads((root / f"{name}.json").read_text()) for name in "abcde"}


def _close(got: list[float], want: list[float]) -> bool:
    return len(got) == len(want) and all(math.isclose(g, w, rel_tol=CROSS_WORLD_RTOL) for g, w in zip(got, want))


def test_uneven_and_empty_shards_on_four_ranks(runs: dict[str, Any]) -> None:
    rows = runs["a"]["local_rows"]
    assert [r["mid.weight"] for r in rows] == [3, 3, 3, 1]
    assert [r["head.weight"] for r in rows] == [1, 1, 1, 0]  # rank 3 holds empty shards


def test_reshard_4_to_2_bit_exact(runs: dict[str, Any]) -> None:
    assert runs["b"]["checks"] == []


def test_reshard_2_to_3_bit_exact(runs: dict[str, Any]) -> None:
    assert runs["d"]["checks"] == []


def test_reshard_4_to_1_bit_exact(runs: dict[str, Any]) -> None:
    assert runs["e"]["checks"] == []


def test_async_thread_and_process_saves_load_bit_exact(runs: dict[str, Any]) -> None:
    # a3: THREAD, writer as stager (host copies); b6: THREAD, pre-encoded on the CPU; b9: PROCESS.
    assert runs["b"]["checks"] == [] and runs["c"]["checks"] == [] and runs["c"]["checks_b9"] == []
    stats = runs["b"]["stats"]
    assert stats["compressed"] == stats["shards"] > 0


def test_resume_continues_exactly_at_same_world_size(runs: dict[str, Any]) -> None:
    assert runs["c"]["losses"] == runs["b"]["losses_7_9"]


def test_resume_at_other_world_sizes_within_tolerance(runs: dict[str, Any]) -> None:
    assert _close(runs["b"]["losses_4_6"], runs["a"]["losses"])  # 4 -> 2
    assert _close(runs["d"]["losses"], runs["b"]["losses_7_9"])  # 2 -> 3
    assert _close(runs["e"]["losses"], runs["a"]["losses"])  # 4 -> 1

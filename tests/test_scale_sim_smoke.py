"""benchmarks/scale_sim.py at a tiny size: every phase runs for both writers and the table comes out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import scale_sim


def test_model_and_shards() -> None:
    sharded, steps = scale_sim.model_entries(scale_sim.FULL_MODEL_ITEMS)
    assert len(sharded) == 873 and len(steps) == 291
    assert sum(s[0] * (s[1] if len(s) > 1 else 1) for f, s in sharded if f.startswith("model.")) == 6_738_415_616
    assert len(scale_sim.model_entries(1000)[0]) == 1000  # more items: more layers
    # torch.chunk's split: 4096 rows over 16,384 ranks leaves the last 12,288 empty
    assert scale_sim.shard(4096, 16384, 4095) == (4095, 1) and scale_sim.shard(4096, 16384, 9000) == (4096, 0)
    assert scale_sim.total_items(16384, 873) == 4_975_512  # the whole model: ~304 records per rank
    assert scale_sim.plan_sizes([64, 16384], 873, 3_500_000) == [(64, 873), (16384, 614)]
    plans = [scale_sim.local_plan(r, 8, [("t", (5, 2))], []) for r in range(8)]
    # rank 0 also keeps the 12 param_groups entries; one empty shard kept, by rank 5
    assert [len(p.items) for p in plans] == [13, 1, 1, 1, 1, 1, 0, 0]


def test_runs_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    scale_sim.main(["--ranks", "6", "--items-per-rank", "20", "--dir", str(tmp_path / "sim"), "--out", str(tmp_path), "--dcp"])
    out = capsys.readouterr().out
    assert "nvdcp / stock:" in out
    (result,) = tmp_path.glob("scale_sim_*.json")
    payload = json.loads(result.read_text())
    assert {"date", "machine", "command"} <= payload.keys()
    rows = {r["writer"]: r for r in payload["rows"]}
    assert rows.keys() == {"stock", "nvdcp"}
    for row in rows.values():
        # 6 ranks x 20 shards (of 7 parameters: 7 steps), 12 param_groups entries
        assert row["items"] == 6 * 20 + 7 + 12 == scale_sim.total_items(6, 20) and row["data files"] == 6
        assert row[".metadata bytes"] > 10_000 and row["coordinator s"] > 0 and row["read_metadata s"] > 0
    assert rows["nvdcp"]["commit check s"] is not None
    loads = [r for r in payload["records"] if r["side"] == "load"]
    assert len(loads) == 2 and all(r["read_items"] == 20 + 7 + 12 for r in loads)
    (dcp,) = [r for r in payload["records"] if r["side"] == "dcp"]
    assert dcp["validated"] and dcp["seconds"]["dcp_validate_global_plan"] >= 0
    assert not (tmp_path / "sim" / "nvdcp_6").exists()  # the simulated checkpoints are removed

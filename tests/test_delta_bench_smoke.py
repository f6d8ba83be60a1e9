"""benchmarks/delta_bench.py at a tiny size: every writer and chain runs, loads are bit-exact, the
tables, targets and JSON come out. Nothing here depends on timings."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import nvdcp
from benchmarks import delta_bench, delta_save_items


def test_runs_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = delta_bench.main([
        "--device", "cpu", "--small", "--intervals", "2,10", "--checkpoints", "4", "--keep", "3", "--ks", "2,3",
        "--against", "previous,full", "--warm-steps", "2", "--stock-saves", "2", "--verify-all", "--root", str(tmp_path / "ckpt"),
        "--out", str(tmp_path), "--suffix", "_smoke",
    ])
    out = capsys.readouterr().out
    assert "Issue 15 targets" in out and "all timed loads bit-exact: True" in out
    assert target.name.startswith("delta_bench_") and target.name.endswith("_smoke.json")
    payload = json.loads(target.read_text())
    assert {"date", "machine", "command"} <= payload.keys()
    assert payload["all_bit_exact"] and payload["workload"]["steps"] == 2 + 10 * 3
    assert [(c["variant"], c["interval"]) for c in payload["combos"]] == [
        ("fp32_adamw", 2), ("fp32_adamw", 10), ("bf16_weights", 2), ("bf16_weights", 10)]
    for combo in payload["combos"]:
        rows = {r["writer"]: r for r in combo["rows"]}
        assert rows.keys() == {"stock", "nvdcp", "delta K=2", "delta K=3", "delta-full K=2", "delta-full K=3"}
        assert rows["stock"]["saves"] == 2 and rows["nvdcp"]["saves"] == 4
        # K=2: whole, delta, whole, delta; K=3: whole, delta, delta, whole
        assert (rows["delta K=2"]["whole"], rows["delta K=2"]["deltas"]) == (2, 2)
        assert (rows["delta K=3"]["whole"], rows["delta K=3"]["deltas"]) == (2, 2)
        chains = {c["writer"]: c for c in combo["chains"]}
        assert [c["depth"] for c in chains["delta K=3"]["checkpoints"]] == [0, 1, 2, 0]
        assert [c["depth"] for c in chains["delta-full K=3"]["checkpoints"]] == [0, 1, 1, 0]
        # keeping the last 3 of K=3 keeps the whole save its first kept delta needs
        assert rows["delta K=3"]["last3_kept"] == 4 and rows["nvdcp"]["last3_kept"] == 3
        assert rows["delta K=3"]["deep_depth"] == 2
        for row in rows.values():
            assert row["bit_exact"] and row["ratio_all"] > 0
        for chain in combo["chains"]:
            assert all(ld["bit_exact"] for ld in chain["loads"])
        assert rows["delta K=2"]["cache_MiB"] > 0  # the policy kept the last save on the host
    # issue 15's ratio targets exist for interval 10 only; save and load targets for every chain
    ratio_checks = [t for t in payload["targets"] if t["target"].startswith("ratio_")]
    assert ratio_checks and {t["interval"] for t in ratio_checks} == {10}
    assert {t["interval"] for t in payload["targets"] if "save" in t["target"]} == {2, 10}
    assert not (tmp_path / "ckpt" / "fp32_adamw_every2").exists()  # chains are removed once measured


def test_delta_writers_chunk_size_flag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--delta-chunk-kib`` reaches the writers with a policy and only them; the chain still
    loads bit-exact. (What chunk size a record then has: tests/dcp/test_delta.py.)"""
    seen: dict[str, set[int]] = {}
    real_save = delta_bench.save_one

    def spy(state: Any, path: str, writer: Any, device: str) -> Any:
        if isinstance(writer, nvdcp.NvcompWriter):
            seen.setdefault("delta" if writer.delta is not None else "full", set()).add(writer.chunk_bytes)
        return real_save(state, path, writer, device)

    monkeypatch.setattr(delta_bench, "save_one", spy)
    target = delta_bench.main([
        "--device", "cpu", "--small", "--intervals", "2", "--checkpoints", "3", "--keep", "2", "--ks", "2",
        "--variants", "fp32_adamw", "--warm-steps", "2", "--stock-saves", "1", "--delta-chunk-kib", "16",
        "--root", str(tmp_path / "ckpt"), "--out", str(tmp_path), "--suffix", "_chunks",
    ])
    payload = json.loads(target.read_text())
    assert payload["all_bit_exact"] and payload["args"]["delta_chunk_kib"] == 16
    assert seen == {"delta": {16 << 10}, "full": {64 << 10}}


def test_delta_resume_runs_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/delta_resume.py at a tiny size: its three cases run, the resumed save loads
    bit-exact, the JSON comes out."""
    from benchmarks import delta_resume

    assert delta_resume.main(["--items", "20", "--repeats", "1", "--dir", str(tmp_path / "ckpt"),
                              "--out", str(tmp_path)]) == 0
    assert "bit-exact: True" in capsys.readouterr().out
    payload = json.loads(next(tmp_path.glob("delta_resume_*.json")).read_text())
    assert {"date", "machine", "command"} <= payload.keys() and payload["bit_exact"]
    assert [r["case"] for r in payload["results"]] == [
        "resumed delta save (bases read back)", "delta save (bases in the host cache)", "full save"]


def test_delta_probe_runs_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/delta_probe.py at a tiny size: both variants' chains save and load bit-exact,
    the JSON comes out with every timing."""
    from benchmarks import delta_probe

    target = delta_probe.main(["--device", "cpu", "--root", str(tmp_path / "ckpt"), "--saves", "4", "--loads", "2",
                               "--tensors", "3", "--rows", "16", "--out", str(tmp_path), "--suffix", "_smoke"])
    assert "bit-exact True" in capsys.readouterr().out
    payload = json.loads(target.read_text())
    assert {"date", "machine", "command"} <= payload.keys()
    assert [row["variant"] for row in payload["rows"]] == ["bf16", "fp32"]
    for row in payload["rows"]:
        assert row["bit_exact"] and len(row["seconds"]["delta_save"]) == 3 and len(row["seconds"]["d3_load"]) == 2
        assert 0 < row["bytes"]["p1"] and 0 < row["bytes"]["f1"]
    assert not (tmp_path / "ckpt" / "bf16").exists()


def test_delta_save_items_runs_end_to_end(tmp_path: Path) -> None:
    assert delta_save_items.main(["--items", "30,60", "--saves", "3", "--dir", str(tmp_path / "ckpt"),
                                  "--out", str(tmp_path), "--suffix", "_smoke"]) == 0
    payload = json.loads(next(tmp_path.glob("delta_save_items_*_smoke.json")).read_text())
    assert {"date", "machine", "command"} <= payload.keys()
    assert [r["items"] for r in payload["rows"]] == [30, 60]
    for row in payload["rows"]:
        assert len(row["full_saves_s"]) == len(row["delta_saves_s"]) == 3
        assert len(row["base_checks_s"]) == 2  # a base check per delta save but the first (no base yet)


def test_delta_save_ab_runs_on_the_cpu_with_a_switch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/delta_save_ab.py at a tiny size on the CPU: both settings of a switch, loads
    checked bit-exact (it exits otherwise), large items joined, one row per variant and setting."""
    import os

    from benchmarks import delta_save_ab

    delta_save_ab.main(["--device", "cpu", "--loads", "--rounds", "2", "--train=--small", "--large-items",
                        "--switch", "NVDCP_SMOKE_SWITCH", "--root", str(tmp_path / "ckpt"), "--out", str(tmp_path),
                        "--suffix", "_smoke"])
    assert "NVDCP_SMOKE_SWITCH" not in os.environ
    out = capsys.readouterr().out
    assert out.count("[1] ") == out.count("[0] ") == 2
    (target,) = tmp_path.glob("delta_save_ab_*_smoke.json")
    payload = json.loads(target.read_text())
    assert payload["device"] == "cpu" and payload["large_items"] and payload["switch"] == "NVDCP_SMOKE_SWITCH"
    rows = payload["rows"]
    assert [(r["variant"], r["setting"]) for r in rows] == [
        ("fp32_adamw", "1"), ("fp32_adamw", "0"), ("bf16_weights", "1"), ("bf16_weights", "0")]
    for r in rows:
        assert len(r["seconds"]["delta_load"]) == 1 and r["stored_bytes"]["delta"] < r["stored_bytes"]["full"]

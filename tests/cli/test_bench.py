"""``nvdcp bench`` and ``python -m benchmarks.codec_bench``, smoke-run at tiny sizes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.conftest import REPO, _env, cli, invoke

TINY = ["--steps", "1", "--d-model", "32", "--layers", "1"]
PNG = b"\x89PNG\r\n\x1a\n"


def test_reference_workload_json_and_plot(tmp_path: Path) -> None:
    chart = tmp_path / "bench.png"
    ran = cli("bench", *TINY, "--codec", "none", "--codec", "zstd", "--no-gpu", "--json", "--plot", chart)
    assert ran.exit_code == 0, ran.stderr
    doc = ran.json()
    assert doc["schema"] == "nvdcp.codec_bench/1" and doc["source"]["steps"] == 1
    rows = {(r["codec"], r["device"], r["dtype"]): r for r in doc["results"]}
    assert set(rows) == {(c, "cpu", d) for c in ("none", "zstd") for d in ("float32", "bfloat16")}
    for r in rows.values():
        assert r["raw_bytes"] > 0 and r["encode_gbps"] > 0 and r["decode_gbps"] > 0
    assert rows[("zstd", "cpu", "bfloat16")]["ratio"] > 1.1  # the bf16 exponent plane compresses
    assert 0.95 < rows[("none", "cpu", "float32")]["ratio"] <= 1.0
    assert {(t["codec"], t["dtype"]) for t in doc["totals"]} == {("none", "all"), ("zstd", "all")}
    assert doc["plot"] == str(chart) and chart.read_bytes().startswith(PNG)


def test_checkpoint_table(ckpts: dict[str, Path]) -> None:
    ran = invoke("bench", ckpts["nvdcp"], "--codec", "zstd", "--codec", "gdeflate", "--no-gpu")
    assert ran.exit_code == 0, ran.stderr
    for needle in ("codec bench", "zstd", "gdeflate", "float32", "int64", "bool", "bfloat16", "all", "GB/s"):
        assert needle in ran.stdout, needle
    doc = invoke("bench", ckpts["stock"], "--codec", "zstd", "--no-gpu", "--json").json()
    by_dtype = {r["dtype"]: r for r in doc["results"]}
    assert by_dtype["int64"]["ratio"] > 10 and by_dtype["float32"]["items"] == 3  # embed, empty, scale


def test_bad_arguments(tmp_path: Path) -> None:
    ran = invoke("bench", "--codec", "lz4")
    assert ran.exit_code == 2 and "'lz4' is not one of" in ran.stderr
    ran = invoke("bench", tmp_path / "missing", "--codec", "none")
    assert ran.exit_code == 3 and "no committed checkpoint" in ran.stderr
    ran = invoke("bench", *TINY, "--gpu", "--codec", "none")
    if ran.exit_code != 0:  # no usable GPU here
        assert ran.exit_code == 3 and "needs CUDA" in ran.stderr


def test_gpu_only_codecs_are_skipped_without_a_gpu(ckpts: dict[str, Path]) -> None:
    from nvdcp.gpu import gpu_available

    if gpu_available():
        pytest.skip("this machine runs the GPU codecs")
    ran = invoke("bench", ckpts["nvdcp"], "--codec", "ans", "--json")
    assert ran.exit_code == 0
    assert ran.json()["results"] == [] and "ans@cuda" in ran.json()["skipped"]


def test_benchmark_script_smoke(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.codec_bench", *TINY, "--codec", "zstd", "--no-bf16", "--out", str(tmp_path)],
        check=False, capture_output=True, text=True, env=_env(), cwd=REPO, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    [result] = tmp_path.glob("codec_bench_*.json")
    doc = json.loads(result.read_text())
    assert doc["schema"] == "nvdcp.codec_bench/1" and doc["results"][0]["codec"] == "zstd"
    assert result.with_suffix(".png").read_bytes().startswith(PNG)
    assert "| zstd |" in proc.stdout


def test_slow_speeds_are_not_rounded_to_zero() -> None:
    """A codec timed on a few KiB can run at micro-GB/s: the JSON keeps four significant digits
    (four decimals made it 0.0, which `nvdcp bench` users and the GPU test read as missing)."""
    from nvdcp.codec_bench import Row

    row = Row("gdeflate", "cpu", "float32", items=1, raw_bytes=3000, stored_bytes=1000, encode_s=0.05, decode_s=0.5)
    d = row.as_dict()
    assert d["encode_gbps"] == 6e-05 and d["decode_gbps"] == 6e-06 and d["ratio"] == 3.0
    assert Row("zstd", "cpu", "float32", raw_bytes=10**10, encode_s=0.7, decode_s=0.0).as_dict()["encode_gbps"] == 14.29

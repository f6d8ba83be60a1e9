"""benchmarks/thread_sizing_probe.py at a tiny size: every pool size runs and is recorded."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import thread_sizing_probe
from nvdcp.cores import usable_cores


def test_sizes_recorded(tmp_path: Path) -> None:
    thread_sizing_probe.main(["--items", "200", "--rounds", "1", "--sizes", "1,2", "--out", str(tmp_path)])
    (result,) = tmp_path.glob("thread_sizing_probe_*.json")
    payload = json.loads(result.read_text())
    assert {"date", "machine", "command"} <= payload.keys()
    assert [row["threads"] for row in payload["rows"]] == [usable_cores(), 2 * usable_cores()]
    assert payload["rows"][0]["vs_usable"] == 1.0 and all(row["median_s"] > 0 for row in payload["rows"])

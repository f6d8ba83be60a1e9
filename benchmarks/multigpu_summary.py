"""Summarize benchmarks/multigpu_run.sh: save/load times by GPU count, resharded resume check.

    python -m benchmarks.multigpu_summary OUT_DIR [--device "2x NVIDIA H200 (nvidia-h200-x2)"] [--write DIR]
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.common import markdown_table, write_results


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("logs")
    ap.add_argument("--device", default=None, help="the machine the logs came from, when summarizing elsewhere")
    ap.add_argument("--write", default=None, help="directory for the JSON (default: the logs directory)")
    args = ap.parse_args()
    out = Path(args.logs)
    rows, checks = [], []
    for log in sorted(out.glob("mg_*.jsonl")):
        records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        saved = {r["step"]: r["digest"] for r in records if r.get("event") == "save"}
        for r in records:
            if r.get("event") == "compare":
                rows.append({"gpus": r["world"], "step": r["step"],
                             "nvdcp_GB": round(r["nvdcp_bytes"] / 1e9, 3),
                             "bytes_ratio_vs_stock": round(r["stock_bytes"] / r["nvdcp_bytes"], 3),
                             "nvdcp_save_s": round(r["nvdcp_save_s"], 3), "stock_save_s": round(r["stock_save_s"], 3),
                             "nvdcp_load_s": round(r["nvdcp_load_s"], 3), "stock_load_s": round(r["stock_load_s"], 3)})
            if r.get("event") == "load":
                checks.append({"log": log.name, "step": r["step"], "loaded_on": r["world"],
                               "bit_identical_to_saved": saved.get(r["step"]) == r["digest"]})
    print(markdown_table(rows, list(rows[0]) if rows else ["gpus"]))
    print(json.dumps(checks, indent=1))
    payload = {"rows": rows, "resume_checks": checks}
    if args.device:
        payload["device"] = args.device
    write_results("multigpu", payload, args.write or out)


if __name__ == "__main__":
    main()

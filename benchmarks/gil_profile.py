"""Who holds the GIL during a save: py-spy's ``--gil`` samples of nvdcp saves, by stage.

    python -m benchmarks.gil_profile [--case small_model] [--saves 4] [--dir /dev/shm/gil] [--rate 200]

A save of many small tensors is bound by the GIL, not by the cores: on the CPU machine some
thread holds it for nearly all of a 20,000-tensor save. This runs ``--saves`` nvdcp saves of a
``cpu_pipeline_bench`` workload (after an untimed first one) under ``py-spy record --gil
--threads`` (samples only where a thread holds the GIL) and sums the GIL-held seconds per save
by stage: DCP's own planning, the encoder's batch work on the codec threads, the data files'
threads, ``write_data`` on the caller's thread, ``finish``; then the heaviest nvdcp functions
(self time: the deepest nvdcp frame). Native calls that release the GIL (codecs, checksums,
writes) do not appear. Needs ``py-spy`` (``pip install py-spy``). Writes
``benchmarks/results/gil_profile_<date>.json``.
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import write_results

#: Stages, the first that matches a sample's stack wins (frames joined by ";").
STAGES = (
    ("finish", ("NvcompWriter.finish",)),
    ("write_data (caller's thread)", ("NvcompWriter.write_data",)),
    ("encoder (codec threads)", ("nvdcp/pipeline/",)),
    ("data files' threads", ("nvdcp/dcp/writer.py", "nvdcp/storage/")),
    ("DCP planning", ("torch/distributed/checkpoint/",)),
)
_FRAME = re.compile(r"^(?P<fn>.*?) \((?P<file>[^():]+):\d+\)$")


def run_saves(case: str, saves: int, root: str) -> None:
    """The profiled process: builds the state and saves once (imports, pools), says ``ready``,
    waits for a line on stdin (py-spy attaching meanwhile), then times ``saves`` saves."""
    import torch.distributed.checkpoint as dcp

    import nvdcp
    from benchmarks.cpu_pipeline_bench import WORKLOADS

    state = WORKLOADS[case]()
    for i in range(saves + 1):
        if i == 1:
            print("ready", flush=True)
            sys.stdin.readline()
        path = tempfile.mkdtemp(dir=root)
        t0 = time.perf_counter()
        dcp.save(state, storage_writer=nvdcp.NvcompWriter(path, on_identical_save="ignore"))
        if i:
            print(f"save {i}: {time.perf_counter() - t0:.3f} s", flush=True)
        shutil.rmtree(path)


def profile_saves(args: argparse.Namespace, raw_path: Path) -> str:
    """Run the saves in a child with py-spy attached for them alone; returns the child's output."""
    child = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.gil_profile", "--child", "--case", args.case,
         "--saves", str(args.saves), "--dir", args.dir],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    assert child.stdin is not None and child.stdout is not None
    if child.stdout.readline().strip() != "ready":
        child.kill()
        sys.exit("the profiled process did not start")
    spy = subprocess.Popen(["py-spy", "record", "--gil", "--threads", "-r", str(args.rate), "-f", "raw",
                            "-o", str(raw_path), "--pid", str(child.pid)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # py-spy attaches
    child.stdin.write("go\n")
    child.stdin.flush()
    out = child.stdout.read()
    child.wait()
    spy.wait(timeout=60)
    return out


def stage_of(stack: str) -> str | None:
    for name, marks in STAGES:
        if any(mark in stack for mark in marks):
            return name
    return None


def summarize(raw: str, saves: int, rate: int) -> dict[str, Any]:
    """GIL-held seconds per save by stage and by nvdcp function, from py-spy's raw output."""
    stages: collections.Counter[str] = collections.Counter()
    functions: collections.Counter[str] = collections.Counter()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        stage = stage_of(stack)
        if stage is None:
            continue
        stages[stage] += n
        own = [m for f in stack.split(";") if (m := _FRAME.match(f.strip())) and "nvdcp/" in f]
        if own:
            functions[f"{own[-1]['fn']} ({own[-1]['file'].split('nvdcp/', 1)[-1]})"] += n
    per_save = saves * rate
    return {
        "gil_s_per_save": round(sum(stages.values()) / per_save, 3),
        "stages": {k: round(v / per_save, 3) for k, v in stages.most_common()},
        "nvdcp_functions": {k: round(v / per_save, 3) for k, v in functions.most_common(25)},
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", default="small_model")
    ap.add_argument("--saves", type=int, default=4)
    ap.add_argument("--dir", default="/dev/shm/nvdcp-gil")
    ap.add_argument("--rate", type=int, default=200, help="samples a second")
    ap.add_argument("--out", default=None)
    ap.add_argument("--suffix", default="")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    if args.child:
        run_saves(args.case, args.saves, args.dir)
        return
    if shutil.which("py-spy") is None:
        sys.exit("gil_profile needs py-spy on PATH (pip install py-spy)")
    with tempfile.TemporaryDirectory() as tmp:
        raw_path = Path(tmp) / "gil.txt"
        out = profile_saves(args, raw_path)
        walls = [float(m) for m in re.findall(r"save \d+: ([\d.]+) s", out)]
        summary = summarize(raw_path.read_text(), args.saves, args.rate)
    summary["wall_s_per_save"] = round(sum(walls) / len(walls), 3) if walls else None
    print(f"{args.case}: {summary['wall_s_per_save']} s a save, the GIL held {summary['gil_s_per_save']} s of it")
    for name, secs in summary["stages"].items():
        print(f"  {secs:6.3f} s  {name}")
    print("heaviest nvdcp functions (self):")
    for name, secs in list(summary["nvdcp_functions"].items())[:12]:
        print(f"  {secs:6.3f} s  {name}")
    target = write_results("gil_profile", {"case": args.case, "saves": args.saves, "rate": args.rate, **summary},
                           args.out, args.suffix)
    print(f"-> {target}")


if __name__ == "__main__":
    main()

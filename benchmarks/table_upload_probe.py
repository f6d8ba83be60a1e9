"""What one upload of a small int64 table costs the thread that queues it (issue 18: a GPU
save's own cost per item; the split kernel's table goes up once per plane count per bucket).

    python -m benchmarks.table_upload_probe [--rows 2000] [--calls 400] [--out DIR] [--suffix S]

Variants, each a host-side time per call (the copy itself is queued, not awaited):
``pin_to``: ``torch.from_numpy(t).pin_memory().to(dev, non_blocking=True)`` (nvdcp's code);
``ring``: numpy copy into one of a few reused pinned buffers, then ``.to(dev, non_blocking=True)``
after the buffer's last copy is known done (an event per buffer); ``pageable``:
``torch.from_numpy(t).to(dev, non_blocking=True)`` (waits for the stream). Each runs with the
GIL idle and with a second thread running Python (the file threads of a save), at the
interpreter's 5 ms switch interval and at 0.5 ms (nvdcp's setting during a GPU save).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from typing import Any

import numpy as np
import torch

from benchmarks.common import write_results


class _Ring:
    """A few pinned buffers reused in turn; a buffer is written again once its copy is done."""

    def __init__(self, nbytes: int, count: int = 4) -> None:
        self.bufs = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(count)]
        self.events: list[torch.cuda.Event | None] = [None] * count
        self.i = 0

    def upload(self, table: np.ndarray, device: torch.device) -> torch.Tensor:
        i, self.i = self.i, (self.i + 1) % len(self.bufs)
        if self.events[i] is not None:
            self.events[i].synchronize()  # type: ignore[union-attr]
        host = self.bufs[i][: table.nbytes].view(torch.int64).view(table.shape)
        host.numpy()[...] = table
        out = host.to(device, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        self.events[i] = ev
        return out


def _busy(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        for i in range(1000):
            x += i


def measure(variant: str, rows: int, calls: int, contended: bool, interval: float) -> float:
    device = torch.device("cuda")
    tables = [np.random.randint(0, 1 << 40, size=(rows + i % 7, 6), dtype=np.int64) for i in range(16)]
    ring = _Ring(tables[0].nbytes * 2)
    old = sys.getswitchinterval()
    sys.setswitchinterval(interval)
    stop = threading.Event()
    worker = threading.Thread(target=_busy, args=(stop,), daemon=True)
    if contended:
        worker.start()
    try:
        times = []
        for k in range(calls):
            t = tables[k % len(tables)]
            t0 = time.perf_counter()
            if variant == "pin_to":
                torch.from_numpy(t).pin_memory().to(device, non_blocking=True)
            elif variant == "ring":
                ring.upload(t, device)
            else:
                torch.from_numpy(t).to(device, non_blocking=True)
            times.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
    finally:
        stop.set()
        if contended:
            worker.join()
        sys.setswitchinterval(old)
    return statistics.median(times[calls // 10 :])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=2000)
    p.add_argument("--calls", type=int, default=400)
    p.add_argument("--out", default=None)
    p.add_argument("--suffix", default="")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("table_upload_probe needs a CUDA GPU", file=sys.stderr)
        return 2
    rows: list[dict[str, Any]] = []
    for interval in (0.005, 0.0005):
        for contended in (False, True):
            for variant in ("pin_to", "ring", "pageable"):
                us = measure(variant, args.rows, args.calls, contended, interval) * 1e6
                rows.append({"variant": variant, "contended": contended, "switch_interval_s": interval,
                             "median_us_per_call": round(us, 1)})
                print(f"{variant:9s} contended={contended!s:5s} interval={interval * 1e3:.1f} ms: {us:8.1f} us", flush=True)
    print(f"wrote {write_results('table_upload_probe', {'rows_per_table': args.rows, 'results': rows}, args.out, args.suffix)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

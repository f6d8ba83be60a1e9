"""What the save digests cost (issue 17 part 3): save time and ``.metadata`` size, digests on vs off.

    python -m benchmarks.digest_cost [--steps 10] [--repeats 21] [--dir /tmp/nvdcp-digest-cost]

1. The CPU reference workload (nvdcp/demo/workload.py ``train_state``: the byte-level GPT at CPU
   size trained a few steps with AdamW; fp32 params + both moments) saved ``--repeats`` times with
   digests on and off (``NvcompWriter._record_digests``), interleaved on/off/off/on so drift hits
   both; one element changes between saves, so every save takes the stale check's normal path.
   Reports median save seconds and ``.metadata`` bytes of each, and, since a difference of a few
   hundred microseconds drowns in a shared machine's noise, the digest's own steps timed one by
   one on that checkpoint (records in write_data, finish's split, the stale check, the extra
   pickling) and their sum as a share of the median save.
2. The coordinator's side at scale, without data: ``finish``'s split of 1,000 and 100,000
   gathered ``WriteResult`` records with digests against the dict it built before digests, the
   stale check, the pickled size of the gathered results, and the pickled
   ``.metadata`` size of synthetic 1,000- and 100,000-item checkpoints (one chunk per tensor, and
   8 shards per tensor) with and without the digest record.

Writes benchmarks/results/digest_cost_<date>.json and prints markdown tables.
"""

from __future__ import annotations

import argparse
import os
import pickle
import random
import statistics
import time
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.storage import WriteResult

import nvdcp
from benchmarks.common import fresh_dir, markdown_table, write_results
from benchmarks.workload import tensor_bytes, train_state
from nvdcp.dcp import descriptor
from nvdcp.dcp.commit import HISTORY, ItemRecord, check_identical_save, split_results
from nvdcp.demo.model import GPTConfig
from nvdcp.format.digest import DIGEST_ATTR, digest_record


def _first_tensor(state: Any) -> torch.Tensor:
    if isinstance(state, torch.Tensor) and state.numel():
        return state
    if isinstance(state, dict):
        for v in state.values():
            t = _first_tensor(v)
            if t is not None:
                return t
    return None  # type: ignore[return-value]


def save_times(state: Any, root: str, repeats: int) -> dict[str, Any]:
    """``repeats`` pairs of saves, one with digests and one without, the order alternating; wall
    and CPU seconds (this process, all threads: what digests would add is CPU work, and CPU time
    is less disturbed by other processes on a shared machine than wall time)."""
    touch = _first_tensor(state["model"])
    wall: dict[str, list[float]] = {"on": [], "off": []}
    cpu: dict[str, list[float]] = {"on": [], "off": []}
    sizes: dict[str, int] = {}
    items = 0
    order = []
    for r in range(repeats):
        order += ["on", "off"] if r % 2 == 0 else ["off", "on"]
    for i, mode in enumerate(["on", "off"] + order):  # one warm-up save of each first (codec pools)
        touch.view(-1)[0] += 1e-3  # a real update between saves
        path = fresh_dir(os.path.join(root, mode))
        writer = nvdcp.NvcompWriter(path)
        writer._record_digests = mode == "on"
        c0, t0 = time.process_time(), time.perf_counter()
        dcp.save(state, storage_writer=writer)
        seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
        if i >= 2:
            wall[mode].append(seconds)
            cpu[mode].append(cpu_seconds)
        sizes[mode] = os.path.getsize(os.path.join(path, ".metadata"))
        with open(os.path.join(path, ".metadata"), "rb") as f:
            md = pickle.load(f)
        items = len(md.storage_data)
        assert hasattr(md, DIGEST_ATTR) == (mode == "on")

    def summary(times: dict[str, list[float]]) -> dict[str, Any]:
        on, off = statistics.median(times["on"]), statistics.median(times["off"])
        paired = statistics.median(a - b for a, b in zip(times["on"], times["off"]))  # neighbours in time
        return {"median_on": round(on, 4), "median_off": round(off, 4), "delta_pct": round(100 * (on - off) / off, 2),
                "paired_median_delta_s": round(paired, 5), "paired_delta_pct": round(100 * paired / off, 2),
                "all": {k: [round(x, 4) for x in v] for k, v in times.items()}}

    return {
        "items": items, "raw_bytes": tensor_bytes(state), "repeats": repeats,
        "wall_s": summary(wall), "cpu_s": summary(cpu),
        "metadata_bytes": sizes, "metadata_delta_pct": round(100 * (sizes["on"] - sizes["off"]) / sizes["off"], 2),
    }


def direct_overhead(path: str, repeats: int = 50) -> dict[str, Any]:
    """The work digests add to one save of the checkpoint at ``path``, each step timed alone (best
    of ``repeats``): too small to see in the save's wall time on a shared machine."""
    from torch.distributed.checkpoint.storage import WriteResult

    from nvdcp.format.digest import digest_of_record_header, read_digests

    with open(os.path.join(path, ".metadata"), "rb") as f:
        md = pickle.load(f)
    digests = read_digests(md).by_index
    assert digests is not None
    infos = list(md.storage_data.items())
    header = b"\x00" * 60 + (1234).to_bytes(4, "little")
    records = [[WriteResult(ix, info.length, ItemRecord(info, digests[ix])) for ix, info in infos]]
    plain = [[WriteResult(ix, info.length, info) for ix, info in infos]]

    def per_item_on() -> None:  # write_data: the digest from the header, one record per item
        for _, info in infos:
            ItemRecord(info, digest_of_record_header(header))

    storage_md, packed = split_results(records)
    assert packed is not None
    HISTORY.clear()
    HISTORY.remember("x", "0", bytes(len(packed)))
    steps = {
        "write_data_records": _best(per_item_on, repeats),
        "finish_split_on": _best(lambda: split_results(records), repeats),
        "finish_split_off": _best(lambda: {wr.index: wr.storage_data for rank in plain for wr in rank}, repeats),
        "stale_check": _best(lambda: check_identical_save("y", packed, "warn"), repeats),
    }
    HISTORY.clear()
    md.storage_data = storage_md
    vars(md).pop(DIGEST_ATTR, None)
    steps["pickle_off"] = _best(lambda: pickle.dumps(md, protocol=pickle.HIGHEST_PROTOCOL), repeats)
    setattr(md, DIGEST_ATTR, digest_record(packed))
    steps["pickle_on"] = _best(lambda: pickle.dumps(md, protocol=pickle.HIGHEST_PROTOCOL), repeats)
    with_record = len(pickle.dumps(md, protocol=pickle.HIGHEST_PROTOCOL))
    setattr(md, DIGEST_ATTR, dict(zip(storage_md, (digests[ix] for ix in storage_md))))
    keyed = len(pickle.dumps(md, protocol=pickle.HIGHEST_PROTOCOL))
    vars(md).pop(DIGEST_ATTR)
    without = len(pickle.dumps(md, protocol=pickle.HIGHEST_PROTOCOL))
    sizes = {"metadata_off": without, "metadata_on": with_record, "metadata_keyed_dict": keyed,
             "keyed_dict_delta_pct": round(100 * (keyed - without) / without, 2)}
    added = (steps["write_data_records"] + steps["finish_split_on"] - steps["finish_split_off"] + steps["stale_check"]
             + steps["pickle_on"] - steps["pickle_off"])
    return {"steps_s": {k: round(v, 7) for k, v in steps.items()}, "added_s": round(added, 7), "pickled": sizes}


def synthetic_metadata(n_tensors: int, shards: int) -> tuple[Metadata, list[list[WriteResult]]]:
    """A checkpoint's metadata as DCP builds it (names like a transformer's), and what ``shards``
    ranks' ``write_data`` would return for it."""
    sdm: dict[str, Any] = {}
    results: list[list[WriteResult]] = [[] for _ in range(shards)]
    rng = random.Random(0)
    for i in range(n_tensors):
        fqn = f"model.layers.{i // 8}.block.mlp_{i % 8}.weight"
        chunks = [ChunkStorageMetadata(torch.Size([s * 64, 0]), torch.Size([64, 1024])) for s in range(shards)]
        sdm[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([64 * shards, 1024]), chunks)
        for s in range(shards):
            info = descriptor.storage_info(f"__{s}_0123456789ab_0.nvdcp", i * 200_000, 190_000 + i % 997, "zstd")
            results[s].append(WriteResult(MetadataIndex(fqn, [s * 64, 0]), 190_000, ItemRecord(info, rng.getrandbits(32))))
    return Metadata(sdm, planner_data={k: (k,) for k in sdm}), results


def _best(fn: Any, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def coordinator_costs(items: list[int]) -> list[dict[str, Any]]:
    rows = []
    for n in items:
        for shards in (1, 8):
            md, results = synthetic_metadata(n // shards, shards)
            plain = [[WriteResult(wr.index, wr.size_in_bytes, wr.storage_data.info) for wr in rr] for rr in results]
            split_off = _best(lambda: {wr.index: wr.storage_data for rank in plain for wr in rank})  # noqa: B023
            split_on = _best(lambda: split_results(results))  # noqa: B023
            storage_md, digests = split_results(results)
            assert digests is not None
            HISTORY.clear()
            HISTORY.remember("synthetic", "0", bytes(len(digests)))
            check = _best(lambda: check_identical_save("synthetic", digests, "warn"))  # noqa: B023
            HISTORY.clear()
            md.storage_data = storage_md
            off = len(pickle.dumps(md, protocol=pickle.HIGHEST_PROTOCOL))
            setattr(md, DIGEST_ATTR, digest_record(digests))
            on = len(pickle.dumps(md, protocol=pickle.HIGHEST_PROTOCOL))
            as_dict = dict(zip(storage_md, (int(x) for x in memoryview(digests).cast("I"))))
            setattr(md, DIGEST_ATTR, as_dict)
            keyed = len(pickle.dumps(md, protocol=pickle.HIGHEST_PROTOCOL))
            # what a gathered rank's results cost on the wire (pickled WriteResult lists)
            wire_off = sum(len(pickle.dumps(rr, protocol=pickle.HIGHEST_PROTOCOL)) for rr in plain)
            wire_on = sum(len(pickle.dumps(rr, protocol=pickle.HIGHEST_PROTOCOL)) for rr in results)
            rows.append({
                "items": n, "shards_per_tensor": shards,
                "split_off_s": round(split_off, 6), "split_on_s": round(split_on, 6),
                "stale_check_s": round(check, 6),
                "metadata_off": off, "metadata_on": on, "metadata_delta_pct": round(100 * (on - off) / off, 2),
                "metadata_keyed_dict": keyed, "keyed_dict_delta_pct": round(100 * (keyed - off) / off, 2),
                "gathered_results_off": wire_off, "gathered_results_on": wire_on,
            })
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--dir", default="/tmp/nvdcp-digest-cost")
    ap.add_argument("--small", action="store_true", help="tiny model, 2 repeats, 1k items (smoke test)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg = GPTConfig(d_model=64, n_layers=1, n_heads=2, context=32) if args.small else GPTConfig()
    steps = 2 if args.small else args.steps
    repeats = 2 if args.small else args.repeats
    torch.set_num_threads(os.cpu_count() or 1)
    state, loss = train_state("cpu", cfg=cfg, steps=steps, batch=8)
    workload = save_times(state, args.dir, repeats)
    workload["direct"] = direct_overhead(os.path.join(args.dir, "on"))
    workload["direct"]["added_pct_of_save"] = round(
        100 * workload["direct"]["added_s"] / workload["wall_s"]["median_off"], 4)
    workload["workload"] = {"config": cfg.__dict__, "steps": steps, "final_loss": round(loss, 3)}
    print(f"reference workload: {workload['items']} items, {workload['raw_bytes']:,} bytes of tensors")
    print(markdown_table([
        {"digests": k, "median save s (wall)": workload["wall_s"][f"median_{k}"],
         "median save s (CPU)": workload["cpu_s"][f"median_{k}"], ".metadata bytes": workload["metadata_bytes"][k]}
        for k in ("off", "on")
    ], ["digests", "median save s (wall)", "median save s (CPU)", ".metadata bytes"]))
    print(f"{repeats} pairs: wall {workload['wall_s']['delta_pct']:+.2f}% (paired {workload['wall_s']['paired_delta_pct']:+.2f}%), "
          f"CPU {workload['cpu_s']['delta_pct']:+.2f}% (paired {workload['cpu_s']['paired_delta_pct']:+.2f}%), "
          f".metadata {workload['metadata_delta_pct']:+.2f}%")
    direct = workload["direct"]
    print(f"digest work timed step by step: {direct['added_s'] * 1e6:.0f} us per save = "
          f"{direct['added_pct_of_save']:.3f}% of the median save; {direct['steps_s']}\n")
    scale = coordinator_costs([1_000] if args.small else [1_000, 100_000])
    print(markdown_table(scale, ["items", "shards_per_tensor", "split_off_s", "split_on_s", "stale_check_s",
                                 "metadata_off", "metadata_on", "metadata_delta_pct", "keyed_dict_delta_pct"]))
    print("written", write_results("digest_cost", {"reference": workload, "coordinator": scale}, args.out))


if __name__ == "__main__":
    main()

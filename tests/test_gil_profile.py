"""benchmarks/gil_profile.py: py-spy's raw samples summed by save stage and nvdcp function.

py-spy itself is not a test dependency: the sums are checked on raw lines as py-spy writes them
(``--threads -f raw``: the thread, then frames outermost first, then the sample count)."""

from __future__ import annotations

from benchmarks.gil_profile import stage_of, summarize

_BOOT = "thread (1): nvdcp-codec_0;Thread._bootstrap (threading.py:1002);_worker (concurrent/futures/thread.py:83)"
_MAIN = "thread (2): MainThread;<module> (benchmarks/gil_profile.py:150);save (torch/distributed/checkpoint/state_dict_saver.py:196)"
RAW = "\n".join([
    f"{_BOOT};_run_batch (nvdcp/pipeline/encoder.py:600);_encode_planes (nvdcp/pipeline/cpu_batch.py:396);pack_headers_into (header_batch.py:94) 30",
    f"{_MAIN};local_step (torch/distributed/checkpoint/state_dict_saver.py:470);create_local_plan (torch/distributed/checkpoint/default_planner.py:120) 50",
    f"{_MAIN};write_data (torch/distributed/checkpoint/state_dict_saver.py:500);NvcompWriter.write_data (nvdcp/dcp/writer.py:398) 10",
    f"{_MAIN};finish_checkpoint (torch/distributed/checkpoint/state_dict_saver.py:509);NvcompWriter.finish (nvdcp/dcp/writer.py:470);dump_metadata (nvdcp/dcp/commit.py:207) 20",
    "thread (3): nvdcp-file_0;Thread._bootstrap (threading.py:1002);_FileWriter.run (nvdcp/dcp/writer.py:904) 10",
    "a line that is not a sample",
])


def test_samples_are_summed_by_stage_per_save() -> None:
    summary = summarize(RAW, saves=2, rate=10)  # 2 saves at 10 samples a second: a sample is 0.05 s
    assert summary["gil_s_per_save"] == 6.0
    assert summary["stages"] == {"DCP planning": 2.5, "encoder (codec threads)": 1.5, "finish": 1.0,
                                 "write_data (caller's thread)": 0.5, "data files' threads": 0.5}


def test_functions_are_named_by_their_deepest_nvdcp_frame() -> None:
    functions = summarize(RAW, saves=1, rate=100)["nvdcp_functions"]
    assert functions["_encode_planes (pipeline/cpu_batch.py)"] == 0.3  # header_batch.py has no nvdcp path
    assert functions["dump_metadata (dcp/commit.py)"] == 0.2
    assert "create_local_plan (torch/distributed/checkpoint/default_planner.py)" not in functions


def test_finish_is_told_from_the_planning_around_it() -> None:
    assert stage_of("save (torch/distributed/checkpoint/state_dict_saver.py:1);NvcompWriter.finish (x)") == "finish"
    assert stage_of("save (torch/distributed/checkpoint/state_dict_saver.py:1)") == "DCP planning"
    assert stage_of("gc_collect (gc.py:1)") is None

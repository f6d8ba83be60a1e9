"""DCP checkpoints on S3 (a moto server on loopback): bit-exact round trips, multi-rank and resharded,
uploads of many parts, faults injected by a proxy, a writer killed mid-save, and clear errors.

The multi-rank and fault tests also run against SeaweedFS (``any_s3env``), a server that verifies
upload checksums and enforces 5 MiB parts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import traceback
from typing import Any

import boto3
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import nvdcp
from nvdcp.storage.s3 import S3Storage
from tests._dist import run_ranks
from tests.conftest import bit_equal, random_tensor, weights_like
from tests.dcp.helpers import empty_like_sd, failure_of
from tests.s3.s3_testkit import (
    FAKE_SECRET,
    TEST_MIN_PART,
    FaultPlan,
    FaultProxy,
    S3Env,
    is_upload_part,
    moto_min_part_size,
)

pytestmark = pytest.mark.s3

P = TEST_MIN_PART
# Small parts so every data file is a multipart upload of several parts; quick retries.
OPTS: dict[str, Any] = dict(part_size=P, min_part_size=P, retry_backoff_s=0.01, retry_backoff_max_s=0.1)


@pytest.fixture(autouse=True)
def _small_parts_need_lowered_moto() -> None:
    if moto_min_part_size() > P:
        pytest.skip("moto was imported before S3_UPLOAD_PART_MIN_SIZE was set")


def _state() -> dict[str, Any]:
    return {
        "model": {"w": weights_like((256, 200)), "b16": weights_like((64, 100), torch.bfloat16, seed=1)},
        "ids": torch.arange(5000, dtype=torch.int64),
        "mask": random_tensor(torch.bool, (333,), seed=2),
        "f8": random_tensor(torch.float32, (50, 7), seed=3),  # every bit pattern, NaNs included
        "extra": {"step": 17, "note": "bytes item"},
    }


def _assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    for k, v in want.items():
        if isinstance(v, dict):
            _assert_same(got[k], v)
        elif isinstance(v, torch.Tensor):
            assert bit_equal(got[k], v), k
        else:
            assert got[k] == v, k


def _save(url: str, opts: dict[str, Any], sd: dict[str, Any] | None = None, **kw: Any) -> nvdcp.NvcompWriter:
    writer = nvdcp.NvcompWriter(url, storage_options=opts, **kw)
    dcp.save(sd if sd is not None else _state(), storage_writer=writer)
    return writer


def _opts(env: S3Env, **kw: Any) -> dict[str, Any]:
    """OPTS with the smallest parts ``env``'s server accepts."""
    return {**OPTS, "part_size": env.min_part, "min_part_size": env.min_part, **kw}


def _load(url: str, opts: dict[str, Any]) -> dict[str, Any]:
    sd = empty_like_sd(_state())
    dcp.load(sd, storage_reader=nvdcp.NvcompReader(url, storage_options=opts))
    return sd


def _no_secret(exc: BaseException) -> None:
    assert FAKE_SECRET not in "".join(traceback.format_exception(exc)) + repr(exc)


# -- round trips ---------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["boto3", "fsspec"])
def test_save_load_bit_exact(s3env: S3Env, backend: str) -> None:
    opts = dict(OPTS) if backend == "boto3" else {"backend": "fsspec", "endpoint_url": s3env.endpoint}
    url = s3env.url(f"runs/{backend}/step100")
    _save(url, opts, thread_count=2)
    keys = s3env.keys(f"runs/{backend}/step100/")
    assert keys[0].endswith("/.metadata") and sum(k.endswith(".nvdcp") for k in keys) == 2
    _assert_same(_load(url, opts), _state())
    assert s3env.uploads() == []
    # Saving again replaces the checkpoint and removes the first save's data files.
    changed = _state()
    changed["ids"] += 1
    _save(url, opts, changed, thread_count=2)
    new_keys = s3env.keys(f"runs/{backend}/step100/")
    assert len(new_keys) == len(keys) and set(new_keys) & set(keys) == {keys[0]}
    sd = empty_like_sd(_state())
    dcp.load(sd, storage_reader=nvdcp.NvcompReader(url, storage_options=opts))
    assert torch.equal(sd["ids"], changed["ids"])


@pytest.mark.parametrize("backend", ["boto3", "fsspec"])
@pytest.mark.parametrize("threads", [1, 2])
def test_batched_gpu_records_round_trip(s3env: S3Env, backend: str, threads: int) -> None:
    """GPU buckets reach the files as RecordBatches, written with one gather per share: over
    S3 streams that gather goes piece by piece into the multipart upload (no vectored calls)."""
    from tests.dcp.test_parallel_files import FakeGpu

    opts = dict(OPTS) if backend == "boto3" else {"backend": "fsspec", "endpoint_url": s3env.endpoint}
    url = s3env.url(f"gpu/{backend}/{threads}")
    sd = {f"g{i}": weights_like((200 + 37 * i, 64), seed=i).double() for i in range(10)}
    sd["w"] = weights_like((64, 33))
    enc = FakeGpu(per_bucket=3)
    try:
        dcp.save(sd, storage_writer=nvdcp.NvcompWriter(url, storage_options=opts, encoder=enc, thread_count=threads))
    finally:
        enc.close()
    assert all(b.released for b in enc.buckets) and enc.buckets
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(out, storage_reader=nvdcp.NvcompReader(url, storage_options=opts))
    _assert_same(out, sd)
    assert s3env.uploads() == []


def test_many_parts_checkpoint(s3env: S3Env) -> None:
    sd = {"big": random_tensor(torch.float32, (256, 1024), seed=5)}  # 1 MiB of incompressible bits
    with FaultProxy(s3env.endpoint) as proxy:
        opts = dict(OPTS, endpoint_url=proxy.endpoint, part_growth_every=8, max_inflight_parts=4)
        _save(s3env.url("parts"), opts, sd, codec="none")
        assert len(proxy.part_sizes) >= 12 and min(sorted(proxy.part_sizes)[1:]) >= P  # all but the last
        out = {"big": torch.zeros(256, 1024)}
        dcp.load(out, storage_reader=nvdcp.NvcompReader(s3env.url("parts"), storage_options=opts))
    assert bit_equal(out["big"], sd["big"])


def test_large_tensors_stream_to_s3_with_their_headers_filled_in_last(
    any_s3env: S3Env, monkeypatch: pytest.MonkeyPatch, tmp_path: Any,
) -> None:
    """A large host tensor's record goes up as it compresses, its header into room left at the
    record's start: the part under that room is kept back until the header is in. The object
    is byte for byte the data file a local save writes, and loads bit-exact."""
    from nvdcp.format.header import file_header_size
    from nvdcp.storage.s3 import _S3WriteStream

    s3env = any_s3env
    sd = {"big": weights_like((3 << 20,)), "bf16": weights_like((5 << 20,), torch.bfloat16, seed=4),
          "small": weights_like((100,), seed=5)}
    held: list[int] = []
    fill_in = _S3WriteStream.write_at

    def counting(self: _S3WriteStream, offset: int, data: Any) -> None:
        held.append(len(self._held))  # parts kept back for the room being filled
        fill_in(self, offset, data)

    monkeypatch.setattr(_S3WriteStream, "write_at", counting)
    url = s3env.url("streamed/step1")
    _save(url, _opts(s3env), sd, thread_count=1)
    assert len(held) == 2 and max(held) >= 1, held  # one header per large tensor, a part kept back
    assert s3env.uploads() == []
    out = empty_like_sd(sd)
    dcp.load(out, storage_reader=nvdcp.NvcompReader(url, storage_options=_opts(s3env)))
    _assert_same(out, sd)
    local = tmp_path / "local"
    dcp.save(sd, storage_writer=nvdcp.NvcompWriter(str(local), thread_count=1, on_identical_save="ignore"))
    (name,) = [p.name for p in local.iterdir() if p.name.endswith(".nvdcp")]
    (key,) = [k for k in s3env.keys("streamed/step1/") if k.endswith(".nvdcp")]
    got, want = s3env.client.get_object(Bucket=s3env.bucket, Key=key)["Body"].read(), (local / name).read_bytes()
    # the records after each file's header (which names its save and time)
    assert got[file_header_size(memoryview(got), key):] == want[file_header_size(memoryview(want), name):]


# -- several processes ---------------------------------------------------------------------------
def _full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {"w": torch.randn(96, 40, generator=g), "v": torch.randn(12, 30, generator=g).bfloat16()}


def _sharded(world: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,))
    full = _full()
    return {
        "w": distribute_tensor(full["w"], mesh, [Shard(0)]),
        "v": distribute_tensor(full["v"], mesh, [Shard(1)]),
    }


def _rank_save(rank: int, world: int, url: str, opts: dict[str, Any]) -> None:
    dcp.save(_sharded(world), storage_writer=nvdcp.NvcompWriter(url, storage_options=opts))


def _rank_load(rank: int, world: int, url: str, opts: dict[str, Any]) -> None:
    sd = _sharded(world)
    for t in sd.values():
        t.to_local().zero_()
    dcp.load(sd, storage_reader=nvdcp.NvcompReader(url, storage_options=opts))
    for k, v in _full().items():
        assert bit_equal(sd[k].full_tensor(), v), k
    dist.barrier()


@pytest.mark.timeout(180)
def test_two_rank_save_loads_resharded_on_three(any_s3env: S3Env) -> None:
    s3env = any_s3env
    url = s3env.url("dist/step1")
    opts = _opts(s3env, part_size=max(64 * 1024, s3env.min_part))
    run_ranks(2, _rank_save, url, opts)
    keys = s3env.keys("dist/step1/")
    assert "dist/step1/.metadata" in keys and sum(k.endswith(".nvdcp") for k in keys) == 2
    run_ranks(3, _rank_load, url, opts)
    assert s3env.uploads() == []


# -- faults --------------------------------------------------------------------------------------
def test_save_and_load_survive_injected_faults(any_s3env: S3Env) -> None:
    s3env = any_s3env
    plan = FaultPlan(every=4, kinds=("503", "reset", "500", "cut"), max_faults=16, seconds=60)
    with FaultProxy(s3env.endpoint, plan) as proxy:
        opts = _opts(s3env, endpoint_url=proxy.endpoint, max_attempts=4)
        url = s3env.url("flaky/step1")
        _save(url, opts, thread_count=2)
        _assert_same(_load(url, opts), _state())
        assert sum(proxy.faults.values()) >= 4, proxy.faults
    assert s3env.uploads() == []


def test_save_failing_for_good_leaves_no_metadata_and_no_upload(any_s3env: S3Env) -> None:
    s3env = any_s3env
    sd = _state()
    if s3env.min_part > P:  # parts of 5 MiB: a tensor that makes the data file three of them
        sd["big"] = random_tensor(torch.uint8, (2 * s3env.min_part + 4096,), seed=9)
    # Every UploadPart after the first fails with SlowDown: retries run out.
    plan = FaultPlan(every=1, kinds=("503",), match=lambda m, p: is_upload_part(m, p) and "partNumber=1&" not in p + "&")
    with FaultProxy(s3env.endpoint, plan) as proxy:
        opts = _opts(s3env, endpoint_url=proxy.endpoint, max_attempts=2, part_retries=1)
        url = s3env.url("broken/step1")
        with pytest.raises(CheckpointException) as info:
            _save(url, opts, sd, codec="none")
        assert sum(proxy.faults.values()) >= 2
    err = failure_of(info.value)
    assert isinstance(err, nvdcp.errors.StorageUnavailableError), err
    assert "s3://nvdcp-test/broken/step1/" in str(err) and "SlowDown" in str(err)
    _no_secret(err)
    assert not any(k.endswith(".metadata") for k in s3env.keys("broken/"))
    assert s3env.uploads() == []
    with pytest.raises(nvdcp.IncompleteCheckpointError, match="s3://nvdcp-test/broken/step1"):
        nvdcp.NvcompReader(url, storage_options=OPTS).read_metadata()


_KILLED_WRITER = """
import sys, torch, torch.distributed.checkpoint as dcp, nvdcp
url, endpoint, part = sys.argv[1], sys.argv[2], int(sys.argv[3])
g = torch.Generator().manual_seed(0)
sd = {"w": torch.randint(0, 256, (4 << 20,), dtype=torch.uint8, generator=g)}
opts = dict(endpoint_url=endpoint, part_size=part, min_part_size=part, max_inflight_parts=1, max_concurrency=1)
dcp.save(sd, storage_writer=nvdcp.NvcompWriter(url, codec="none", storage_options=opts))
print("finished")
"""


@pytest.mark.timeout(120)
def test_writer_killed_mid_save_leaves_nothing_loadable(s3env: S3Env) -> None:
    url = s3env.url("killed/step1")
    with FaultProxy(s3env.endpoint, FaultPlan(delay_s=0.05)) as proxy:
        child = subprocess.Popen(
            [sys.executable, "-c", _KILLED_WRITER, url, proxy.endpoint, str(P)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )
        try:
            deadline = time.monotonic() + 90
            while len(proxy.part_sizes) < 3 and child.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
            assert child.poll() is None, child.communicate()
            os.kill(child.pid, signal.SIGKILL)
        finally:
            child.kill()
            child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    assert not any(k.endswith(".metadata") for k in s3env.keys("killed/"))
    with pytest.raises(nvdcp.IncompleteCheckpointError, match="s3://nvdcp-test/killed/step1"):
        nvdcp.NvcompReader(url).read_metadata()
    # The data file's multipart upload stays open (invisible to readers) until cleaned up.
    store = S3Storage(url)
    assert len(store.incomplete_uploads()) == 1
    assert store.abort_incomplete_uploads() == 1 and s3env.uploads() == []


# -- errors --------------------------------------------------------------------------------------
def test_missing_bucket_is_named(s3env: S3Env) -> None:
    with pytest.raises(CheckpointException) as info:
        _save("s3://no-such-bucket/ckpt", OPTS)
    err = failure_of(info.value)
    assert isinstance(err, nvdcp.errors.BucketNotFoundError) and "s3://no-such-bucket/ckpt" in str(err)
    _no_secret(err)


def test_access_denied_is_named(s3env: S3Env, moto_s3: Any) -> None:
    iam = boto3.client("iam", endpoint_url=s3env.endpoint)
    iam.create_user(UserName="reader")
    key = iam.create_access_key(UserName="reader")["AccessKey"]
    creds = {"aws_access_key_id": key["AccessKeyId"], "aws_secret_access_key": key["SecretAccessKey"]}
    moto_s3.set_auth(0)
    try:
        with pytest.raises(CheckpointException) as info:
            _save(s3env.url("denied/step1"), dict(OPTS, **creds))
    finally:
        moto_s3.set_auth(None)
    err = failure_of(info.value)
    assert isinstance(err, nvdcp.errors.AccessDeniedError) and isinstance(err, PermissionError)
    assert "s3://nvdcp-test/denied/step1" in str(err)
    assert key["SecretAccessKey"] not in "".join(traceback.format_exception(err)) + repr(err)
    assert key["SecretAccessKey"] not in repr(nvdcp.NvcompWriter(s3env.url("x"), storage_options=creds).storage.config)


def test_missing_data_object_is_named(s3env: S3Env) -> None:
    url = s3env.url("holes/step1")
    _save(url, OPTS)
    victim = next(k for k in s3env.keys("holes/") if k.endswith(".nvdcp"))
    s3env.client.delete_object(Bucket=s3env.bucket, Key=victim)
    with pytest.raises(CheckpointException) as info:
        _load(url, OPTS)
    err = failure_of(info.value)
    assert isinstance(err, nvdcp.MissingDataFileError) and f"s3://nvdcp-test/{victim}" in str(err)
    _no_secret(err)


def test_empty_prefix_is_not_a_checkpoint(s3env: S3Env) -> None:
    with pytest.raises((CheckpointException, nvdcp.IncompleteCheckpointError)) as info:
        _load(s3env.url("nothing/here"), OPTS)
    err = failure_of(info.value)
    # DCP re-wraps a failed metadata read; the message still names the URL and the cause.
    assert "s3://nvdcp-test/nothing/here" in str(err) and "no committed checkpoint" in str(err)
    with pytest.raises(nvdcp.IncompleteCheckpointError, match="s3://nvdcp-test/nothing/here"):
        nvdcp.NvcompReader(s3env.url("nothing/here")).read_metadata()

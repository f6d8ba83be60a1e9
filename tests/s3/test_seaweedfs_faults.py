"""Bytes flipped in flight between nvdcp and its S3 server (nvdcp.testing.corrupting_proxy).

Uploads: SeaweedFS verifies the checksum nvdcp sends with every PUT and part and answers
``BadDigest``; nvdcp sends the part again from its buffer (``digest_retries``). A save either
completes bit-exactly or fails cleanly: no ``.metadata``, no open multipart upload. (moto stores
damaged uploads without a word, so upload corruption runs against SeaweedFS only.)

Downloads: the reader checks every chunk's CRC32C and reads the item's range again before it
declares the checkpoint corrupt (``NvcompReader.reread_attempts``); a whole-object GET
(``.metadata``) is checked against the server's CRC32C and read again. Damage that stays raises
``CorruptCheckpointError`` naming file, item and chunk. These run against moto and SeaweedFS.

The stress test injects several hundred flips both ways and checks that no load ever returns a
wrong tensor and no multipart upload is left open (``NVDCP_CORRUPTION_ROUNDS``, default 36, and
``NVDCP_CORRUPTION_SEED`` run it longer or with other draws).
"""

from __future__ import annotations

import collections
import logging
import os
import time
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import nvdcp
from nvdcp.errors import CorruptCheckpointError, StorageUnavailableError
from nvdcp.storage.s3 import DamagedDownloadError
from nvdcp.testing import bit_equal, empty_like_sd, failure_of, random_tensor, weights_like
from nvdcp.testing.corrupting_proxy import CorruptingProxy, Schedule, is_object_download, is_object_upload
from tests.s3.s3_testkit import S3Env

pytestmark = pytest.mark.s3

# Quick retries; every item its own GET (readahead and prefetch off) so loads make many requests to damage.
OPTS: dict[str, Any] = dict(
    retry_backoff_s=0.005, retry_backoff_max_s=0.05, readahead_size=0, prefetch_window=0, max_concurrency=8
)


def _state(seed: int, big: int = 0, n: int = 24) -> dict[str, Any]:
    """``n`` small items of several dtypes (one PutObject per data file) and a bytes item; ``big``
    bytes of incompressible data in one more tensor make a multipart upload."""
    sd: dict[str, Any] = {
        f"w{i}": weights_like((32 + 8 * i, 64), (torch.float32, torch.bfloat16, torch.float16)[i % 3], seed=seed + i)
        for i in range(n * 2 // 3)
    }
    sd.update({f"r{i}": random_tensor(torch.int32, (2000 + 100 * i,), seed=seed + 100 + i) for i in range(n // 3)})
    sd["extra"] = {"seed": seed, "note": "bytes item"}
    if big:
        sd["big"] = random_tensor(torch.uint8, (big,), seed=seed + 999)
    return sd


def _same(got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    """Names of the entries of ``got`` that differ from ``want`` (bit-exact)."""
    wrong = []
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            if not bit_equal(got[k], v):
                wrong.append(k)
        elif got[k] != v:
            wrong.append(k)
    return wrong


def _opts(env: S3Env, **kw: Any) -> dict[str, Any]:
    return {**OPTS, "part_size": env.min_part, "min_part_size": env.min_part, **kw}


def _save(url: str, sd: dict[str, Any], opts: dict[str, Any], threads: int = 4) -> None:
    dcp.save(sd, storage_writer=nvdcp.NvcompWriter(url, storage_options=opts, thread_count=threads, codec="zstd"))


def _load(url: str, like: dict[str, Any], opts: dict[str, Any], rereads: int | None = None) -> dict[str, Any]:
    sd = empty_like_sd(like)
    reader = nvdcp.NvcompReader(url, storage_options=opts, thread_count=2)
    if rereads is not None:
        reader.reread_attempts = rereads
    dcp.load(sd, storage_reader=reader)
    return sd


def _has_metadata(env: S3Env, prefix: str) -> bool:
    return any(k.endswith("/.metadata") for k in env.keys(prefix + "/"))


def _data_files(method: str, path: str) -> bool:
    return is_object_download(method, path) and path.split("?")[0].endswith(".nvdcp")


# -- the proxy itself ---------------------------------------------------------------------------------
def test_proxy_flips_what_its_schedule_says(s3env: S3Env) -> None:
    import boto3
    from botocore.config import Config

    raw = Config(retries={"max_attempts": 1}, response_checksum_validation="when_required")  # bytes as they come
    body = bytes(range(256)) * 16
    s3env.client.put_object(Bucket=s3env.bucket, Key="p/obj", Body=body)
    schedules = {
        "every 2nd": (Schedule(every=2), [False, True, False, True]),
        "first 1": (Schedule(first=1), [True, False, False, False]),
        "once per request": (Schedule(first=99, repeat=1), [True, False, False, False]),
        "at most 3": (Schedule(first=99, max_faults=3), [True, True, True, False]),
    }
    for name, (schedule, want) in schedules.items():
        schedule.position = -1
        with CorruptingProxy(s3env.endpoint, downloads=schedule) as proxy:
            client = boto3.client("s3", endpoint_url=proxy.endpoint, config=raw)
            got = [client.get_object(Bucket=s3env.bucket, Key="p/obj", Range="bytes=0-99")["Body"].read()
                   for _ in range(4)]
            client.list_objects_v2(Bucket=s3env.bucket)  # listings are never touched
        assert [g != body[:100] for g in got] == want, name
        assert all(g[:99] == body[:99] for g in got), name  # only the last byte (position=-1)
        assert proxy.flips["download"] == sum(want) and all(e.offset == 99 for e in proxy.events), name
    # Random draws repeat with the seed.
    runs = []
    for _ in range(2):
        with CorruptingProxy(s3env.endpoint, downloads=Schedule(probability=0.5, seed=7)) as proxy:
            client = boto3.client("s3", endpoint_url=proxy.endpoint, config=raw)
            for _ in range(12):
                client.get_object(Bucket=s3env.bucket, Key="p/obj")["Body"].read()
        runs.append([(e.offset, e.size) for e in proxy.events])
    assert runs[0] == runs[1] and 2 <= len(runs[0]) <= 10


# -- uploads (SeaweedFS: a server that checks what arrives) --------------------------------------------
def test_damaged_uploads_are_refused_and_sent_again(seaweed_env: S3Env, caplog: pytest.LogCaptureFixture) -> None:
    env = seaweed_env
    # Each PUT or part damaged at most once (its retry goes through): every save must complete.
    with CorruptingProxy(env.endpoint, uploads=Schedule(probability=0.5, repeat=1, seed=1)) as proxy:
        opts = _opts(env, endpoint_url=proxy.endpoint)
        with caplog.at_level(logging.WARNING, logger="nvdcp.storage.s3"):
            for run in range(4):
                _save(env.url(f"up/{run}"), _state(run, big=(2 * env.min_part + 77) if run == 0 else 0), opts)
    puts = [e for e in proxy.events if "partNumber=" not in e.path]
    # Which random draws land on multipart parts depends on thread timing: damage parts for sure.
    first_parts = Schedule(first=2, repeat=1, match=lambda m, p: is_object_upload(m, p) and "partNumber=" in p)
    with CorruptingProxy(env.endpoint, uploads=first_parts) as part_proxy:
        with caplog.at_level(logging.WARNING, logger="nvdcp.storage.s3"):
            _save(env.url("up/parts"), _state(9, big=2 * env.min_part + 77), _opts(env, endpoint_url=part_proxy.endpoint))
    parts = [e for e in part_proxy.events if "partNumber=" in e.path]
    assert len(parts) == 2 and puts, (part_proxy.events, proxy.events)
    assert any("BadDigest" in r.getMessage() for r in caplog.records)
    for run in [*range(4), 9]:
        want = _state(run, big=(2 * env.min_part + 77) if run in (0, 9) else 0)
        url = env.url("up/parts" if run == 9 else f"up/{run}")
        assert _same(_load(url, want, _opts(env)), want) == []
    assert env.uploads() == []


def test_upload_damaged_every_time_fails_cleanly(seaweed_env: S3Env) -> None:
    env = seaweed_env
    # Part 2 of the data file arrives damaged on every attempt: the save fails, the upload is aborted.
    hits = Schedule(first=10**9, match=lambda m, p: is_object_upload(m, p) and "partNumber=2&" in p + "&")
    with CorruptingProxy(env.endpoint, uploads=hits) as proxy:
        opts = _opts(env, endpoint_url=proxy.endpoint, digest_retries=2)
        with pytest.raises(CheckpointException) as info:
            _save(env.url("bad/step1"), _state(0, big=2 * env.min_part + 77), opts, threads=1)
    err = failure_of(info.value)
    assert isinstance(err, StorageUnavailableError), err
    assert "s3://nvdcp-test/bad/step1/" in str(err) and "UploadPart 2" in str(err) and "BadDigest" in str(err)
    assert "damaged in transit" in str(err)
    assert proxy.flips["upload"] == 3  # the first attempt and digest_retries=2 more
    assert not _has_metadata(env, "bad")
    assert env.uploads() == []


# -- downloads (moto and SeaweedFS) ----------------------------------------------------------------
def test_damaged_downloads_are_read_again(any_s3env: S3Env, caplog: pytest.LogCaptureFixture) -> None:
    env = any_s3env
    want = _state(7)
    _save(env.url("down/step1"), want, _opts(env))
    # Each GET (items, .metadata) damaged at most once: the re-read of the range goes through.
    with CorruptingProxy(env.endpoint, downloads=Schedule(probability=0.5, repeat=1, seed=2)) as proxy:
        with caplog.at_level(logging.WARNING):
            got = _load(env.url("down/step1"), want, _opts(env, endpoint_url=proxy.endpoint))
    assert _same(got, want) == []
    # The CPU reader reads runs of small records with one GET, so a load makes only a few.
    assert proxy.flips["download"] >= 1, proxy.flips
    rereads = [r for r in caplog.records if "reading its bytes again" in r.getMessage()]
    assert rereads and all("checksum mismatch" in r.getMessage() or "header" in r.getMessage() for r in rereads)


def test_damaged_prefetched_bytes_are_read_again(any_s3env: S3Env, caplog: pytest.LogCaptureFixture) -> None:
    """With sequential prefetch on, a damaged extent fails a chunk CRC32C; the re-read drops the
    prefetched extents (forget_cached) and reads from the store, so the load is bit-exact."""
    env = any_s3env
    want = _state(8, big=24 << 20)
    _save(env.url("pref/step1"), want, _opts(env), threads=1)
    prefetch = dict(prefetch_window=4 << 20, prefetch_part_size=1 << 20)
    with CorruptingProxy(env.endpoint, downloads=Schedule(first=2, match=_data_files)) as proxy:
        with caplog.at_level(logging.WARNING):
            got = _load(env.url("pref/step1"), want, _opts(env, endpoint_url=proxy.endpoint, **prefetch))
    assert _same(got, want) == []
    assert proxy.flips["download"] >= 1, proxy.flips


def test_damaged_metadata_download_is_read_again(any_s3env: S3Env, caplog: pytest.LogCaptureFixture) -> None:
    env = any_s3env
    want = _state(3)
    _save(env.url("meta/step1"), want, _opts(env))
    only_metadata = Schedule(first=1, match=lambda m, p: is_object_download(m, p) and p.endswith("/.metadata"))
    with CorruptingProxy(env.endpoint, downloads=only_metadata) as proxy:
        with caplog.at_level(logging.WARNING, logger="nvdcp.storage.s3"):
            got = _load(env.url("meta/step1"), want, _opts(env, endpoint_url=proxy.endpoint))
    assert proxy.flips["download"] == 1 and _same(got, want) == []
    # Caught by the CRC32C the server recorded at upload, not by luck in the unpickler.
    assert any(".metadata: GetObject bytes damaged in transit" in r.getMessage() for r in caplog.records)


def test_download_damaged_every_time_names_file_item_and_chunk(any_s3env: S3Env) -> None:
    env = any_s3env
    want = _state(5)
    url = env.url("persist/step1")
    _save(url, want, _opts(env), threads=1)
    # The last byte of every GET of the data file: the last item's last chunk never reads right.
    metadata = nvdcp.NvcompReader(url).read_metadata()
    last = max(metadata.storage_data, key=lambda ix: metadata.storage_data[ix].offset)
    file = metadata.storage_data[last].relative_path
    hits = Schedule(first=10**9, position=-1, match=_data_files)
    with CorruptingProxy(env.endpoint, downloads=hits) as proxy:
        with pytest.raises(CheckpointException) as info:
            _load(url, want, _opts(env, endpoint_url=proxy.endpoint, readahead_size=8 << 20))
    err = failure_of(info.value)
    assert isinstance(err, CorruptCheckpointError), err
    text = str(err)
    assert f"s3://nvdcp-test/persist/step1/{file}" in text and f"item {last.fqn!r}" in text, text
    assert "chunk " in text and "checksum mismatch" in text and "the same after 2 re-reads" in text, text
    assert proxy.flips["download"] >= 3  # the first read and two re-reads at least


# -- many faults both ways -------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(int(os.environ.get("NVDCP_CORRUPTION_ROUNDS", "36")) * 30 + 120)
def test_random_damage_both_ways_never_loads_a_wrong_tensor(seaweed_env: S3Env) -> None:
    """Rounds of save and load through a proxy that damages 30% of upload bodies and 25% of download
    bodies, with no limit per request (so some operations fail for good). A save either completes
    or fails with no ``.metadata`` (or, rarely, fails in its cleanup after ``.metadata`` went up: then
    the checkpoint is whole); a load through the proxy is bit-exact or raises CorruptCheckpointError,
    and then the stored checkpoint loads bit-exactly without the proxy (the damage was in transit);
    no multipart upload is ever left open."""
    env = seaweed_env
    rounds, outcomes = int(os.environ.get("NVDCP_CORRUPTION_ROUNDS", "36")), collections.Counter[str]()
    seed = int(os.environ.get("NVDCP_CORRUPTION_SEED", "11"))
    started = time.monotonic()
    with CorruptingProxy(
        env.endpoint,
        uploads=Schedule(probability=0.3, seed=seed, max_faults=100_000, seconds=3600),
        downloads=Schedule(probability=0.25, seed=seed + 1, max_faults=100_000, seconds=3600),
        lifetime_s=4000,
    ) as proxy:
        via = _opts(env, endpoint_url=proxy.endpoint)
        for r in range(rounds):
            want = _state(1000 + r, big=(2 * env.min_part + 333) if r % 5 == 0 else 0, n=48)
            url = env.url(f"stress/{r}")
            try:
                _save(url, want, via, threads=8)
                outcomes["save completed"] += 1
            except CheckpointException as exc:
                err = failure_of(exc)  # damage outlasted the retries: an upload refused, or a read
                assert "BadDigest" in str(err) or isinstance(err, DamagedDownloadError), err
                if not _has_metadata(env, f"stress/{r}"):
                    outcomes["save failed cleanly"] += 1
                    continue
                # .metadata went up, then a read after the commit (the cleanup's check of
                # .metadata) failed: the checkpoint is committed and must load bit-exactly.
                outcomes["save committed, then a cleanup read failed"] += 1
            try:
                got = _load(url, want, via, rereads=3)
            # a one-process load runs read_data outside DCP's wrapper (torch 2.13): the error comes bare
            except (CheckpointException, CorruptCheckpointError) as exc:
                err = failure_of(exc)
                assert isinstance(err, CorruptCheckpointError) and ("item " in str(err) or ".metadata" in str(err)), err
                assert _same(_load(url, want, _opts(env)), want) == [], f"round {r}: stored checkpoint differs"
                outcomes["load refused, damage outlasted re-reads"] += 1
                continue
            assert _same(got, want) == [], f"round {r}: wrong tensors loaded"
            outcomes["load bit-exact"] += 1
        assert env.uploads() == []
    flips = dict(proxy.flips)
    print(f"\n{rounds} rounds (seed {seed}) in {time.monotonic() - started:.1f}s, flips {flips}, {dict(outcomes)}")
    assert proxy.total_flips >= 200, flips
    assert flips.get("upload", 0) >= 40 and flips.get("download", 0) >= 100, flips
    assert outcomes["load bit-exact"] >= 2 * outcomes["save completed"] // 3, outcomes
    assert outcomes["save completed"] >= rounds // 2, outcomes

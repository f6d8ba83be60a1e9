"""``S3Config``: every knob of the native S3 backend in one frozen, validated dataclass.

Where settings come from, in order (the AWS way):

1. explicit fields of :class:`S3Config` (or ``storage_options`` keys of the same names);
2. the standard AWS environment and config files, resolved by botocore itself:
   ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``, ``AWS_REGION`` / ``AWS_DEFAULT_REGION``,
   ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``, ``AWS_PROFILE``,
   ``~/.aws/config``, then instance/container roles.

nvdcp reads no environment variable of its own for S3. Credential fields are left out of ``repr``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40

#: S3's own limits (https://docs.aws.amazon.com/AmazonS3/latest/userguide/qfacts.html).
S3_MIN_PART_SIZE = 5 * MiB
S3_MAX_PART_SIZE = 5 * GiB
S3_MAX_PARTS = 10_000
S3_MAX_OBJECT_SIZE = 5 * TiB
S3_MAX_DELETE_KEYS = 1000

_RETRY_MODES = ("standard", "adaptive", "legacy")
_ADDRESSING = ("auto", "path", "virtual")
_CHECKSUMS = ("CRC32C", "MD5")


@dataclasses.dataclass(frozen=True)
class S3Config:
    """Settings of :class:`~nvdcp.storage.s3.S3Storage`; every field is optional.

    Attributes:
        endpoint_url: S3-compatible endpoint (``http(s)://host:port``). ``None``: botocore's
            resolution (``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``, config file, AWS).
        region: region name; ``None``: ``AWS_REGION`` / ``AWS_DEFAULT_REGION`` / profile.
        profile: a named profile of ``~/.aws/config``.
        aws_access_key_id, aws_secret_access_key, aws_session_token: explicit credentials that
            override the standard chain (prefer the chain; these never appear in repr, logs or errors).
        botocore_config: a ``botocore.config.Config`` merged over nvdcp's (its values win).
        part_size: first multipart part size in bytes (default 16 MiB).
        part_growth_every: the part size doubles after every this many parts (capped at 5 GiB) so
            a stream of unknown length never needs more than 10,000 parts. With the defaults an
            object can reach 16 MiB x 1000 x (1+2+...+256) + 5 GiB x 1000, beyond S3's 5 TiB cap.
        min_part_size: smallest non-final part the server accepts. S3 requires 5 MiB; lower it only
            for test servers (moto with ``S3_UPLOAD_PART_MIN_SIZE``).
        max_inflight_parts: parts of one stream uploading or queued at once; ``write`` blocks
            beyond that. In-flight memory per stream is about ``(max_inflight_parts + 1) x part size``.
        max_concurrency: threads issuing part uploads and ranged GETs (shared by all streams and
            reads of one storage object).
        read_part_size: a ranged read larger than this is split into concurrent GETs of this size.
        coalesce_gap: ranges of one object closer than this many bytes are fetched by one GET
            (reading a gap costs less than another request's latency).
        readahead_size: a single ``read_range`` smaller than this fetches the aligned block of
            this size around it and keeps it for the next reads (the DCP reader asks for one item
            at a time, in file order: without readahead every item would cost a GET). 0 disables.
        readahead_blocks: blocks kept (least recently used evicted); memory up to
            ``readahead_size x readahead_blocks`` per storage object.
        prefetch_window: once reads of an object move forward (a DCP load reads each data file
            front to back), keep this many bytes past the furthest read being fetched, so reads
            find their bytes already fetched while the reader decodes. 0 disables. Memory: about
            this much per object being read, plus one part.
        prefetch_part_size: bytes per prefetch GET.
        checksum: ``"CRC32C"`` (``x-amz-checksum-crc32c`` on every PUT and part; S3 verifies it) or
            ``"MD5"`` (``Content-MD5``; for S3-compatible stores without flexible checksums).
        retry_mode, max_attempts: botocore's retry policy per HTTP request (throttling ``SlowDown``,
            5xx, dropped connections), with exponential backoff.
        part_retries: extra attempts nvdcp makes for one part upload, GET body or PUT after botocore
            gave up or failed outside its scope (a connection cut while a GET body streams).
        digest_retries: extra attempts nvdcp makes when bytes were damaged in transit: a PUT or
            part the server refused because its checksum did not match what arrived (``BadDigest``;
            the retry sends the same bytes again from nvdcp's buffer), or a whole-object GET whose
            CRC32C does not match the server's record. Counted apart from ``part_retries``; once
            they are spent a multipart upload is aborted (nothing is left behind).
        retry_backoff_s, retry_backoff_max_s: full-jitter exponential backoff of those extra attempts.
        connect_timeout_s, read_timeout_s: socket timeouts per request.
        addressing_style: ``"auto"``, ``"path"`` or ``"virtual"`` bucket addressing.
    """

    endpoint_url: str | None = None
    region: str | None = None
    profile: str | None = None
    aws_access_key_id: str | None = dataclasses.field(default=None, repr=False)
    aws_secret_access_key: str | None = dataclasses.field(default=None, repr=False)
    aws_session_token: str | None = dataclasses.field(default=None, repr=False)
    botocore_config: Any = None
    part_size: int = 16 * MiB
    part_growth_every: int = 1000
    min_part_size: int = S3_MIN_PART_SIZE
    max_inflight_parts: int = 8
    max_concurrency: int = 32
    read_part_size: int = 8 * MiB
    coalesce_gap: int = 1 * MiB
    readahead_size: int = 8 * MiB
    readahead_blocks: int = 8
    prefetch_window: int = 128 * MiB
    prefetch_part_size: int = 32 * MiB
    checksum: Literal["CRC32C", "MD5"] = "CRC32C"
    retry_mode: Literal["standard", "adaptive", "legacy"] = "standard"
    max_attempts: int = 8
    part_retries: int = 3
    digest_retries: int = 3
    retry_backoff_s: float = 0.2
    retry_backoff_max_s: float = 20.0
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 60.0
    addressing_style: Literal["auto", "path", "virtual"] = "auto"

    def __post_init__(self) -> None:
        self._check_strings()
        self._check_sizes()
        self._check_retries()

    def _check_strings(self) -> None:
        if self.endpoint_url is not None and not str(self.endpoint_url).startswith(("http://", "https://")):
            raise ValueError(f"S3Config.endpoint_url must start with http:// or https://, got {self.endpoint_url!r}")
        if self.checksum not in _CHECKSUMS:
            raise ValueError(f"S3Config.checksum must be one of {_CHECKSUMS}, got {self.checksum!r}")
        if self.retry_mode not in _RETRY_MODES:
            raise ValueError(f"S3Config.retry_mode must be one of {_RETRY_MODES}, got {self.retry_mode!r}")
        if self.addressing_style not in _ADDRESSING:
            raise ValueError(f"S3Config.addressing_style must be one of {_ADDRESSING}, got {self.addressing_style!r}")
        if (self.aws_access_key_id is None) != (self.aws_secret_access_key is None):
            # Say which one is missing, never the value of the other.
            raise ValueError("S3Config: aws_access_key_id and aws_secret_access_key must be given together")
        if self.botocore_config is not None:
            from botocore.config import Config

            if not isinstance(self.botocore_config, Config):
                raise TypeError(
                    f"S3Config.botocore_config must be a botocore.config.Config, got {type(self.botocore_config).__name__}"
                )

    def _check_sizes(self) -> None:
        _int_in("min_part_size", self.min_part_size, 1, S3_MIN_PART_SIZE)
        _int_in("part_size", self.part_size, self.min_part_size, S3_MAX_PART_SIZE)
        _int_in("part_growth_every", self.part_growth_every, 1, S3_MAX_PARTS)
        _int_in("max_inflight_parts", self.max_inflight_parts, 1, 1024)
        _int_in("max_concurrency", self.max_concurrency, 1, 1024)
        _int_in("read_part_size", self.read_part_size, 64 * KiB, S3_MAX_PART_SIZE)
        _int_in("coalesce_gap", self.coalesce_gap, 0, 1 * GiB)
        _int_in("readahead_size", self.readahead_size, 0, S3_MAX_PART_SIZE)
        if 0 < self.readahead_size < 4 * KiB:
            raise ValueError(f"S3Config.readahead_size must be 0 (off) or at least 4 KiB, got {self.readahead_size}")
        _int_in("readahead_blocks", self.readahead_blocks, 1, 4096)
        _int_in("prefetch_part_size", self.prefetch_part_size, 64 * KiB, S3_MAX_PART_SIZE)
        _int_in("prefetch_window", self.prefetch_window, 0, 64 * GiB)

    def _check_retries(self) -> None:
        _int_in("max_attempts", self.max_attempts, 1, 100)
        _int_in("part_retries", self.part_retries, 0, 100)
        _int_in("digest_retries", self.digest_retries, 0, 100)
        for name in ("retry_backoff_s", "retry_backoff_max_s", "connect_timeout_s", "read_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"S3Config.{name} must be a positive number, got {value!r}")

    # -- derived -------------------------------------------------------------------------------
    def part_size_for(self, part_number: int) -> int:
        """Size of multipart part ``part_number`` (1-based) under the doubling strategy."""
        doublings = (part_number - 1) // self.part_growth_every
        return min(S3_MAX_PART_SIZE, self.part_size << min(doublings, 40))

    @property
    def max_object_size(self) -> int:
        """Largest object one stream can write in at most 10,000 parts (capped at S3's 5 TiB)."""
        total, part = 0, 1
        while part <= S3_MAX_PARTS:
            size = self.part_size_for(part)
            run = min(self.part_growth_every - (part - 1) % self.part_growth_every, S3_MAX_PARTS - part + 1)
            total += size * run
            part += run
        return min(total, S3_MAX_OBJECT_SIZE)

    @classmethod
    def from_options(cls, options: dict[str, Any], base: S3Config | None = None) -> S3Config:
        """``base`` (or the defaults) with ``options`` applied; unknown keys are refused by name."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown S3 storage option(s) {unknown}; valid: {sorted(known)}")
        return dataclasses.replace(base or cls(), **options)


def _int_in(name: str, value: Any, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"S3Config.{name} must be an integer within {low}..{high}, got {value!r}")


__all__ = ["S3_MAX_OBJECT_SIZE", "S3_MAX_PARTS", "S3_MAX_PART_SIZE", "S3_MIN_PART_SIZE", "S3Config"]

"""Fixtures for the S3 tests: moto and SeaweedFS servers on loopback (see s3_testkit.py)."""

from tests.s3.s3_testkit import (  # noqa: F401  (sets S3_UPLOAD_PART_MIN_SIZE before moto loads)
    any_s3env,
    moto_s3,
    s3env,
    seaweed_env,
    seaweedfs,
)

"""Fixtures for the S3 tests: a moto server on loopback (see s3_testkit.py)."""

from tests.s3.s3_testkit import moto_s3, s3env  # noqa: F401  (sets S3_UPLOAD_PART_MIN_SIZE before moto loads)

"""Fixtures for the storage tests: the S3 backends run against moto and SeaweedFS servers on loopback.

The servers, the fault-injecting proxy and the fixtures live in tests/s3/s3_testkit.py, shared with
the S3 checkpoint tests; importing it first sets ``S3_UPLOAD_PART_MIN_SIZE`` before moto is imported.
"""

from tests.s3.s3_testkit import moto_s3, s3env, seaweed_env, seaweedfs  # noqa: F401

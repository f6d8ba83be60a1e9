"""Fixtures for the S3 tests: a moto server on loopback (see s3_testkit.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from s3_testkit import moto_s3, s3env  # noqa: E402,F401  (must come before anything imports moto)

"""Init step of the training pods: wait until the checkpoint bucket answers, then exit 0.

Reads NVDCP_CKPT_ROOT (``s3://bucket/prefix``) and the standard AWS_* variables, and calls
HeadBucket until it succeeds or NVDCP_WAIT_TIMEOUT_S (default 600) runs out, so that a wrong
endpoint, missing bucket or bad credentials show up as one clear message in the init
container's log instead of a crash loop of torchrun. Never prints credentials.
Copied into the image by k8s/Dockerfile; tests/k8s runs it against a moto server.
"""

from __future__ import annotations

import os
import sys
import time
from urllib.parse import urlparse


def bucket_of(root: str) -> str | None:
    url = urlparse(root)
    return url.netloc if url.scheme == "s3" else None


def main() -> int:
    root = os.environ.get("NVDCP_CKPT_ROOT", "")
    bucket = bucket_of(root)
    if bucket is None:
        print(f"wait_for_bucket: {root!r} is not an s3:// URL; nothing to wait for", flush=True)
        return 0
    import boto3  # the image has it; imported late so a local root needs no boto3
    import botocore.config
    import botocore.exceptions

    timeout = float(os.environ.get("NVDCP_WAIT_TIMEOUT_S", "600"))
    endpoint = os.environ.get("AWS_ENDPOINT_URL") or "AWS default endpoint"
    client = boto3.client(
        "s3", config=botocore.config.Config(retries={"max_attempts": 1}, connect_timeout=5, read_timeout=10)
    )
    deadline = time.monotonic() + timeout
    delay = 1.0
    while True:
        try:
            client.head_bucket(Bucket=bucket)
            print(f"wait_for_bucket: bucket {bucket!r} at {endpoint} is ready", flush=True)
            return 0
        except (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError) as exc:
            if isinstance(exc, botocore.exceptions.ClientError):
                code = exc.response.get("Error", {}).get("Code", "?")
                reason = f"HTTP {code} (403: credentials, 404: no such bucket)"
            else:
                reason = type(exc).__name__
            if time.monotonic() + delay > deadline:
                print(
                    f"wait_for_bucket: bucket {bucket!r} at {endpoint} not ready after {timeout:.0f}s: "
                    f"{reason}",
                    file=sys.stderr,
                    flush=True,
                )
                return 1
            print(
                f"wait_for_bucket: bucket {bucket!r} at {endpoint} not ready ({reason}); "
                f"retrying in {delay:.0f}s",
                flush=True,
            )
            time.sleep(delay)
            delay = min(delay * 2, 15.0)


if __name__ == "__main__":
    sys.exit(main())

"""The commands on s3:// URLs, against a moto server on loopback (credentials from AWS_* vars)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.cli.conftest import cli, invoke, load_nvdcp
from tests.cli.states import assert_same, make_state

pytestmark = pytest.mark.s3


def test_convert_to_s3_then_inspect_verify_and_back(ckpts: dict[str, Path], s3env: Any, tmp_path: Path) -> None:
    url = s3env.url("ckpt/step1")
    ran = invoke("convert", ckpts["stock"], url, "--codec", "zstd")
    assert ran.exit_code == 0, ran.stderr
    keys = s3env.keys("ckpt/step1/")
    assert "ckpt/step1/.metadata" in keys and any(k.endswith(".nvdcp") for k in keys)

    ran = cli("inspect", url, "--json")
    assert ran.exit_code == 0, ran.stderr
    doc = ran.json()
    assert doc["url"].startswith("s3://") and doc["format"] == "nvdcp" and doc["totals"]["items"] == 9
    assert invoke("verify", url).exit_code == 0

    local = tmp_path / "local"
    assert invoke("convert", url, local).exit_code == 0
    assert_same(load_nvdcp(local), make_state())

    # damage one data object in the bucket: verify names it and exits 1
    data_key = next(k for k in keys if k.endswith(".nvdcp"))
    body = bytearray(s3env.client.get_object(Bucket=s3env.bucket, Key=data_key)["Body"].read())
    body[-1] ^= 0xFF
    s3env.client.put_object(Bucket=s3env.bucket, Key=data_key, Body=bytes(body))
    ran = invoke("verify", url, "--json")
    assert ran.exit_code == 1
    assert ran.json()["damaged"][0]["file"] == data_key.rsplit("/", 1)[1]


def test_missing_prefix_and_bad_option(s3env: Any) -> None:
    ran = invoke("inspect", s3env.url("nothing/here"))
    assert ran.exit_code == 3 and "no committed checkpoint" in ran.stderr
    ran = invoke("inspect", s3env.url("x"), "-o", "no_such_option=1")
    assert ran.exit_code == 3 and "no_such_option" in ran.stderr

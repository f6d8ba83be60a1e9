"""Single-byte flips and truncations of data files: every one in an item is detected at load with
an error naming the file, the item and (in a payload) the chunk, and by ``verify_checkpoint``;
none returns wrong tensors. Flips in a data file's own header change nothing a load reads (items
are self-describing): tensors come back intact, and ``nvdcp inspect`` reports the header.

A sample runs here; benchmarks/reliability_sweep.py runs every byte of a larger checkpoint.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from nvdcp.codecs.gdeflate import GDeflateCodec
from nvdcp.inspection import inspect_checkpoint
from nvdcp.testing import damage as D

pytestmark = pytest.mark.timeout(240)

CODECS = ["zstd", "none", pytest.param("gdeflate", marks=pytest.mark.skipif(
    not GDeflateCodec.available(), reason="libnvcomp_cpu (nvidia-libnvcomp-cu12) is not installed"))]
#: Cases per codec in CI: the sweep does all of them.
PER_KIND = {"file header": 20, "item header": 120, "payload": 150}
TRUNCATIONS = 10


@pytest.fixture(scope="module", params=CODECS)
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], list[D.Region]]:
    path = tmp_path_factory.mktemp(f"damage-{request.param}")
    sd = D.save_sample(path, request.param)
    return path, sd, D.regions(path)


def test_single_byte_flips_are_detected(saved: tuple[Path, dict[str, Any], list[D.Region]]) -> None:
    path, sd, regions = saved
    tally = D.Tally()
    for region, pos, xor in D.sample_positions(regions, PER_KIND, seed=hash(path.name) & 0xFFFF):
        D.check_flip(path, region, pos, xor, sd, tally)
    assert not tally.failures, "\n".join(tally.failures)
    assert tally.cases == sum(PER_KIND.values())
    assert tally.outcomes["payload: verify found"] == PER_KIND["payload"]


def test_truncations_are_detected(saved: tuple[Path, dict[str, Any], list[D.Region]]) -> None:
    path, sd, regions = saved
    tally = D.Tally()
    for file, length in D.truncation_lengths(regions, TRUNCATIONS, seed=1):
        D.check_truncation(path, file, length, sd, tally, regions)
    assert not tally.failures, "\n".join(tally.failures)
    assert tally.cases >= 3 * len([r for r in regions if r.kind == "item header"])


def test_file_header_damage_is_reported_by_inspect(saved: tuple[Path, dict[str, Any], list[D.Region]]) -> None:
    path, _, regions = saved
    fh = next(r for r in regions if r.kind == "file header")
    f = path / fh.file
    original = f.read_bytes()
    damaged = bytearray(original)
    damaged[fh.stop - 7] ^= 0x20  # inside the JSON info
    f.write_bytes(damaged)
    try:
        report = inspect_checkpoint(path, threads=1)
        errors = [d.error for d in report.files if d.error]
        assert errors and fh.file in errors[0] and "checksum" in errors[0]
    finally:
        f.write_bytes(original)


def test_metadata_flips_never_give_wrong_tensors(saved: tuple[Path, dict[str, Any], list[D.Region]]) -> None:
    """.metadata has no checksum of its own (it is torch's pickle): a flip there may load intact or
    fail in nvdcp, in the unpickler or in DCP's planner, but never yields other tensors."""
    path, sd, _ = saved
    size = (path / ".metadata").stat().st_size
    tally = D.Tally()
    rng = random.Random(size)
    for pos in rng.sample(range(size), 40):
        D.check_metadata_flip(path, pos, rng.randrange(1, 256), sd, tally)
    assert not tally.failures, "\n".join(tally.failures)


#: Chain cases per codec in CI (a sample of both checkpoints' bytes): the sweep does all of them.
CHAIN_CASES = 160


@pytest.mark.parametrize("codec", [c for c in CODECS if c != "none"])
def test_byte_flips_in_a_delta_or_its_base_are_named_or_harmless(codec: str, tmp_path: Path) -> None:
    """A delta checkpoint loads through its base: a flipped byte in either one's records that the
    load reads is named at load (the damaged checkpoint's file, the item, the chunk) and found
    by ``verify_checkpoint`` down the chain; one in a base record the load does not read (an
    item the delta stores whole) changes nothing. Never wrong tensors."""
    _, delta, want = D.save_delta_sample(tmp_path, codec)
    assert D.delta_items(delta) >= {"w", "b16", "ids"}
    regions = D.chain_regions(delta)
    rng = random.Random(codec)
    spans = [(where, region, pos, read) for where, region, read in regions for pos in range(region.start, region.stop)]
    tally = D.Tally()
    for where, region, pos, read in rng.sample(spans, CHAIN_CASES):
        D.check_chain_flip(delta, where, region, pos, rng.randrange(1, 256), want, tally, read)
    assert not tally.failures, "\n".join(tally.failures)
    assert tally.cases == CHAIN_CASES
    assert tally.outcomes["base payload: load CorruptCheckpointError"] > 0  # the sample reached base records

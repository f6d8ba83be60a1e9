"""Bounded fuzzing in CI: header parsers, the decoder with forged checksums, and the reader over
hostile ``.metadata`` records and data files. Each target runs in a forked worker whose address
space is capped (``RLIMIT_AS``): only ``NvdcpError`` may come out, with no crash, no hang (a
deadline per example and a timeout per target) and no unbounded memory."""

from __future__ import annotations

import pytest

from nvdcp.testing import faults as F
from nvdcp.testing import fuzz_targets as T

pytestmark = pytest.mark.timeout(240)

#: Address space a target may add to what the worker already maps (torch maps a lot up front).
HEADROOM = 1 << 30


@pytest.mark.parametrize("target", list(T.TARGETS))
def test_fuzz_target(target: str) -> None:
    result = F.call_in_process(T.run, target, T.EXAMPLES, HEADROOM, timeout=200)
    assert result[0] == "ok", result
    stats = result[1]
    assert stats["rss_growth_kib"] < 512 * 1024, stats

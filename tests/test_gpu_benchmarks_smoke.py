"""The GPU-only benchmarks of issues 14 and 18 refuse clearly without a GPU (they run on the
device machine; their results are under benchmarks/results/)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks import load_knobs, sync_probe, table_upload_probe


@pytest.mark.skipif(torch.cuda.is_available(), reason="they run for real on a GPU")
@pytest.mark.parametrize("module,args", [(sync_probe, []), (load_knobs, []), (load_knobs, ["--first-load"]),
                                          (table_upload_probe, [])])
def test_refuses_without_a_gpu(module: object, args: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert module.main(["--out", str(tmp_path), *args]) == 2  # type: ignore[attr-defined]
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())

"""The entry points: the ``nvdcp`` console script's ``nvdcp.cli:main`` and ``python -m nvdcp``."""

from __future__ import annotations

import pytest

import nvdcp
from tests.cli.conftest import REPO, invoke


def test_console_script_points_at_main(capsys: pytest.CaptureFixture[str]) -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"nvdcp": "nvdcp.cli:main"}
    from nvdcp.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"nvdcp, version {nvdcp.__version__}"


def test_help_lists_the_commands() -> None:
    ran = invoke("--help")
    assert ran.exit_code == 0
    for command in ("inspect", "verify", "convert", "bench"):
        assert command in ran.stdout
    assert invoke("frobnicate").exit_code == 2

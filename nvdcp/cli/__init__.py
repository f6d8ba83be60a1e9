"""The ``nvdcp`` command line (docs/CLI.md): ``inspect``, ``verify``, ``convert``, ``bench``.

Installed as the ``nvdcp`` console script and runnable as ``python -m nvdcp``. Its libraries
(click, rich, matplotlib) come with ``pip install 'nvdcp[cli]'``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> None:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``); exits with its status."""
    try:
        from nvdcp.cli.app import cli
    except ImportError as exc:
        if exc.name not in ("click", "rich"):
            raise
        sys.stderr.write(f"nvdcp: the command line needs {exc.name}: pip install 'nvdcp[cli]'\n")
        raise SystemExit(3) from None
    cli.main(args=list(argv) if argv is not None else None, prog_name="nvdcp")


__all__ = ["main"]

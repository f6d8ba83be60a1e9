"""Terminal plumbing shared by the commands: consoles, progress bars, sizes, exit codes."""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any

from rich.console import Console
from rich.filesize import decimal
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

#: Exit statuses, documented in docs/CLI.md. 2 is click's own for bad arguments.
EXIT_OK = 0
EXIT_DAMAGED = 1
EXIT_USAGE = 2
EXIT_ERROR = 3


def _console(stderr: bool) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    # Piped output has no width: rich would assume 80 columns and squeeze tables; tables are only
    # as wide as their contents, so a generous width costs nothing.
    wide = not stream.isatty() and "COLUMNS" not in os.environ
    return Console(stderr=stderr, highlight=False, width=200 if wide else None)


# Results go to stdout (so ``--json`` output pipes cleanly); progress, notes and errors to stderr.
out = _console(stderr=False)
err = _console(stderr=True)


def human(n: float | None) -> str:
    """Bytes as people read them (decimal units, like ``ls -h --si`` and disk vendors)."""
    return "-" if n is None else decimal(int(n))


def fmt_ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.3f}"


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``"1GiB"``, ``"512M"``, ``"2e9"``-free sizes: ``k/M/G/T`` decimal, ``Ki/Mi/Gi/Ti`` binary."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (examples: 512MiB, 2GB, 1048576)")
    number, unit, binary = float(m.group(1)), m.group(2).lower(), bool(m.group(3))
    power = " kmgt".index(unit) if unit else 0
    return int(number * (1024 if binary else 1000) ** power)


def parse_options(pairs: tuple[str, ...]) -> dict[str, Any]:
    """``KEY=VALUE`` storage options; values are JSON when they parse as JSON, else strings."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"storage option {pair!r} is not KEY=VALUE")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    return options


def print_json(payload: Any) -> None:
    # Plain print, not rich: JSON must reach pipes byte for byte, without markup or wrapping.
    sys.stdout.write(json.dumps(payload, indent=2, default=str) + "\n")
    sys.stdout.flush()


def show_progress(flag: bool | None) -> bool:
    """``--progress``/``--no-progress``; by default a bar only when stderr is a terminal."""
    return err.is_terminal if flag is None else flag


@contextlib.contextmanager
def progress_bar(description: str, total: int, enabled: bool, *, unit: str = "items") -> Iterator[Callable[..., None]]:
    """A progress bar on stderr; yields ``update(done, total=None, note=None)``.

    ``unit="bytes"`` shows sizes; otherwise counts. Disabled bars cost nothing.
    """
    if not enabled:
        yield lambda *a, **k: None
        return
    columns: list[Any] = [TextColumn("[bold]{task.description}"), BarColumn(), TaskProgressColumn()]
    if unit == "bytes":
        columns.append(TextColumn("{task.fields[done_h]}/{task.fields[total_h]}"))
    else:
        columns.append(MofNCompleteColumn())
    columns += [TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[note]}")]
    with Progress(*columns, console=err, transient=False) as bar:
        task = bar.add_task(description, total=total, done_h=human(0), total_h=human(total), note="")

        def update(done: int, total: int | None = None, note: str | None = None) -> None:
            fields: dict[str, Any] = {"done_h": human(done)}
            if total is not None:
                fields["total"] = total
                fields["total_h"] = human(total)
            if note is not None:
                fields["note"] = note
            bar.update(task, completed=done, **fields)

        yield update

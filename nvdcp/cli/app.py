"""The ``nvdcp`` command: inspect, verify, convert and bench checkpoints (docs/CLI.md).

Results go to stdout (tables, or JSON with ``--json``); progress bars, notes and errors to
stderr. Exit status: 0 success, 1 the checkpoint is damaged, 2 bad arguments, 3 any other
failure (nothing at that path, storage errors, a codec this machine cannot run).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from nvdcp import __version__
from nvdcp.cli import _ui
from nvdcp.cli._ui import EXIT_DAMAGED, EXIT_ERROR, err, human, out
from nvdcp.errors import CorruptCheckpointError, NvdcpError


class Failure(click.ClickException):
    """An error the user can act on, shown as ``nvdcp <command>: error: ...`` with an exit status."""

    def __init__(self, message: str, exit_code: int = EXIT_ERROR, command: str | None = None) -> None:
        super().__init__(message)
        self.exit_code = exit_code  # type: ignore[misc]  # click reads it per instance
        if command is None:
            ctx = click.get_current_context(silent=True)
            command = ctx.command_path if ctx else None
        self.command = command

    def show(self, file: Any = None) -> None:
        name = self.command
        if name is None:
            ctx = click.get_current_context(silent=True)
            name = ctx.command_path if ctx else "nvdcp"
        # rich markup only around our own words: messages may hold brackets (shapes, lists)
        err.print(f"[bold red]{name}: error:[/] ", end="")
        err.print(self.message, markup=False, highlight=False, soft_wrap=True)


class _Group(click.Group):
    """Turns nvdcp's and the OS's errors into one-line messages and exit statuses, no tracebacks."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except CorruptCheckpointError as exc:
            raise Failure(str(exc), EXIT_DAMAGED, self._name(ctx)) from exc
        except (NvdcpError, OSError, ValueError) as exc:
            raise Failure(str(exc) or type(exc).__name__, EXIT_ERROR, self._name(ctx)) from exc

    @staticmethod
    def _name(ctx: click.Context) -> str:
        return " ".join(filter(None, [ctx.command_path, ctx.invoked_subcommand]))


def _storage_options(pairs: tuple[str, ...]) -> dict[str, Any]:
    try:
        return _ui.parse_options(pairs)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="'-o/--storage-option'") from None


def _size(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return _ui.parse_size(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


storage_option = click.option(
    "-o", "--storage-option", "options", multiple=True, metavar="KEY=VALUE",
    help="Storage backend option for URLs (repeatable), e.g. -o endpoint_url=http://127.0.0.1:9000. "
    "S3 credentials and region come from the standard AWS_* variables.",
)
json_option = click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout.")
progress_option = click.option(
    "--progress/--no-progress", default=None, help="Progress bar on stderr (default: when stderr is a terminal).",
)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, "-V", "--version", prog_name="nvdcp")
@click.option("-v", "--verbose", count=True, help="Log nvdcp's INFO summaries (-vv: DEBUG) on stderr.")
def cli(verbose: int) -> None:
    """Inspect, verify, convert and benchmark torch.distributed.checkpoint checkpoints,
    nvdcp-compressed or stock. PATH_OR_URL is a directory, file://..., s3://bucket/prefix
    or any fsspec URL."""
    if verbose:
        from rich.logging import RichHandler

        logging.basicConfig(
            level=logging.DEBUG if verbose > 1 else logging.INFO, format="%(name)s: %(message)s",
            handlers=[RichHandler(console=err, show_time=False, show_path=False)],
        )


# -- inspect -----------------------------------------------------------------------------------
@cli.command()
@click.argument("path", metavar="PATH_OR_URL")
@json_option
@click.option("--shards", is_flag=True, help="One row per stored shard (offsets, sizes, file) under each item.")
@click.option("--threads", type=click.IntRange(1, 256), default=8, show_default=True, help="Data files read at once.")
@click.option("--diff", "other", metavar="OTHER_PATH_OR_URL", default=None,
              help="Instead: list the items that differ from PATH_OR_URL to OTHER (added, removed, changed), "
              "compared by their digests without decoding anything.")
@click.option("--diff-option", "other_opts", multiple=True, metavar="KEY=VALUE",
              help="Storage option of OTHER (repeatable; default: those of -o).")
@click.option("--from-headers", is_flag=True,
              help="With --diff: compare the item headers as stored now (one small read per item) instead "
              "of the digests .metadata recorded at save.")
@storage_option
def inspect(path: str, as_json: bool, shards: bool, threads: int, other: str | None, other_opts: tuple[str, ...],
            from_headers: bool, options: tuple[str, ...]) -> None:
    """List every item: dtype, global shape, shards, codec, stored and original bytes, ratio;
    totals per dtype; the format, torch and nvCOMP versions recorded at save time. For a delta
    checkpoint: its base (save id, chain depth, where it is found) and whether each item is
    stored as a delta against it or whole.

    With --diff OTHER: which items changed from PATH_OR_URL to OTHER, by the per-item digests the
    saves recorded (or, for checkpoints saved without them, the CRC32C of each item header).

    Reads .metadata and the headers of the items only, never their data. Exits 1 when an item
    header is unreadable (run `nvdcp verify` for the full check)."""
    if other is not None:
        if shards:
            raise click.BadParameter("--shards does not apply to --diff", param_hint="'--shards'")
        _diff(path, other, as_json, threads, _storage_options(options),
              _storage_options(other_opts) if other_opts else None, not from_headers)
        return
    if other_opts or from_headers:
        flag = "--diff-option" if other_opts else "--from-headers"
        raise click.BadParameter(f"{flag} applies with --diff only", param_hint=f"'{flag}'")
    from nvdcp.inspection import inspect_checkpoint

    result = inspect_checkpoint(path, storage_options=_storage_options(options), threads=threads)
    if as_json:
        _ui.print_json(result.as_dict())
    else:
        _render_inspection(result, shards)
    if result.errors:
        for line in result.errors:
            err.print(f"[red]damaged:[/] {escape(line)}", soft_wrap=True)
        raise Failure(f"{len(result.errors)} unreadable header(s); run `nvdcp verify {path}`", EXIT_DAMAGED)


_DIFF_SOURCES = {"recorded": "digests recorded at save", "headers": "item headers read"}


def _diff(path: str, other: str, as_json: bool, threads: int, options: dict[str, Any],
          other_options: dict[str, Any] | None, use_recorded: bool) -> None:
    from nvdcp.inspection import diff_checkpoints

    result = diff_checkpoints(path, other, storage_options=options, b_storage_options=other_options, threads=threads,
                              use_recorded=use_recorded)
    if as_json:
        _ui.print_json(result.as_dict())
    else:
        out.print(f"[bold]a[/] {escape(result.a)} ({_DIFF_SOURCES[result.sources['a']]})")
        out.print(f"[bold]b[/] {escape(result.b)} ({_DIFF_SOURCES[result.sources['b']]})")
        counts = [(len(result.changed), "changed"), (len(result.added), "added"), (len(result.removed), "removed"),
                  (len(result.unknown), "not comparable"), (len(result.unchanged), "unchanged")]
        out.print("  " + ", ".join(f"{n} {what}" for n, what in counts), markup=False)
        rows = ([("changed", f, result.reasons.get(f, "")) for f in result.changed]
                + [("added", f, "only in b") for f in result.added]
                + [("removed", f, "only in a") for f in result.removed]
                + [("?", f, result.reasons.get(f, "")) for f in result.unknown])
        if rows:
            table = Table(show_edge=False, pad_edge=False)
            table.add_column("change")
            table.add_column("FQN", overflow="fold")
            table.add_column("detail", overflow="fold")
            style = {"changed": "yellow", "added": "green", "removed": "red", "?": "dim"}
            for change, fqn, detail in rows:
                table.add_row(change, escape(fqn), escape(detail), style=style[change])
            out.print()
            _print_wide(table)
        else:
            out.print("[bold green]identical[/]: every item has the same digest")
    if result.errors:
        for line in result.errors:
            err.print(f"[red]damaged:[/] {escape(line)}", soft_wrap=True)
        raise Failure(f"{len(result.errors)} unreadable header(s); run `nvdcp verify`", EXIT_DAMAGED)


def _print_wide(table: Table) -> None:
    """Print at the table's natural width even past a narrow terminal's: squeezing the columns
    would cut names and numbers (rich drops whole columns), a wrapped line loses nothing."""
    from rich.measure import Measurement

    natural = Measurement.get(out, out.options.update_width(1 << 12), table).maximum
    if natural <= out.width:
        out.print(table)
        return
    # Console.print caps its width at the console's; a wider twin writes to the same stream
    wide = Console(file=out.file, width=natural, highlight=False, force_terminal=out.is_terminal,
                   no_color=out.no_color)
    wide.print(table)


def _plural(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def _shape(shape: list[int] | None) -> str:
    return "-" if shape is None else "[" + ", ".join(str(s) for s in shape) + "]"


def _codec_cell(plane_codecs: list[str] | None, codec: str, transform: str | None) -> str:
    """The codec column: the codecs at work and on how many planes ("gdeflate+zstd (4/4 planes)"
    for a GPU delta whose top plane is Zstd's)."""
    if transform == "byteplanes" and plane_codecs:
        working = [c for c in plane_codecs if c != "none"]
        names = "+".join(dict.fromkeys(working)) or codec
        return f"{names} ({len(working)}/{len(plane_codecs)} planes)"
    return codec


def _render_inspection(result: Any, shards: bool) -> None:
    from nvdcp.inspection import Item

    saved = result.saved_with()
    kind = {"nvdcp": "nvdcp", "stock": "stock DCP (torch.save)", "mixed": "mixed nvdcp + stock"}[result.format]
    versions = ", ".join(f"v{v}" for v in saved["format_version"]) or "-"
    out.print(f"[bold]{escape(result.url)}[/]")
    lines = [
        f"  format       {kind}"
        + (f"; container {versions}" if result.format != "stock" else "")
        + (f"; DCP metadata {result.dcp_version}" if result.dcp_version else ""),
    ]
    if result.format != "stock":
        def vals(key: str) -> str:
            return ", ".join(str(v) for v in saved[key]) or "-"

        lines.append(f"  saved with   nvdcp {vals('nvdcp')}, torch {vals('torch')}, nvCOMP {vals('nvcomp')}")
    total = result.total()
    lines.append(
        f"  contents     {total.items} items in {total.shards} stored chunks, {_plural(len(result.files), 'data file')}, "
        f".metadata {human(result.metadata_bytes)}"
    )
    if result.format != "stock":
        lines.append(f"  digests      {result.digests}: {result.digest_note}")
    base = result.base
    if base is not None:
        where = base.found if base.found is not None else "NOT FOUND"
        lines.append(
            f"  delta        against save {base.save_id} of {base.location} (chain depth {base.depth}); base: {where}"
        )
        lines.append(
            f"               {total.delta_items} of {total.items} items stored as deltas "
            f"({human(total.delta_bytes)} of {human(total.stored_bytes)} stored), the rest whole"
        )
    for line in lines:
        out.print(line, markup=False)
    if base is not None and base.problem:
        err.print(f"[yellow]warning:[/] this delta checkpoint cannot be loaded: {escape(base.problem)}", soft_wrap=True)
    is_delta = base is not None or total.delta_shards > 0

    table = Table(title="Items", title_justify="left", show_edge=False, pad_edge=False)
    columns = [("FQN", "left"), ("dtype", "left"), ("shape", "left"), ("shards", "right"), ("codec", "left"),
               *([("as", "left")] if is_delta else []), ("original", "right"), ("stored", "right"), ("ratio", "right")]
    for name, justify in columns:
        table.add_column(name, justify=justify, no_wrap=name != "FQN", overflow="fold")  # type: ignore[arg-type]
    if shards:
        table.add_column("file@offset", overflow="fold")
    item: Item
    for item in result.items:
        codecs = sorted({_codec_cell(s.plane_codecs, s.codec, s.transform) for s in item.shards}) or ["-"]
        n = len(item.shards)
        sizes = {tuple(s.sizes) for s in item.shards if s.sizes is not None}
        shard_cell = f"{n} x {_shape(list(sizes.pop()))}" if n > 1 and len(sizes) == 1 else str(n)
        ratio = item.original_bytes / item.stored_bytes if item.stored_bytes else None
        table.add_row(
            escape(item.fqn), item.dtype or "bytes", _shape(item.shape), shard_cell, ", ".join(codecs),
            *([item.stored_as] if is_delta else []),
            human(item.original_bytes), human(item.stored_bytes), _ui.fmt_ratio(ratio),
            *([""] if shards else []), style="red" if any(s.error for s in item.shards) else None,
        )
        if shards:
            for s in item.shards:
                region = "whole" if s.offsets is None or s.sizes is None else (
                    "[" + ", ".join(f"{o}:{o + n}" for o, n in zip(s.offsets, s.sizes)) + "]"
                )
                r = s.original_bytes / s.stored_bytes if s.stored_bytes else None
                table.add_row(
                    f"  - {region}", "", "", "", _codec_cell(s.plane_codecs, s.codec, s.transform),
                    *(["delta" if s.delta else "full"] if is_delta else []), human(s.original_bytes), human(s.stored_bytes), _ui.fmt_ratio(r),
                    escape(f"{s.file}@{s.file_offset}"), style="dim",
                )
    out.print()
    _print_wide(table)

    by_dtype = Table(title="By dtype", title_justify="left", show_edge=False, pad_edge=False, show_footer=True)
    by_dtype.add_column("dtype", footer="total")
    by_dtype.add_column("items", justify="right", footer=str(total.items))
    by_dtype.add_column("original", justify="right", footer=human(total.original_bytes))
    by_dtype.add_column("stored", justify="right", footer=human(total.stored_bytes))
    by_dtype.add_column("ratio", justify="right", footer=_ui.fmt_ratio(total.ratio))
    for dtype, t in result.by_dtype().items():
        by_dtype.add_row(dtype, str(t.items), human(t.original_bytes), human(t.stored_bytes), _ui.fmt_ratio(t.ratio))
    out.print()
    out.print(by_dtype)


# -- verify ------------------------------------------------------------------------------------
@cli.command()
@click.argument("path", metavar="PATH_OR_URL")
@json_option
@click.option("--checksums-only", is_flag=True, help="Check headers and chunk CRC32Cs without decoding (faster).")
@click.option("--threads", type=click.IntRange(1, 256), default=None, help="Items checked at once (default: min(8, cores)).")
@progress_option
@storage_option
def verify(path: str, as_json: bool, checksums_only: bool, threads: int | None, progress: bool | None,
           options: tuple[str, ...]) -> None:
    """Check every item: header, every chunk's CRC32C, (unless --checksums-only) a full decode
    compared with .metadata, and its header against the digest the save recorded (checkpoints
    saved before nvdcp recorded digests skip that, with a note). A delta checkpoint is checked
    with its whole chain of bases: each delta item against its base item's digest, then each
    base; a base that is gone or was replaced is damage. Exits 0 when intact, 1 with the list
    of damaged items otherwise."""
    from nvdcp.dcp.any_metadata import load_any_metadata
    from nvdcp.storage import open_storage
    from nvdcp.verify import verify_checkpoint

    storage_options = _storage_options(options)
    metadata = load_any_metadata(open_storage(path, **storage_options))
    records = metadata.storage_data or {}
    if records and not any(
        str(d).startswith("nvdcp.") for info in records.values() for d in (getattr(info, "transform_descriptors", None) or ())
    ):
        raise Failure(
            f"{path} is a stock DCP checkpoint: its items carry no checksums to verify. "
            "`nvdcp convert` makes an nvdcp copy that does"
        )
    started = time.perf_counter()
    with _ui.progress_bar("verify", len(records), _ui.show_progress(progress)) as update:
        report = verify_checkpoint(
            path, decode=not checksums_only, threads=threads, storage_options=storage_options,
            progress=lambda done, total: update(done, total),
        )
    seconds = time.perf_counter() - started
    if as_json:
        _ui.print_json({**report.as_dict(), "decoded": not checksums_only, "seconds": round(seconds, 4)})
    else:
        what = "headers and chunk checksums" if checksums_only else "headers, chunk checksums and a full decode"
        for i, one in enumerate([report, *report.chain]):
            checked = what + (", save digests" if one.digests == "checked" else "")
            if one.base is not None:
                checked += ", base digests"
            label = escape(one.url) if i == 0 else f"base {escape(one.url)}"
            if not one.damaged:
                out.print(
                    f"[bold green]OK[/] {label}: {one.items} items intact "
                    f"({human(one.stored_bytes)} stored; {checked})"
                    + (f" in {seconds:.2f}s" if i == 0 and not report.chain else "")
                )
            else:
                base_gone = [d for d in one.damaged if d.item == "(base checkpoint)"]
                failed = len(one.damaged) - len(base_gone)
                problems: list[str] = [f"{failed} of {one.items} items failed"] if failed or not base_gone else []
                problems += ["its base checkpoint is gone or was replaced"] if base_gone else []
                out.print(f"[bold red]DAMAGED[/] {label}: {'; '.join(problems)}")
                for d in one.damaged:
                    out.print(f"  {d.item} in {d.file}: {d.kind}: {d.error}", soft_wrap=True, markup=False)
            if one.base is not None:
                out.print(
                    f"  delta: {one.delta_items} of {one.items} items stored as deltas against "
                    f"{one.base_found or one.base.location + ' (not found)'} (save {one.base.save_id}, "
                    f"chain depth {one.base.depth})", soft_wrap=True, markup=False,
                )
        if report.chain:
            verdict = "[bold green]chain OK[/]" if report.ok else "[bold red]chain DAMAGED[/]"
            out.print(f"{verdict}: {1 + len(report.chain)} checkpoints checked in {seconds:.2f}s")
        checksum_only = sum(len(one.checksum_only) for one in [report, *report.chain])
        if checksum_only:
            err.print(
                f"note: {checksum_only} items use a codec without a decoder here "
                "(GPU-only); their checksums were checked, not their decode"
            )
        if report.digests in ("absent", "unsupported"):
            err.print(f"note: {report.digest_note}", markup=False)
    if not report.ok:
        raise click.exceptions.Exit(EXIT_DAMAGED)


# -- convert -----------------------------------------------------------------------------------
@cli.command()
@click.argument("src", metavar="SRC")
@click.argument("dst", metavar="DST")
@click.option("--to", "to", type=click.Choice(["nvdcp", "stock", "safetensors"]), default="nvdcp", show_default=True,
              help="Output format: nvdcp (compressed), stock DCP (torch's FileSystemWriter layout) or "
              "safetensors (consolidated Hugging Face files + model.safetensors.index.json, in a local directory).")
@click.option("--codec", default="auto", show_default=True,
              help="Codec of nvdcp output: auto, zstd, gdeflate, none (ans, bitcomp need a GPU).")
@click.option("--max-memory", default="1GiB", show_default=True, callback=_size,
              help="Bytes of items in flight at once (e.g. 512MiB, 2GB).")
@click.option("--threads", type=click.IntRange(1, 64), default=2, show_default=True, help="Items converted at once.")
@click.option("--prefix", default=None, metavar="TEXT",
              help="safetensors: keep only the keys starting with TEXT (e.g. model. for the weights, not the optimizer).")
@click.option("--dtype", "dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default=None,
              help="safetensors: cast floating point tensors to this type (integer and bool tensors keep theirs).")
@click.option("--max-shard-size", default=None, callback=_size, metavar="SIZE",
              help="safetensors: bytes of tensor data per file  [default: 5GB, as save_pretrained]")
@click.option("--overwrite", is_flag=True, help="Replace a checkpoint (for safetensors: the safetensors files) at DST.")
@json_option
@progress_option
@click.option("--src-option", "src_opts", multiple=True, metavar="KEY=VALUE", help="Storage option of SRC (repeatable).")
@click.option("--dst-option", "dst_opts", multiple=True, metavar="KEY=VALUE", help="Storage option of DST (repeatable).")
def convert(src: str, dst: str, to: str, codec: str, max_memory: int, threads: int, prefix: str | None,
            dtype: str | None, max_shard_size: int | None, overwrite: bool, as_json: bool, progress: bool | None,
            src_opts: tuple[str, ...], dst_opts: tuple[str, ...]) -> None:
    """Convert SRC into DST: stock DCP -> nvdcp, nvdcp -> stock DCP (--to stock), or nvdcp ->
    nvdcp with another codec. Item by item within --max-memory; one stored chunk stays one
    stored chunk (the sharding is kept); the result loads bit-exactly, stock output with
    torch's FileSystemReader and no nvdcp installed.

    --to safetensors writes the tensors of any nvdcp or stock checkpoint, each consolidated
    from its shards, as model-0000i-of-0000K.safetensors files and model.safetensors.index.json
    (Hugging Face's layout), optionally only those under --prefix and cast to --dtype; byte
    items are skipped and listed."""
    if to != "safetensors":
        for name, value in (("--prefix", prefix), ("--dtype", dtype), ("--max-shard-size", max_shard_size)):
            if value is not None:
                raise click.BadParameter(f"{name} applies to --to safetensors only", param_hint=f"'{name}'")
    else:
        if codec != "auto":
            raise click.BadParameter("--codec applies to nvdcp output; safetensors data is uncompressed",
                                     param_hint="'--codec'")
        if dst_opts:
            raise click.BadParameter("safetensors output goes to a local directory; it takes no storage options",
                                     param_hint="'--dst-option'")
        _export_safetensors(src, dst, max_memory, threads, prefix, dtype, max_shard_size, overwrite, as_json,
                            progress, src_opts)
        return
    from nvdcp.convert import ConvertOptions, convert_checkpoint

    if to == "stock" and codec != "auto":
        raise click.BadParameter("--codec applies to nvdcp output; --to stock writes uncompressed torch.save items",
                                 param_hint="'--codec'")
    try:
        opts = ConvertOptions(to=to, codec=codec, max_memory=max_memory, threads=threads, overwrite=overwrite)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="'--codec'" if "codec" in str(exc) else None) from None
    with _ui.progress_bar("convert", 0, _ui.show_progress(progress), unit="bytes") as update:
        result = convert_checkpoint(
            src, dst, opts, src_options=_storage_options(src_opts), dst_options=_storage_options(dst_opts),
            progress=lambda done, total: update(done, total),
        )
    if as_json:
        _ui.print_json(result.as_dict())
        return
    r = result.report
    target = "stock DCP" if to == "stock" else f"nvdcp, codec {codec}"
    materialized = (
        f"  a delta checkpoint, made standalone: {_plural(result.delta_items, 'item')} rebuilt from its base "
        f"chain ({result.source_base})\n" if result.source_base is not None else ""
    )
    out.print(
        f"converted {result.source} ({result.source_format}) -> {result.destination} ({target})\n"
        + materialized +
        f"  {r.items} items, {human(r.raw_bytes)} original: {human(result.source_stored_bytes)} -> "
        f"{human(r.stored_bytes)} stored (ratio {r.ratio:.3f}) in {_plural(result.files, 'data file')}, "
        f"{r.seconds:.2f}s ({r.raw_bytes / r.seconds / 1e9 if r.seconds else 0:.2f} GB/s)\n"
        f"  phases (summed over threads): " + " ".join(f"{k}={v:.3f}s" for k, v in sorted(r.phases.items())),
        soft_wrap=True, markup=False,
    )


def _export_safetensors(src: str, dst: str, max_memory: int, threads: int, prefix: str | None, dtype: str | None,
                        max_shard_size: int | None, overwrite: bool, as_json: bool, progress: bool | None,
                        src_opts: tuple[str, ...]) -> None:
    from nvdcp.export_safetensors import DEFAULT_MAX_SHARD_SIZE, INDEX_NAME, export_safetensors

    if max_memory < 1 << 20:
        raise click.BadParameter(f"max_memory must be at least 1 MiB, got {max_memory}", param_hint="'--max-memory'")
    if max_shard_size is not None and max_shard_size < 1:
        raise click.BadParameter("must be positive", param_hint="'--max-shard-size'")
    with _ui.progress_bar("export", 0, _ui.show_progress(progress), unit="bytes") as update:
        result = export_safetensors(
            src, dst, max_memory=max_memory, max_shard_size=max_shard_size or DEFAULT_MAX_SHARD_SIZE, prefix=prefix,
            dtype=dtype, storage_options=_storage_options(src_opts), threads=threads, overwrite=overwrite,
            progress=lambda done, total: update(done, total),
        )
    if as_json:
        _ui.print_json(result.as_dict())
        return
    r = result.report
    files = result.files
    names = files[0].name if len(files) == 1 else f"{files[0].name} .. {files[-1].name}"
    lines = [
        f"exported {result.source} ({result.source_format}) -> {result.destination} (safetensors"
        + (f", {result.dtype}" if result.dtype else "") + ")",
        f"  {_plural(result.tensors, 'tensor')}, {human(result.total_size)} in {_plural(len(files), 'file')} "
        f"({names}) + {INDEX_NAME}, {r.seconds:.2f}s "
        f"({result.source_raw_bytes / r.seconds / 1e9 if r.seconds else 0:.2f} GB/s)",
    ]
    if result.prefix is not None:
        lines.append(f"  prefix {result.prefix!r}: {result.excluded} other items left out")
    if result.streamed:
        lines.append(f"  streamed chunk by chunk (larger than a quarter of --max-memory): {', '.join(result.streamed)}")
    by_reason: dict[str, list[str]] = {}
    for name, reason in result.skipped.items():
        by_reason.setdefault(reason, []).append(name)
    for reason, names_ in by_reason.items():
        more = f" and {len(names_) - 6} more" if len(names_) > 6 else ""
        lines.append(f"  skipped {_plural(len(names_), 'item')} ({reason}): {', '.join(names_[:6])}{more}")
    lines.append("  phases (summed over threads): " + " ".join(f"{k}={v:.3f}s" for k, v in sorted(r.phases.items())))
    out.print("\n".join(lines), soft_wrap=True, markup=False)


# -- bench -------------------------------------------------------------------------------------
@cli.command()
@click.argument("path", metavar="[PATH_OR_URL]", required=False)
@click.option("--codec", "codecs", multiple=True, type=click.Choice(["none", "zstd", "gdeflate", "ans", "bitcomp"]),
              help="Only these codecs (repeatable; default: all that run here).")
@click.option("--steps", type=click.IntRange(0, 10_000), default=10, show_default=True,
              help="Training steps of the reference workload (no PATH).")
@click.option("--d-model", type=click.IntRange(8, 4096), default=256, show_default=True, help="Reference model width.")
@click.option("--layers", type=click.IntRange(1, 64), default=4, show_default=True, help="Reference model depth.")
@click.option("--bf16/--no-bf16", default=True, show_default=True,
              help="Also bench a bf16 copy of the reference state's floating tensors.")
@click.option("--gpu/--no-gpu", default=None, help="Bench nvCOMP on the GPU too (default: when one is usable).")
@click.option("--threads", type=click.IntRange(1, 256), default=None, help="Codec threads (default: all cores).")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Write a PNG chart: ratio per dtype and codec, and GB/s per codec.")
@json_option
@progress_option
@storage_option
def bench(path: str | None, codecs: tuple[str, ...], steps: int, d_model: int, layers: int, bf16: bool,
          gpu: bool | None, threads: int | None, plot_path: str | None, as_json: bool, progress: bool | None,
          options: tuple[str, ...]) -> None:
    """Ratio and GB/s of every codec this machine runs, per dtype, on the CPU reference workload
    (a tiny GPT trained a few steps with AdamW) or on the checkpoint at PATH_OR_URL."""
    import nvdcp.codec_bench as bench_mod

    storage_options = _storage_options(options)
    if plot_path:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise Failure("--plot needs matplotlib: pip install 'nvdcp[cli]'") from None
    if path:
        from nvdcp.dcp.any_metadata import load_any_metadata
        from nvdcp.storage import open_storage

        load_any_metadata(open_storage(path, **storage_options))  # fail fast on a wrong path
        source: dict[str, Any] = {"name": os.path.basename(path.rstrip("/")) or path, "path": path}

        def tensors() -> Any:
            return bench_mod.checkpoint_tensors(path, storage_options)
    else:
        with err.status(f"training the reference workload ({steps} steps, d={d_model}, {layers} layers)..."):
            state = bench_mod.reference_state(steps=steps, d_model=d_model, layers=layers)
        source = {"name": "reference workload", "workload": "tiny GPT + AdamW", "steps": steps,
                  "d_model": d_model, "layers": layers, "bf16_copy": bf16}

        def tensors() -> Any:
            return bench_mod.workload_tensors(state, bf16)

    with _ui.progress_bar("bench", 0, _ui.show_progress(progress)) as update:
        result = bench_mod.run_bench(
            tensors, source, codecs=list(codecs) or None, gpu=gpu, threads=threads,
            progress=lambda done, total: update(done, total, note=""),
        )
    if plot_path:
        bench_mod.plot(result, plot_path)
    if as_json:
        payload = result.as_dict()
        if plot_path:
            payload["plot"] = plot_path
        _ui.print_json(payload)
    else:
        _render_bench(result)
        if plot_path:
            err.print(f"chart written to {plot_path}", markup=False)
    for name, why in result.skipped.items():
        err.print(f"skipped {name}: {why}", soft_wrap=True, markup=False)


def _render_bench(result: Any) -> None:
    m = __import__("nvdcp.codec_bench", fromlist=["machine"]).machine()
    src = result.source
    label = src.get("path") or f"{src['name']} ({src['steps']} steps, d={src['d_model']}, {src['layers']} layers)"
    out.print(f"[bold]codec bench[/] on {escape(label)}; {m.get('gpu') or str(m['cores']) + ' CPU cores'}")
    table = Table(show_edge=False, pad_edge=False, show_footer=False)
    for name, justify in [("codec", "left"), ("device", "left"), ("dtype", "left"), ("items", "right"),
                          ("original", "right"), ("stored", "right"), ("ratio", "right"),
                          ("encode GB/s", "right"), ("decode GB/s", "right")]:
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    totals = {(t.codec, t.device): t for t in result.totals()}
    last = None
    for r in result.rows + [None]:
        key = None if r is None else (r.codec, r.device)
        if last is not None and key != last:
            t = totals[last]
            table.add_row(t.codec, t.device, "[bold]all[/]", str(t.items), human(t.raw_bytes), human(t.stored_bytes),
                          f"[bold]{t.ratio:.3f}[/]", _gbps(t.encode_gbps), _gbps(t.decode_gbps), end_section=True)
        if r is None:
            break
        table.add_row(r.codec, r.device, r.dtype, str(r.items), human(r.raw_bytes), human(r.stored_bytes),
                      f"{r.ratio:.3f}", _gbps(r.encode_gbps), _gbps(r.decode_gbps))
        last = key
    _print_wide(table)


def _gbps(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"

"""``python -m harness report FILE.json ...``: comparison tables of saved runs.

Reads the JSON records any benchmark command wrote and prints, per record,
each variant's median time, IQR, peak extra memory and validation error,
with ratios to the reference variant (``dense`` when present). A record
holding an error entry is shown in red and makes the exit status 1; a file
that is not a JSON record is a usage error (exit status 2).
"""
from __future__ import annotations

import re

from rich.table import Table

from . import cli, firstcall, method

console = method.console()


def register(subparsers) -> None:
    p = subparsers.add_parser("report", help="print comparison tables of saved benchmark JSON", description=__doc__)
    p.add_argument("files", nargs="+", type=cli.json_record, metavar="FILE",
                   help="JSON records written by python -m harness ...")
    p.add_argument("--reference", default=None, help="variant the ratios divide by (default: dense, where present)")
    p.add_argument("--markdown", action="store_true", help="print Markdown tables (for docs/) instead of rich tables")
    p.set_defaults(func=run)


def _variants(record: dict) -> dict[str, dict]:
    """Variant name -> result dict, for records that keep them under 'variants' (dict or list)."""
    variants = record.get("variants", {})
    if isinstance(variants, list):
        variants = {v.get("name", str(k)) if isinstance(v, dict) else str(k): v for k, v in enumerate(variants)}
    return {k: v for k, v in variants.items() if isinstance(v, dict)} if isinstance(variants, dict) else {}


def _fmt(value, spec: str) -> str:
    return "" if value is None else format(value, spec)


def table_for(record: dict, title: str, reference: str) -> tuple[Table, bool]:
    variants = _variants(record)
    ref = variants.get(reference, {})
    ref_time = (ref.get("summary") or {}).get("median")
    ref_mem = ref.get("peak_extra_bytes")
    table = Table(title=title)
    for col in ("variant", "median s", "IQR s", f"x {reference} time", "peak MiB", f"x {reference} mem", "max rel err", "note"):
        table.add_column(col, justify="left" if col in ("variant", "note") else "right")
    failed = False
    for name, v in variants.items():
        error = v.get("error")
        if error:
            failed = failed or not str(error).startswith("not applicable")
            table.add_row(name, "", "", "", "", "", "", f"[red]{error[:80]}[/red]")
            continue
        median = (v.get("summary") or {}).get("median")
        mem = v.get("peak_extra_bytes")
        errors = [e for e in (v.get("validation") or {}).values() if isinstance(e, (int, float))]
        table.add_row(
            name,
            _fmt(median, ".3f"),
            _fmt((v.get("summary") or {}).get("iqr"), ".3f"),
            _fmt(median / ref_time if median is not None and ref_time else None, ".2f"),
            _fmt(mem / 2**20 if mem is not None else None, ".1f"),
            _fmt(mem / ref_mem if mem is not None and ref_mem else None, ".4f"),
            _fmt(max(errors) if errors else None, ".1e"),
            "",
        )
    return table, failed


def markdown(table: Table) -> str:
    """A rich table as a Markdown pipe table (markup such as [red] dropped)."""
    cells = [[str(c) for c in col._cells] for col in table.columns]
    strip = lambda text: re.sub(r"\[/?[a-z ]+\]", "", text).replace("|", "/")  # noqa: E731
    lines = ["| " + " | ".join(str(col.header) for col in table.columns) + " |",
             "|" + "---|" * len(table.columns)]
    lines += ["| " + " | ".join(strip(col[r]) for col in cells) + " |" for r in range(table.row_count)]
    return "\n".join(lines)


def run(args) -> int:
    if args.reference is not None:
        lacking = [path for path, record in args.files if _variants(record) and args.reference not in _variants(record)]
        if lacking:
            raise cli.UsageError("--reference", f"no variant {args.reference!r} in {', '.join(lacking)}")
    status = 0
    for path, record in args.files:
        config = record.get("config") if isinstance(record.get("config"), dict) else {}
        title = f"{path}: {record.get('command', '?')} " + " ".join(f"{k}={v}" for k, v in config.items())
        if record.get("interrupted"):
            title += " (interrupted: partial)"
        if isinstance(record.get("first_calls"), list):  # python -m harness operators --first-call
            table = firstcall.table(record, title)
            failed = any(isinstance(r, dict) and r.get("error") for r in record["first_calls"])
        elif not _variants(record):
            console.print(f"[yellow]{path}: no variant results in this record[/yellow]")
            continue
        else:
            table, failed = table_for(record, title, args.reference or "dense")
        if args.markdown:
            print(f"**{title}**\n\n{markdown(table)}\n")
        else:
            console.print(table)
        status = status or int(failed)
    return status

"""Render the results tables of the docs from their JSON records (``docs/results/*.json``): the one source of every
measured number in README.md and docs/.

A page marks where a record goes with two HTML comments; everything between them is generated::

    <!-- results: e2e_2048 -->
    ...
    <!-- /results -->

The block is the record's provenance line (command, date, GPU, torch version, commit, other software, a link to the
JSON file), its table (``columns`` and ``rows``, cells as stored) and its ``notes`` (one paragraph each).

A record (what ``benchmarks/_util.write_record`` writes from a benchmark run, then copied into ``docs/results/``)::

    {"name": ..., "command": ... (or a list of commands), "date": ..., "gpu": ..., "torch": ..., "commit": ...,
     "software": "torchao 0.17.0" (optional), "columns": [...], "rows": [[cell, ...], ...], "notes": [...] (optional)}

Usage::

    python benchmarks/render.py           # rewrite the marked blocks of README.md and docs/*.md
    python benchmarks/render.py --check   # exit 1 and name the pages whose blocks differ from the records
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
BLOCK = re.compile(r"(<!-- results: (?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- /results -->)", re.S)
REQUIRED = ("name", "command", "date", "gpu", "torch", "commit", "columns", "rows")


def load_records(results: Path = RESULTS) -> dict:
    """``{name: record}`` of every table record in ``results`` (files with ``columns``; other JSON files, such as a
    run's loss curves, are data behind a figure). Raises ``ValueError`` naming a record that lacks a field, has a row
    of the wrong width or whose name differs from its file name."""
    out = {}
    for p in sorted(results.glob("*.json")):
        rec = json.loads(p.read_text())
        if not isinstance(rec, dict) or "columns" not in rec:
            continue
        missing = [k for k in REQUIRED if not rec.get(k)]
        if missing:
            raise ValueError(f"{p.name}: missing {missing}")
        if rec["name"] != p.stem:
            raise ValueError(f"{p.name}: name {rec['name']!r} differs from the file name")
        bad = [i for i, r in enumerate(rec["rows"]) if len(r) != len(rec["columns"])]
        if bad:
            raise ValueError(f"{p.name}: rows {bad} do not have {len(rec['columns'])} cells")
        out[rec["name"]] = rec
    return out


def render(rec: dict, page: Path) -> str:
    """The generated block of ``rec`` for ``page`` (the JSON link is relative to the page)."""
    link = os.path.relpath(RESULTS / f"{rec['name']}.json", page.parent)
    cmds = rec["command"] if isinstance(rec["command"], list) else [rec["command"]]
    prov = ["; ".join(f"`{c}`" for c in cmds), rec["date"], rec["gpu"], f"torch {rec['torch']}"]
    if rec.get("software"):
        prov.append(rec["software"])
    prov.append(f"commit {rec['commit']}")
    lines = [" · ".join(prov) + f" ([{rec['name']}.json]({link}))", ""]
    lines.append("| " + " | ".join(rec["columns"]) + " |")
    lines.append("|" + "---|" * len(rec["columns"]))
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rec["rows"]]
    for note in rec.get("notes", []):
        lines += ["", note]
    return "\n".join(lines) + "\n"


def pages() -> list:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def rendered(text: str, page: Path, records: dict) -> str:
    def sub(m):
        name = m.group("name")
        if name not in records:
            raise KeyError(f"{page.relative_to(ROOT)}: no record docs/results/{name}.json")
        return m.group(1) + render(records[name], page) + m.group(4)

    return BLOCK.sub(sub, text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 when a page is out of date")
    args = ap.parse_args(argv)
    records = load_records()
    stale = []
    for page in pages():
        text = page.read_text()
        new = rendered(text, page, records)
        if new != text:
            stale.append(str(page.relative_to(ROOT)))
            if not args.check:
                page.write_text(new)
    if args.check and stale:
        print("out of date with docs/results (run python benchmarks/render.py): " + ", ".join(stale))
        return 1
    print(("rendered: " + ", ".join(stale)) if stale and not args.check else "up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())

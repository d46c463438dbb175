"""One source for every number: the results tables of the docs are rendered from ``docs/results/*.json``
(``benchmarks/render.py``), every record names its command, date, GPU, torch version and commit, and a speed-up
(``1.135x``) quoted anywhere in README.md or docs/*.md, or a number in a results table (a table with a ``ms``, ``µs``,
``GiB`` or ``vs bf16`` column), has a value in a record behind it: the same digits, or a record value with more
digits that rounds to it."""
from __future__ import annotations

import json
import re
import sys
from decimal import ROUND_HALF_EVEN, ROUND_HALF_UP, Decimal
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import render  # noqa: E402

NUM = re.compile(r"\d[\d,]*(?:\.\d+)?")
SPEEDUP = re.compile(r"(?<![\w.])(\d+\.\d+)(?:\s*[–-]\s*(\d+\.\d+))?x\b")
RESULT_COLUMN = re.compile(r"\bms\b|µs|GiB|vs bf16|tokens/s")


def _pages():
    return render.pages()


def _record_numbers(speedups: bool = False) -> set:
    """Every number (as written, thousands separators dropped) in the records' cells and notes; with ``speedups``
    only those written as a speed-up (``1.135x``)."""
    out = set()
    for rec in render.load_records().values():
        texts = [str(c) for row in rec["rows"] for c in row] + list(rec.get("notes", []))
        for t in texts:
            if speedups:
                out.update(q for m in SPEEDUP.finditer(t) for q in m.groups() if q)
            else:
                out.update(n.replace(",", "") for n in NUM.findall(t))
    return out


def _backed(q: str, numbers: set) -> bool:
    """``q`` is in a record as written, or a record number with more decimals rounds to it (half up or half even)."""
    q = q.replace(",", "")
    if q in numbers:
        return True
    dq = Decimal(q)
    places = Decimal(1).scaleb(dq.as_tuple().exponent)
    for n in numbers:
        d = Decimal(n)
        if d.as_tuple().exponent < dq.as_tuple().exponent and (
                d.quantize(places, ROUND_HALF_UP) == dq or d.quantize(places, ROUND_HALF_EVEN) == dq):
            return True
    return False


def _outside_blocks(text: str) -> str:
    """The page without its generated blocks (those are compared with the records as a whole)."""
    return render.BLOCK.sub("", text)


def _without_code(text: str) -> str:
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def test_records_carry_provenance():
    recs = render.load_records()
    assert {"e2e_2048", "e2e_readme", "e2e_4096", "e2e_8192", "train_main", "serve", "moe", "linear"} <= set(recs)
    for name, rec in recs.items():
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", rec["date"]), name
        assert rec["gpu"] and rec["torch"] and rec["commit"], name
        cmds = rec["command"] if isinstance(rec["command"], list) else [rec["command"]]
        assert all("benchmarks/" in c or "examples/" in c for c in cmds), name


def test_pages_match_their_records():
    """Each marked block equals what ``benchmarks/render.py`` renders from its record (run it after a new record)."""
    recs = render.load_records()
    stale = [str(p.relative_to(ROOT)) for p in _pages() if render.rendered(p.read_text(), p, recs) != p.read_text()]
    assert not stale, f"out of date with docs/results (run python benchmarks/render.py): {stale}"


def test_every_quoted_speedup_has_a_record():
    numbers = _record_numbers(speedups=True)
    orphans = []
    for page in _pages():
        text = _without_code(_outside_blocks(page.read_text()))
        for m in SPEEDUP.finditer(text):
            for q in filter(None, m.groups()):
                if not _backed(q, numbers):
                    orphans.append(f"{page.relative_to(ROOT)}: {m.group(0)}")
    assert not orphans, f"speed-ups with no record in docs/results: {orphans}"


def test_every_number_of_a_results_table_has_a_record():
    numbers = _record_numbers()
    orphans = []
    for page in _pages():
        lines = _outside_blocks(page.read_text()).split("\n")
        for i, line in enumerate(lines):
            if not (line.startswith("|") and i + 1 < len(lines) and lines[i + 1].startswith("|---")):
                continue
            cols = [c.strip() for c in line.strip().strip("|").split("|")]
            j = i + 2
            while j < len(lines) and lines[j].startswith("|"):
                cells = [c.strip() for c in lines[j].strip().strip("|").split("|")]
                for col, c in zip(cols, cells):
                    if RESULT_COLUMN.search(col) or RESULT_COLUMN.search(c) or SPEEDUP.search(c):
                        for q in NUM.findall(_without_code(c)):
                            if not _backed(q, numbers):
                                orphans.append(f"{page.relative_to(ROOT)}: {q} in {lines[j][:60]}")
                j += 1
    assert not orphans, f"results-table numbers with no record in docs/results: {orphans}"


def test_the_check_can_fail(tmp_path):
    """The matching is not vacuous: a made-up speed-up or table cell is an orphan, a rounded record value is not."""
    numbers, speedups = _record_numbers(), _record_numbers(speedups=True)
    # a record value, as written and rounded to one decimal less, is backed (taken from the records: any will do)
    three = sorted(q for q in speedups if re.fullmatch(r"\d\.\d{3}", q))
    assert three, "no speed-up with 3 decimals in the records"
    q = three[0]
    rounded = str(Decimal(q).quantize(Decimal("0.01"), ROUND_HALF_UP))
    assert _backed(q, speedups) and _backed(rounded, speedups)
    ms = sorted(n for n in numbers if re.fullmatch(r"\d{2,3}\.\d{2}", n))
    assert ms and _backed(ms[0], numbers) and _backed(str(Decimal(ms[0]).quantize(Decimal("0.1"), ROUND_HALF_UP)), numbers)
    assert not _backed("987.654", numbers)
    made_up = next(f"{v / 1000:.3f}" for v in range(1001, 9999) if not _backed(f"{v / 1000:.3f}", speedups))
    assert not _backed(made_up, speedups)
    for orphan in ("0.917", "0.913", "1.256", "1.333"):  # numbers with no record behind them
        assert not _backed(orphan, speedups), orphan


def test_render_rejects_a_record_without_provenance(tmp_path):
    rec = json.loads((ROOT / "docs" / "results" / "linear.json").read_text())
    del rec["commit"]
    (tmp_path / "linear.json").write_text(json.dumps(rec))
    with pytest.raises(ValueError, match="missing \\['commit'\\]"):
        render.load_records(tmp_path)

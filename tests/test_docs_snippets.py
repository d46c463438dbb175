"""Every ```python block of README.md and docs/*.md runs as written, on the CPU (the device comes from the
environment: ``"cuda" if torch.cuda.is_available() else "cpu"``; no block hard-codes ``"cuda"``).

The blocks of one page run in order, in one namespace, in a fresh Python process whose working directory is a
temporary directory and whose import path starts with the checkout (so ``from examples.llama import ...`` works as
it does from the checkout), like a notebook: a later block may use what an earlier one defined. ```bash blocks are
not run.

An HTML comment on the line right before a block marks it:

* ``<!-- needs: gpu ... -->``, ``<!-- needs: download ... -->``, ``<!-- needs: torchrun ... -->``: not run here
  (a GPU block runs where CUDA is available, unless its comment says ``by hand``: a crash reproducer);
* ``<!-- needs: torchtitan -->``: runs where torchtitan is installed with its dependencies (with
  ``FP8TENSOR_REQUIRE_TORCHTITAN=1`` a missing torchtitan is an error; CI installs it without its dependencies,
  and its config registry imports tensorboard);
* ``<!-- raises: Name -->``: a reproducer of a PyTorch bug; it must raise ``Name`` (any exception whose type name
  or message contains it; ``A | B``: either) on the torch the page was checked with (2.13); on other versions it may run clean or fail
  differently, but never with an error of the snippet itself (``NameError``, ``ImportError``, ``SyntaxError``).
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.S | re.M)
MARK = re.compile(r"<!--\s*(needs|raises):\s*(.*?)\s*-->\s*$")
NEEDS = ("gpu", "download", "torchrun", "torchtitan")
SNIPPET_ERRORS = ("NameError", "ImportError", "ModuleNotFoundError", "SyntaxError")

DRIVER = r'''
import json, sys, traceback
blocks = json.load(open(sys.argv[1]))
ns = {"__name__": "__main__"}
for b in blocks:
    try:
        exec(compile(b["code"], b["where"], "exec"), ns)
        print(json.dumps({"where": b["where"], "raised": None}), flush=True)
    except BaseException as e:
        if not b["raises"]:
            traceback.print_exc()
            sys.exit(1)
        print(json.dumps({"where": b["where"], "raised": type(e).__name__ + ": " + str(e)[:500]}), flush=True)
'''


def blocks(page: Path) -> list:
    """``[(line, code, marker kind, marker text)]`` of the page's python blocks."""
    text = page.read_text()
    out = []
    for m in FENCE.finditer(text):
        if m.group(1) != "python":
            continue
        line = text.count("\n", 0, m.start()) + 1
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = MARK.search(before)
        out.append((line, m.group(2), mark.group(1) if mark else None, mark.group(2) if mark else ""))
    return out


def _skip_reason(kind: str, what: str):
    if kind != "needs":
        return None
    need = what.split()[0].rstrip(",;:(")
    assert need in NEEDS, f"unknown marker 'needs: {what}' (known: {NEEDS})"
    if need == "gpu":
        return None if torch.cuda.is_available() and "by hand" not in what else f"needs: {what}"
    if need == "torchtitan":
        if importlib.util.find_spec("torchtitan") is None:
            assert os.environ.get("FP8TENSOR_REQUIRE_TORCHTITAN") != "1", "torchtitan is required but not installed"
            return "needs: torchtitan (not installed)"
        if importlib.util.find_spec("tensorboard") is None:  # CI installs torchtitan without its dependencies
            return "needs: torchtitan with its dependencies (tensorboard: torchtitan's config registry imports it)"
        return None
    return f"needs: {what}"


PAGES_WITH_CODE = [p for p in PAGES if blocks(p)]


def test_pages_have_python_blocks_and_markers_are_known():
    assert {p.name for p in PAGES_WITH_CODE} >= {"README.md", "cuda_graphs.md", "serving.md", "tp.md"}
    for page in PAGES:
        for line, code, kind, what in blocks(page):
            if kind == "needs":
                assert what.split()[0].rstrip(",;:(") in NEEDS, f"{page.name}:{line}: unknown marker {what!r}"


def test_no_block_hard_codes_cuda():
    for page in PAGES:
        for line, code, kind, what in blocks(page):
            if kind == "needs" and what.startswith("gpu"):
                continue
            rest = code.replace('"cuda" if torch.cuda.is_available()', "").replace('== "cuda"', "")
            assert '"cuda"' not in rest and ".cuda()" not in rest, f"{page.name}:{line} hard-codes CUDA"


@pytest.mark.parametrize("page", PAGES_WITH_CODE, ids=lambda p: p.name)
def test_page_blocks_run_as_written(page, tmp_path):
    run, skipped = [], []
    for line, code, kind, what in blocks(page):
        reason = _skip_reason(kind, what)
        where = f"{page.relative_to(ROOT)}:{line}"
        if reason:
            skipped.append(f"{where} ({reason})")
            continue
        run.append({"where": where, "code": code, "raises": what if kind == "raises" else ""})
    if not run:
        pytest.skip("every block is marked: " + "; ".join(skipped))
    for mod in ("transformers", "safetensors"):  # the examples' extra (the README's install); absent in bare venvs
        if re.search(rf"^\s*(from|import) {mod}\b", "\n".join(b["code"] for b in run), re.M):
            pytest.importorskip(mod, reason=f"{page.name} imports {mod} (pip install -e '.[examples]')")
    (tmp_path / "driver.py").write_text(DRIVER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONWARNINGS="ignore")
    # the page's blocks in one process; a bug reproducer alone in a process of its own, as a user would run it
    groups = [[b for b in run if not b["raises"]]] + [[b] for b in run if b["raises"]]
    results = {}
    for i, group in enumerate(g for g in groups if g):
        (tmp_path / f"blocks{i}.json").write_text(json.dumps(group))
        proc = subprocess.run([sys.executable, str(tmp_path / "driver.py"), str(tmp_path / f"blocks{i}.json")],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"a block failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        got = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"where"')]
        assert [r["where"] for r in got] == [b["where"] for b in group], proc.stdout[-3000:]
        results.update((r["where"], r) for r in got)
    results = [results[b["where"]] for b in run]
    for b, r in zip(run, results):
        if b["raises"]:
            checked = torch.__version__.split("+")[0] == "2.13.0"
            if r["raised"] is None:
                assert not checked, f"{b['where']}: the documented PyTorch bug no longer reproduces; update the page"
            elif checked:  # "A | B": either
                assert any(alt.strip() in r["raised"] for alt in b["raises"].split("|")), \
                    f"{b['where']}: raised {r['raised']!r}, documented {b['raises']!r}"
            else:  # another torch may fail differently, but never for a reason of the snippet's own
                assert r["raised"].split(":")[0] not in SNIPPET_ERRORS, f"{b['where']}: {r['raised']}"
    print("not run:", skipped)

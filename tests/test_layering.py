"""Package structure: every module imports only from the layers below it, and the op table takes each op once.

The layer order is the one of ``docs/design.md`` ("Map of the package"). Imports are read with ``ast`` at any
nesting level (a function-level import counts as much as a top-level one), so a cycle cannot hide in a function.
"""
from __future__ import annotations

import ast
import pathlib

import pytest
import torch

import fp8tensor
from fp8tensor.subclass.tensor import OP_TABLE, implements

PKG = pathlib.Path(fp8tensor.__file__).parent

# Bottom to top: a folder per layer, in it the modules in their order. A module imports only modules of strictly
# lower rows (modules of one row are independent); a folder's rows all lie above the rows of the folders before it.
LAYERS = [
    ("core", [["compat", "capture", "settings"]]),
    ("numerics", [["kernels"], ["quantize"], ["fsdp_payload"]]),
    ("subclass", [["tensor"], ["ops"], ["gemm"]]),
    ("training", [["recipes", "graphs"], ["linear"], ["grouped"], ["master"]]),
    ("distributed", [["fsdp_state", "collectives", "parallel"]]),
    ("conversion", [["checkpoint", "export"], ["modules"], ["convert"]]),
    ("", [["__init__"], ["torchtitan"]]),  # the public API; the optional torchtitan integration (imports torchtitan)
]
ROWS = [[f"{folder}.{m}" if folder else m for m in row] for folder, rows in LAYERS for row in rows]
LAYER_OF = {m: i for i, row in enumerate(ROWS) for m in row}


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(PKG).with_suffix("")
    return ".".join(rel.parts)


def _modules() -> dict:
    """Dotted name (``training.linear``; ``__init__`` for the package's) -> path, folders' ``__init__`` excluded."""
    return {_module_name(p): p for p in PKG.rglob("*.py") if not (p.name == "__init__.py" and p.parent != PKG)}


def _package_imports(path: pathlib.Path, base: pathlib.Path = None) -> set[str]:
    """Dotted names of the fp8tensor modules that ``path`` imports, anywhere in the file (``base``: the package root
    ``path`` lies in, for files outside the package)."""
    base = base or PKG
    here = list(path.relative_to(base).parent.parts)  # the folder of ``path`` inside the package
    mods = set(_modules()) | {"__init__"}
    out = set()

    def add(target: list, names):
        dotted = ".".join(target)
        if dotted in mods:
            out.add(dotted)
            return
        for a in names:  # from <package> import x: x is a module of that package, or a name of its __init__
            sub = ".".join(target + [a.name])
            out.add(sub if sub in mods else (dotted + ".__init__" if dotted else "__init__"))

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0:
                parts = (node.module or "").split(".")
                if parts[0] != "fp8tensor":
                    continue
                add(parts[1:], node.names)
            else:
                if node.level - 1 > len(here):
                    raise AssertionError(f"{path.name}: import from above the package: {ast.unparse(node)}")
                target = here[:len(here) - (node.level - 1)] + ([*node.module.split(".")] if node.module else [])
                add(target, node.names)
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == "fp8tensor":
                    out.add(".".join(parts[1:]) or "__init__")
    return {m.removesuffix(".__init__") if m.endswith(".__init__") else m for m in out}


def test_every_module_has_a_layer():
    assert set(_modules()) == set(LAYER_OF)


def test_every_layer_is_a_folder():
    for folder, _ in LAYERS:
        if folder:
            assert (PKG / folder / "__init__.py").read_text().startswith('"""'), f"{folder}/__init__.py: no docstring"


@pytest.mark.parametrize("module", sorted(LAYER_OF))
def test_imports_only_go_down(module):
    imported = _package_imports(_modules()[module])
    folders = {f for f, _ in LAYERS if f}
    wrong = sorted(m for m in imported if m not in folders and LAYER_OF.get(m, len(ROWS)) >= LAYER_OF[module]
                   and m != module)
    assert not wrong, f"fp8tensor/{module}.py imports {wrong}, which are not below it ({ROWS})"


def test_kernels_import_only_core():
    # the kernels know nothing of the package but its one door to torch's version-dependent state and the capture
    # bookkeeping (a captured graph's pinned tables live as long as the graph)
    assert _package_imports(PKG / "numerics" / "kernels.py") <= {"core.compat", "core.capture"}


def test_import_scanner_sees_nested_and_absolute_imports(tmp_path):
    # The scanner itself must not be blind: a function-level relative import and an absolute one are both found.
    (tmp_path / "training").mkdir()
    f = tmp_path / "training" / "m.py"
    f.write_text("def f():\n    from ..conversion.convert import x\n    import fp8tensor.training.master\n"
                 "    from . import linear\n    from ..subclass import gemm\n")
    assert _package_imports(f, tmp_path) == {"conversion.convert", "training.master", "training.linear",
                                             "subclass.gemm"}


def test_second_registration_of_an_op_raises():
    op = torch.ops.aten.mm.default
    before = OP_TABLE[op]

    def other(func, args, kwargs):  # pragma: no cover - never registered
        raise AssertionError

    with pytest.raises(RuntimeError, match="already has a handler"):
        implements([op])(other)
    assert OP_TABLE[op] is before


def test_registration_is_all_or_nothing_per_op():
    # A new op registers; registering it again (from any module) is refused and keeps the first handler.
    op = torch.ops.aten.sgn.default
    assert op not in OP_TABLE

    def first(func, args, kwargs):
        return "first"

    try:
        implements([op])(first)
        with pytest.raises(RuntimeError, match=str(op)):
            implements([op])(lambda func, args, kwargs: "second")
        assert OP_TABLE[op] is first
    finally:
        OP_TABLE.pop(op, None)


def test_only_quantize_imports_the_kernels():
    """``quantize.py`` is the one entry point to quantization: no other module reaches the kernels directly."""
    users = sorted(m for m, p in _modules().items() if "numerics.kernels" in _package_imports(p))
    assert users == ["numerics.quantize"], users


def test_custom_ops_live_in_one_module():
    """Every ``fp8tensor::`` op (``torch.library`` definitions, ``custom_op`` / ``triton_op``) is registered in
    ``quantize.py``."""
    registering = set()
    for m, p in _modules().items():
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.Attribute) and node.attr in ("custom_op", "triton_op", "Library", "define"):
                registering.add(m)
    assert registering <= {"numerics.quantize"}, sorted(registering)

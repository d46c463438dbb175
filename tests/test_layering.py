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
from fp8tensor.tensor import OP_TABLE, implements

PKG = pathlib.Path(fp8tensor.__file__).parent

# Bottom to top. A module may import only modules of strictly lower layers (modules of one layer are independent).
LAYERS = [
    ["compat", "capture", "settings"],  # which CUDA-graph capture is running; the library's settings
    ["kernels"],
    ["quantize"],
    ["fsdp"],  # the FSDP2 all-gather payload, on plain qdata / scale tensors
    ["tensor"],
    ["ops"],
    ["gemm"],
    ["recipes", "checkpoint"],  # recipes; the plain fp8 checkpoint layout (safetensors / Hugging Face)
    ["linear"],
    ["grouped"],  # fp8 grouped GEMMs of expert weights (torch._grouped_mm)
    ["master"],
    ["fsdp_state", "collectives", "parallel"],
    ["export"],  # torch.export of tensor-parallel fp8 models refused early
    ["modules"],  # the classes of converted modules, the class and parameter swaps, their state-dict hooks
    ["convert", "graphs"],
    ["__init__"],
    ["torchtitan"],  # optional integration (imports torchtitan when present); nothing in the package imports it
]
LAYER_OF = {m: i for i, layer in enumerate(LAYERS) for m in layer}


def _package_imports(path: pathlib.Path) -> set[str]:
    """Names of the fp8tensor modules that ``path`` imports, anywhere in the file."""
    modules = {p.stem for p in PKG.glob("*.py")}
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0 and not (node.module or "").startswith("fp8tensor"):
                continue
            if node.level > 1:
                raise AssertionError(f"{path.name}: import from above the package: {ast.unparse(node)}")
            base = (node.module or "") if node.level else (node.module or "").removeprefix("fp8tensor").lstrip(".")
            if base:
                out.add(base.split(".")[0])
            else:  # from . import x / from fp8tensor import x: x may be a module or a name of __init__
                out.update(a.name if a.name in modules else "__init__" for a in node.names)
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == "fp8tensor":
                    out.add(parts[1] if len(parts) > 1 else "__init__")
    return out


def test_every_module_has_a_layer():
    assert {p.stem for p in PKG.glob("*.py")} == set(LAYER_OF)


@pytest.mark.parametrize("module", sorted(LAYER_OF))
def test_imports_only_go_down(module):
    imported = _package_imports(PKG / f"{module}.py")
    wrong = sorted(m for m in imported if LAYER_OF.get(m, len(LAYERS)) >= LAYER_OF[module] and m != module)
    assert not wrong, f"fp8tensor/{module}.py imports {wrong}, which are not below it ({LAYERS})"


def test_kernels_import_only_compat():
    # the kernels know nothing of the package but its one door to torch's version-dependent state
    assert _package_imports(PKG / "kernels.py") <= {"compat"}


def test_import_scanner_sees_nested_and_absolute_imports(tmp_path):
    # The scanner itself must not be blind: a function-level relative import and an absolute one are both found.
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from .convert import x\n    import fp8tensor.master\n    from . import gemm\n")
    assert _package_imports(f) == {"convert", "master", "gemm"}


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
    users = sorted(p.stem for p in PKG.glob("*.py") if "kernels" in _package_imports(p))
    assert users == ["quantize"], users


def test_custom_ops_live_in_one_module():
    """Every ``fp8tensor::`` op (``torch.library`` definitions, ``custom_op`` / ``triton_op``) is registered in
    ``quantize.py``."""
    registering = set()
    for p in PKG.glob("*.py"):
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.Attribute) and node.attr in ("custom_op", "triton_op", "Library", "define"):
                registering.add(p.stem)
    assert registering <= {"quantize"}, sorted(registering)

"""No process-wide mutable state that changes a result or pins memory without bound.

Every module-level mutable object of ``fp8tensor/`` (a dict, list or set made at module level, a weak dictionary, a
thread-local, a name rebound with ``global``) is listed in :data:`STATE` with why it is harmless: settings the user
sets on purpose, registrations made at import, memos of pure functions (same inputs, same answer), bounded caches
keyed by everything their value depends on, and buffers a CUDA graph reads. A new one fails this test until it is
listed (or made immutable); a listed one that is gone fails too, so the list stays the true inventory.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

import fp8tensor
from fp8tensor.numerics import kernels

PKG = pathlib.Path(fp8tensor.__file__).parent

#: ``"path:name"`` -> why it cannot change a result nor pin memory without bound.
STATE = {
    "core/settings.py:_global": "the process-wide settings, changed only by set_config (the documented knob)",
    "core/settings.py:_local": "this thread's config blocks and its scopes not yet entered",
    "core/capture.py:_generation": "a counter naming captures (a cache key), never reused",
    "core/capture.py:_local": "a weak reference to this thread's graph_step capture in progress",
    "subclass/tensor.py:OP_TABLE": "the op table, filled by registrations at import",
    "subclass/tensor.py:_WARNED_OPS": "op names already warned about (warnings only; at most one per aten op)",
    "training/master.py:_PRESERVE": "ops whose results stay masters, registered at import (keep_master_through)",
    "numerics/kernels.py:_LAUNCHERS": "one launcher per Triton kernel of the package",
    "numerics/kernels.py:_TABLES": "device copies of kernel argument tables keyed by device, stream and their whole "
                                   "content (immutable, never wrong); at most 256, then cleared",
    "numerics/kernels.py:_CAPTURED_TABLES": "pinned tables read by CUDA graphs captured outside graph_step, whose end "
                                            "fp8tensor cannot see; one per distinct content (graph_step's own live "
                                            "with its graph)",
    "numerics/kernels.py:_SM_COUNT": "each device's SM count (a hardware fact)",
    "numerics/kernels.py:_ROW_PLANS": "the row-wise kernel's tiles per row width, a pure function of the width and "
                                      "the read-only tile table (the same bits for any); at most 4096 widths",
    "numerics/kernels.py:_ROW_CONSTS": "the row-wise kernel's constexprs, a pure function of (K, fp8 dtype, scale "
                                       "floor, multipliers, groups) and the read-only tile table; at most 4096, then "
                                       "cleared",
    "numerics/kernels.py:_W8_PLANS": "launch plans of the decode GEMM, a pure function of (device, M, N, K) and the "
                                     "read-only tile table; at most 4096, then cleared",
    "numerics/kernels.py:_W8_LAUNCHES": "the decode GEMM's launch arguments besides its tensors (grid, split, "
                                        "constexprs), a pure function of (device, M, N, K, dtype, bias, fp8 x, one "
                                        "launch) and "
                                        "the read-only tile table; at most 4096, then cleared",
    "numerics/kernels.py:_W8_EAGER": "the eager decode GEMM's plan (output shape, M, N, K, launch arguments), a "
                                     "pure function of (x shape, N, dtype, device, bias, one launch, the output "
                                     "dtype of an fp8 x) and the read-only tile "
                                     "table, stored after a call of that key passed its checks; at most 4096, then "
                                     "cleared",
    "numerics/kernels.py:_INT_CLASSES": "Triton's specialization class of an integer launch argument, a pure function "
                                        "of its value; at most 4096 entries",
    "numerics/fsdp_payload.py:_GROUP_OF": "FSDP2 group of a sharded tensor, keyed weakly by the tensor",
    "numerics/fsdp_payload.py:_FSDP_PARAM_OF": "FSDP2 parameter of a sharded tensor, keyed weakly by the tensor",
    "conversion/modules.py:_PLAIN_PARAMETERS": "whether a module class has a class attribute named weight or bias "
                                                "(a fact about the class); eager only, never read or written under "
                                                "torch.compile (a guard on it recompiled the first graph)",
    "conversion/modules.py:_CONVERTED": "the converted class of each (mixin, module class) pair, made once",
}

_MUTABLE_CALLS = {"dict", "set", "list", "bytearray", "OrderedDict", "defaultdict", "deque", "local",
                  "WeakIdKeyDictionary", "WeakKeyDictionary", "WeakValueDictionary", "WeakSet"}


def _mutable_state(path: pathlib.Path) -> set[str]:
    """Module-level names of ``path`` bound to a mutable container, and names rebound through ``global``."""
    tree = ast.parse(path.read_text(), str(path))
    names = set()
    mutable_calls = _MUTABLE_CALLS | {  # and the module's own classes derived from threading.local
        node.name for node in tree.body if isinstance(node, ast.ClassDef)
        and any((getattr(b, "id", None) or getattr(b, "attr", None)) == "local" for b in node.bases)}
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            v = node.value
            call = getattr(v.func, "id", None) or getattr(v.func, "attr", None) if isinstance(v, ast.Call) else None
            if isinstance(v, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)) \
                    or call in mutable_calls:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names |= {t.id for t in targets if isinstance(t, ast.Name)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            names |= set(node.names)
    return names - {"__all__"}


def test_module_level_mutable_state_is_the_listed_inventory():
    found = {f"{p.relative_to(PKG).as_posix()}:{n}" for p in sorted(PKG.rglob("*.py")) for n in _mutable_state(p)}
    new, gone = sorted(found - set(STATE)), sorted(set(STATE) - found)
    assert not new, f"module-level mutable state not listed in STATE (say why it is harmless, or make it " \
                    f"immutable): {new}"
    assert not gone, f"listed in STATE but no longer there (remove): {gone}"


def test_the_scanner_sees_containers_weak_maps_thread_locals_and_globals(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import threading, weakref\nclass L(threading.local):\n    x = None\nG = L()\nA = {}\n"
                 "B: dict = dict()\nC = weakref.WeakKeyDictionary()\nD = threading.local()\nE = (1, 2)\nF = frozenset({1})\n_n = 0\ndef g():\n    global _n\n    _n += 1\n"
                 "__all__ = ['g']\n")
    assert _mutable_state(f) == {"A", "B", "C", "D", "G", "_n"}


@pytest.mark.parametrize("table", ["CONFIG", "ROW_CONFIG", "TRANSPOSE_CONFIG", "GROUP_COL_CONFIG", "W8_MM_CONFIG"])
def test_kernel_tile_tables_are_read_only(table):
    """The tile tables are constants: the decode GEMM's split over K sets its summation order (its bits) and launch
    plans are cached from them, so no run-time change may reach them."""
    t = getattr(kernels, table)
    key = next(iter(t))
    with pytest.raises(TypeError):
        t[key] = 1
    with pytest.raises(TypeError):
        t["new_key"] = 1
    if table == "W8_MM_CONFIG":
        with pytest.raises(TypeError):
            t["tiles"][16]["block_k"] = 64


def test_named_recipes_are_read_only():
    """A recipe name means the same recipe everywhere in the process: RECIPES cannot be rebound or extended (a
    Recipe is frozen too); other recipes are passed as Recipe objects."""
    from fp8tensor import Recipe

    with pytest.raises(TypeError):
        fp8tensor.RECIPES["rowwise"] = Recipe("rowwise_other")
    with pytest.raises(TypeError):
        fp8tensor.RECIPES["mine"] = Recipe("mine")
    with pytest.raises(Exception):  # dataclasses.FrozenInstanceError
        fp8tensor.RECIPES["rowwise"].name = "x"
    assert sorted(fp8tensor.RECIPES) == ["rowwise", "rowwise_gw_hp"]

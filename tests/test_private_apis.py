"""The package reaches private PyTorch APIs only through ``fp8tensor/core/compat.py`` (the claim of its docstring).

The syntax tree of every other module of ``fp8tensor/`` is walked. A *private name* starts with one underscore (not a
dunder). The rule, outside ``compat.py``:

1. No import of a torch module path with a private part (``torch._subclasses``, ``torch.distributed._tensor``), nor
   of a private name from a torch module (``from torch.nn.modules.module import _global_forward_hooks``).
2. On a torch object reached by name, every private attribute is torch's: an attribute chain rooted at a name bound
   to torch (``torch``, ``import torch.autograd.forward_ad as fwd``, ``from torch import autograd``, or assigned
   from such a chain, ``aten = torch.ops.aten``) may not read a private name anywhere along it
   (``torch.autograd._unsafe_preserve_version_counter``, ``torch.ops._c10d_functional``).
3. On any other object (a tensor, a module, an op, an FSDP2 state: objects whose type the AST cannot know), an
   attribute ``obj._name`` (read, written or deleted; also ``getattr`` / ``hasattr`` / ``setattr`` / ``delattr``
   with a literal name) must be fp8tensor's own: a name the package defines (a function, class, module- or
   class-level name, a ``__slots__`` entry, an attribute set on ``self`` / ``cls``) or sets on objects it does not
   own under its ``_fp8`` prefix. Any other private attribute belongs to someone else (``module._parameters``,
   ``func._schema``, ``fsdp_param._sharded_param_data``, ``t._is_param``): torch's go through compat, another
   library's are listed in :data:`ALLOWED_FOREIGN` with the reason.
4. A private name of torch's own objects (the ``_``-names of ``torch``, ``torch.Tensor``, ``torch.nn.Module`` and
   its instances, ``DTensor``) never counts as the package's own, even where fp8tensor defines the same name.

Exempt everywhere: :data:`ALLOWED_TORCH`, the private ops and constructor that have no public spelling.

Rule 3 is sound for names the package does not define; its one blind spot is a torch private attribute that is not
listed by rule 4 and that fp8tensor also defines for itself (the own-names list below is printed on failure to help
spot such a collision).
"""
from __future__ import annotations

import ast
import pathlib

import torch

import fp8tensor

PKG = pathlib.Path(fp8tensor.__file__).parent

#: Private torch names allowed anywhere: the ops and the wrapper-subclass constructor (no public spelling exists).
ALLOWED_TORCH = {"_scaled_mm", "_scaled_grouped_mm", "_grouped_mm", "_make_wrapper_subclass", "_unsafe_view",
                 "_version", "_is_view", "_foreach_add_", "_foreach_mul_", "_to_copy", "_reshape_alias"}

#: Private attributes of other libraries than torch, read where fp8tensor meets them (name -> why).
ALLOWED_FOREIGN = {
    "_keep_in_fp32_modules": "transformers' PreTrainedModel class attribute (read with a default; no public form)",
    "_keep_in_fp32_modules_strict": "transformers' PreTrainedModel class attribute (as above)",
}

#: Uses that wait for a change in a module owned elsewhere, as ``"path:name"`` (path relative to ``fp8tensor/``) ->
#: the compat function that replaces them. The guard fails on any use not listed here, and on a listed one that is
#: gone (remove it from this table then).
PENDING: dict = {}

_ACCESSORS = ("getattr", "hasattr", "setattr", "delattr")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _torch_private_names() -> set[str]:
    """Private attribute names of torch's own objects (rule 4): the ``_``-names of ``torch``, ``torch.Tensor``,
    ``torch.nn.Module``, a Module instance (``_parameters``, ``_buffers``, ``_modules``, its hook dicts), a Parameter's
    marker on subclass tensors (``_is_param``) and the distributed tensor."""
    names = {n for n in dir(torch) if _private(n)}
    names |= {n for n in dir(torch.Tensor) if _private(n)}
    names |= {n for n in dir(torch.nn.Module) if _private(n)}
    names |= {n for n in vars(torch.nn.Module()) if _private(n)}
    names |= {"_is_param"}  # set by nn.Parameter(subclass tensor) on the tensor itself
    try:
        from torch.distributed.tensor import DTensor

        names |= {n for n in dir(DTensor) if _private(n)}
        names |= {"_local_tensor", "_spec"}
    except ImportError:  # pragma: no cover
        pass
    return names - ALLOWED_TORCH


def _literal_name(call: ast.Call):
    """``"_x"`` of ``getattr(obj, "_x", ...)`` and its kin, else None."""
    if (isinstance(call.func, ast.Name) and call.func.id in _ACCESSORS and len(call.args) >= 2
            and isinstance(call.args[1], ast.Constant) and isinstance(call.args[1].value, str)):
        return call.args[1].value
    return None


def _own_names(trees: list, torch_private: set) -> set[str]:
    """The private names fp8tensor defines for itself (rule 3) across ``trees``, less torch's (rule 4)."""
    own, on_others = set(), set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif isinstance(node, ast.ImportFrom) and (node.level > 0 or (node.module or "").startswith("fp8tensor")):
                own |= {a.asname or a.name for a in node.names}  # the package's own modules and names
            elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__slots__"
                                                      for t in node.targets):
                own |= {c.value for c in ast.walk(node.value)
                        if isinstance(c, ast.Constant) and isinstance(c.value, str)}
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                on_self = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
                (own if on_self else on_others).add(node.attr)
            elif isinstance(node, ast.Call) and _literal_name(node) and node.func.id == "setattr":
                on_others.add(_literal_name(node))
    own |= {n for n in on_others if n.startswith("_fp8")}
    return {n for n in own if _private(n)} - torch_private


def _violations(path: pathlib.Path, own: set, torch_private: set) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    out = []
    torch_names = {"torch"}

    def rooted_at_torch(node) -> bool:
        while isinstance(node, ast.Attribute):
            node = node.value
        return isinstance(node, ast.Name) and node.id in torch_names

    for node in ast.walk(tree):  # rule 2's bindings (imports first, then aliases of torch chains)
        if isinstance(node, ast.Import):
            torch_names |= {a.asname or a.name.split(".")[0] for a in node.names if a.name.startswith("torch")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("torch"):
            torch_names |= {a.asname or a.name for a in node.names}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, (ast.Attribute, ast.Name)) \
                and rooted_at_torch(node.value):
            torch_names |= {t.id for t in node.targets if isinstance(t, ast.Name)}

    def check(name: str, obj, lineno: int, how: str) -> None:
        if not _private(name) or name in ALLOWED_TORCH:
            return
        if rooted_at_torch(obj) or name in torch_private or (name not in own and name not in ALLOWED_FOREIGN):
            out.append(f"{lineno}: {how}{name}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            check(node.attr, node.value, node.lineno, ".")
        elif isinstance(node, ast.Call) and _literal_name(node):
            check(_literal_name(node), node.args[0], node.lineno, f"{node.func.id}(..., ")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("torch"):
            if any(_private(part) for part in node.module.split(".")):
                out.append(f"{node.lineno}: from {node.module} import ...")
            out += [f"{node.lineno}: from {node.module} import {a.name}" for a in node.names
                    if _private(a.name) and a.name not in ALLOWED_TORCH]
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("torch") and any(_private(p) for p in a.name.split(".")):
                    out.append(f"{node.lineno}: import {a.name}")
    return out


def _package_violations() -> dict[str, list[str]]:
    """``{"path:name": ["path:line: use", ...]}`` over ``fp8tensor/`` outside compat.py."""
    files = [p for p in sorted(PKG.rglob("*.py")) if p.name != "compat.py"]
    torch_private = _torch_private_names()
    own = _own_names([ast.parse(p.read_text(), str(p)) for p in files], torch_private)
    found: dict[str, list[str]] = {}
    for p in files:
        rel = p.relative_to(PKG).as_posix()
        for v in _violations(p, own, torch_private):
            line, use = v.split(": ", 1)
            name = use.rsplit(".", 1)[-1].rsplit(", ", 1)[-1].split(" ")[-1] if " import" not in use else use
            found.setdefault(f"{rel}:{name}", []).append(f"{rel}:{line}: {use}")
    return found


def test_private_torch_apis_only_in_compat():
    found = _package_violations()
    new = [u for key, uses in sorted(found.items()) if key not in PENDING for u in uses]
    assert not new, ("private PyTorch APIs (or private attributes of objects fp8tensor does not own) outside "
                     "fp8tensor/core/compat.py:\n" + "\n".join(new))


def test_pending_uses_are_still_there():
    """Each entry of :data:`PENDING` names a use that still exists and a compat function that exists: an entry whose
    use was moved into compat must leave the table (so it cannot excuse a new use later)."""
    from fp8tensor.core import compat

    found = _package_violations()
    gone = sorted(set(PENDING) - set(found))
    assert not gone, f"no longer used outside compat, remove from PENDING: {gone}"
    for key, call in PENDING.items():
        fn = call.split("(")[0].removeprefix("compat.")
        assert callable(getattr(compat, fn, None)), f"{key}: compat has no {fn}"


def _walk_source(tmp_path, src: str, own_src: str = "") -> set[str]:
    f = tmp_path / "m.py"
    f.write_text(src)
    torch_private = _torch_private_names()
    own = _own_names([ast.parse(src), ast.parse(own_src)], torch_private)
    return {v.split(": ", 1)[1] for v in _violations(f, own, torch_private)}


def test_the_walker_sees_private_uses(tmp_path):
    found = _walk_source(tmp_path, (
        "import torch\nimport torch.autograd.forward_ad as fwd\nfrom torch._subclasses import FakeTensor\n"
        "x = torch._C._len_torch_dispatch_stack()\ndef g(t):\n    return t._local_tensor, fwd._current_level\n"
        "import torch._dynamo\ny = torch._scaled_mm\nz = torch.nn.Linear\n"
        "w = torch.autograd._unsafe_preserve_version_counter\ndef h(m):\n    return m._parameters, m._buffers\n"))
    assert found == {"from torch._subclasses import ...", "._C", "._local_tensor",
                     "._current_level", "import torch._dynamo", "._unsafe_preserve_version_counter", "._parameters",
                     "._buffers", "._len_torch_dispatch_stack"}, found


def test_the_walker_sees_foreign_private_attributes_of_any_object(tmp_path):
    """Rule 3: private attributes the package does not define, on objects of unknown type, through getattr with a
    literal too; torch aliases (rule 2) and torch's names even where the package sets them (rule 4)."""
    found = _walk_source(tmp_path, (
        "import torch\n"
        "aten = torch.ops.aten\n"
        "def f(func, fp, t, m):\n"
        "    a = func._schema.arguments\n"                        # an op's private schema
        "    b = fp._sharded_param_data\n"                        # an FSDP2 internal
        "    c = getattr(t, '_local_tensors', None)\n"            # literal getattr
        "    setattr(m, '_forward_pre_hooks', {})\n"              # a Module's hook dict by setattr
        "    t._is_param = True\n"                                # torch's marker, set by the package
        "    d = aten._foo.default\n"                             # alias of a torch chain
        "    return a, b, c, d, m._fp8_hooks, t._mine, hasattr(t, '_mine'), t._scaled_mm\n"),
        own_src="class A:\n    __slots__ = ('_mine',)\ndef g(m):\n    m._fp8_hooks = True\n    m._other = 1\n")
    assert "from torch.nn.modules.module import _global_forward_hooks" in _walk_source(
        tmp_path, "from torch.nn.modules.module import _global_forward_hooks\nx = _global_forward_hooks\n")
    assert found == {"._schema", "._sharded_param_data", "getattr(..., _local_tensors", "setattr(..., _forward_pre_hooks",
                     "._is_param", "._foo"}, found


def test_the_walker_does_not_take_a_foreign_store_for_an_own_name(tmp_path):
    """An attribute set on another object without the ``_fp8`` prefix does not become the package's own: setting
    ``fp._sharded_param_data = x`` outside compat does not excuse reading it."""
    found = _walk_source(tmp_path, "def f(fp, x):\n    fp._sharded_param_data = x\n    return fp._sharded_param_data\n")
    assert found == {"._sharded_param_data"}, found

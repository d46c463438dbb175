"""The package reaches private PyTorch APIs only through ``fp8tensor/core/compat.py`` (the claim of its docstring).

The syntax trees of every other module are walked: an attribute whose name starts with one underscore (``t._spec``,
``torch._C``, ``torch._dynamo``) and an import of a private torch module (``torch._subclasses``,
``torch.distributed._composable_state``) fail, except the names below: the fp8 ops themselves and the subclass
constructor, which have no public form, and the package's own private names (its modules, its classes' attributes).
"""
from __future__ import annotations

import ast
import pathlib

import torch

import fp8tensor

PKG = pathlib.Path(fp8tensor.__file__).parent

#: Private torch names allowed anywhere: the ops and the wrapper-subclass constructor (no public spelling exists).
ALLOWED_TORCH = {"_scaled_mm", "_scaled_grouped_mm", "_grouped_mm", "_make_wrapper_subclass", "_unsafe_view",
                 "_version", "_is_view", "_foreach_add_", "_foreach_mul_", "_to_copy"}


def _torch_private_names() -> set[str]:
    """Private attribute names of torch's own objects (module and tensor attributes) that must not appear outside
    compat: the ``_``-names of ``torch``, ``torch.Tensor``, ``torch.nn.Module`` and the distributed tensor."""
    names = {n for n in dir(torch) if n.startswith("_") and not n.startswith("__")}
    names |= {n for n in dir(torch.Tensor) if n.startswith("_") and not n.startswith("__")}
    names |= {n for n in dir(torch.nn.Module) if n.startswith("_") and not n.startswith("__")}
    # instance attributes every Module has (module._parameters, ._buffers, ._modules, its hook dicts)
    names |= {n for n in vars(torch.nn.Module()) if n.startswith("_") and not n.startswith("__")}
    try:
        from torch.distributed.tensor import DTensor

        names |= {n for n in dir(DTensor) if n.startswith("_") and not n.startswith("__")}
        names |= {"_local_tensor", "_spec"}
    except ImportError:  # pragma: no cover
        pass
    return names - ALLOWED_TORCH


def _violations(path: pathlib.Path, private: set[str]) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    out = []
    # names bound to torch modules or objects by an import (``import torch.autograd.forward_ad as fwd``): any private
    # attribute of them counts, whatever its name
    torch_names = {"torch"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            torch_names |= {a.asname or a.name.split(".")[0] for a in node.names if a.name.startswith("torch")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("torch"):
            torch_names |= {a.asname or a.name for a in node.names}
    def rooted_at_torch(node) -> bool:  # ``torch.autograd.x``: an attribute chain that starts at a torch name
        while isinstance(node, ast.Attribute):
            node = node.value
        return isinstance(node, ast.Name) and node.id in torch_names

    for node in ast.walk(tree):
        on_torch_name = (isinstance(node, ast.Attribute) and rooted_at_torch(node.value)
                         and node.attr.startswith("_")
                         and not node.attr.startswith("__") and node.attr not in ALLOWED_TORCH)
        if isinstance(node, ast.Attribute) and (node.attr in private or on_torch_name):
            out.append(f"{path.name}:{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("torch"):
            if any(part.startswith("_") for part in node.module.split(".")):
                out.append(f"{path.name}:{node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("torch") and any(p.startswith("_") for p in a.name.split(".")):
                    out.append(f"{path.name}:{node.lineno}: import {a.name}")
    return out


def test_private_torch_apis_only_in_compat():
    private = _torch_private_names()
    bad = [v for p in sorted(PKG.rglob("*.py")) if p.name != "compat.py" for v in _violations(p, private)]
    assert not bad, "private PyTorch APIs outside fp8tensor/core/compat.py:\n" + "\n".join(bad)


def test_the_walker_sees_private_uses(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import torch\nimport torch.autograd.forward_ad as fwd\nfrom torch._subclasses import FakeTensor\n"
                 "x = torch._C._len_torch_dispatch_stack()\ndef g(t):\n    return t._local_tensor, fwd._current_level\n"
                 "import torch._dynamo\ny = torch._scaled_mm\nz = torch.nn.Linear\n"
                 "w = torch.autograd._unsafe_preserve_version_counter\ndef h(m):\n    return m._parameters, m._buffers\n")
    found = {v.split(": ", 1)[1] for v in _violations(f, _torch_private_names())}
    assert found == {"from torch._subclasses import ...", "._C", "._local_tensor",
                     "._current_level", "import torch._dynamo", "._unsafe_preserve_version_counter", "._parameters",
                     "._buffers", "._len_torch_dispatch_stack"}, found

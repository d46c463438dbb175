"""``torch.export`` of tensor-parallel fp8 models (DTensor weights whose local tensors are ScaledFp8Tensors or
master weights): torch.export does not trace DTensor's parallel styles on the supported torch versions (a
high-precision TP model fails inside ``DTensor.from_local``), so fp8tensor raises its own error naming the remedy
whether the model was converted after or before ``parallelize_module`` (strict and non-strict; the check runs before
any parallel style's hook), and the model is left unchanged and still runs (checked against the same model's
outputs before the export attempt). One process, one rank: a 1-rank gloo process group (a real
mesh: the DTensor weights and the parallel styles' hooks are those of any TP run)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fp8tensor

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


@pytest.fixture(scope="module")
def mesh():
    from torch.distributed.device_mesh import init_device_mesh

    own = not dist.is_initialized()
    if own:
        import tempfile

        store = tempfile.NamedTemporaryFile(delete=False)
        dist.init_process_group("gloo", init_method=f"file://{store.name}", rank=0, world_size=1)
    elif dist.get_world_size() != 1:
        pytest.fail(f"a process group of world size {dist.get_world_size()} is already initialized (left by an earlier test)")
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        if own:
            dist.destroy_process_group()


def _model():
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32))


_MATCH = (r"fp8tensor \(Fp8Linear[^)]*\): torch\.export of a tensor-parallel fp8 Linear.*Export the model before "
          r"parallelize_module.*serve the TP model eagerly or with torch\.compile")


def _snapshot(m: nn.Module) -> list:
    """What a failed export must leave as it was: parameters (objects and local tensors) and hooks of every module."""
    out = []
    for name, mod in m.named_modules():
        out.append((name, type(mod), list(mod._forward_pre_hooks.items()), list(mod._forward_hooks.items())))
        for pn, p in mod._parameters.items():
            local = p._local_tensor if hasattr(p, "_local_tensor") else p
            out.append((name, pn, id(p), id(local), type(local)))
    return out


def _convert(m, how):
    return (fp8tensor.quantize_weights if how == "quantize" else fp8tensor.convert_to_fp8)(m)


@pytest.mark.parametrize("strict", [False, True], ids=["nonstrict", "strict"])
@pytest.mark.parametrize("how", ["quantize", "convert"])
@pytest.mark.parametrize("tp_first", [True, False], ids=["tp_then_fp8", "fp8_then_tp"])
def test_tp_export_raises_naming_fp8tensor(mesh, tp_first, how, strict):
    # Both orders: converted after parallelize_module (the serving order) the Linear's check is first among its
    # hooks; converted before, the parallel style's hooks come later but fp8tensor's check still runs first (on the
    # model, and on each Linear once its weight becomes a DTensor), so the user never sees DTensor's own failure.
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    m = _model()
    ref = _model()
    ref.load_state_dict(m.state_dict())
    if tp_first:
        parallelize_module(m, mesh, plan)
        _convert(m, how)
    else:
        _convert(m, how)
        parallelize_module(m, mesh, plan)
    _convert(ref, how)
    x = torch.randn(4, 64)
    with torch.no_grad():
        before = m(x)
        assert torch.equal(before, ref(x))  # one rank: the TP model is the single-device fp8 model
    snap = _snapshot(m)
    # strict: dynamo wraps the error in its own exception, with fp8tensor's message inside
    with pytest.raises(NotImplementedError if not strict else Exception, match=_MATCH):
        torch.export.export(m, (x,), strict=strict)
    assert _snapshot(m) == snap
    x2 = torch.randn(4, 64)
    with torch.no_grad():
        assert torch.equal(m(x), before)
        assert torch.equal(m(x2), ref(x2))
    # the remedy the message names: the unsharded model exports
    ep = torch.export.export(ref, (x,), strict=strict)
    with torch.no_grad():
        assert torch.equal(ep.module()(x2), ref(x2))


@pytest.mark.parametrize("strict", [False, True], ids=["nonstrict", "strict"])
@pytest.mark.parametrize("how", ["quantize", "convert"])
def test_tp_export_of_a_submodule_converted_before_tp(mesh, how, strict):
    # The model converted, then one of its submodules parallelized and exported on its own: the Linears' own checks
    # (registered when parallelize_module gave them DTensor weights) run before the parallel styles' hooks.
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    outer = nn.Sequential(_model(), nn.ReLU())
    _convert(outer, how)
    inner = outer[0]
    parallelize_module(inner, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(4, 64)
    with torch.no_grad():
        before = inner(x)
    snap = _snapshot(outer)
    with pytest.raises(NotImplementedError if not strict else Exception, match=_MATCH):
        torch.export.export(inner, (x,), strict=strict)
    assert _snapshot(outer) == snap
    with torch.no_grad():
        assert torch.equal(inner(x), before)


@pytest.mark.parametrize("strict", [False, True], ids=["nonstrict", "strict"])
@pytest.mark.parametrize("tp_first", [True, False], ids=["tp_then_fp8", "fp8_then_tp"])
def test_tp_export_with_a_style_on_a_parent_module(mesh, tp_first, strict):
    # A parallel style on a module above the Linears (PrepareModuleInput, as TP plans of transformer blocks use): its
    # hook would run before any Linear's; the check on the converted model runs before it.
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   parallelize_module)

    m = nn.Sequential(_model())
    plan = {"0": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),),
                                    use_local_output=True),
            "0.0": ColwiseParallel(), "0.2": RowwiseParallel()}
    if tp_first:
        parallelize_module(m, mesh, plan)
        fp8tensor.quantize_weights(m)
    else:
        fp8tensor.quantize_weights(m)
        parallelize_module(m, mesh, plan)
    x = torch.randn(4, 64)
    with torch.no_grad():
        before = m(x)
    snap = _snapshot(m)
    with pytest.raises(NotImplementedError if not strict else Exception, match=_MATCH.replace("[^)]*", " '0.0'")):
        torch.export.export(m, (x,), strict=strict)
    assert _snapshot(m) == snap
    with torch.no_grad():
        assert torch.equal(m(x), before)


def test_untouched_model_keeps_hook_free_linears():
    # Without tensor parallelism the converted Linears have no forward hooks (their eager fast path); the model
    # itself has the one export check, which does nothing outside torch.export.
    m = fp8tensor.quantize_weights(_model())
    assert not m[0]._forward_pre_hooks and not m[2]._forward_pre_hooks
    assert len(m._forward_pre_hooks) == 1
    fp8tensor.quantize_weights(m)  # again: still one
    assert len(m._forward_pre_hooks) == 1
    x = torch.randn(3, 64)
    ep = torch.export.export(m, (x,))
    with torch.no_grad():
        assert torch.equal(ep.module()(x), m(x))

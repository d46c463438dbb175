"""``torch.export`` of tensor-parallel fp8 models (DTensor weights whose local tensors are ScaledFp8Tensors or
master weights): torch.export does not trace DTensor's parallel styles on the supported torch versions (a
high-precision TP model fails inside ``DTensor.from_local``), so fp8tensor raises its own error naming the remedy
when the model was converted after ``parallelize_module`` (strict and non-strict; converted before, the parallel
style's hook fails first with PyTorch's error), and the model is left unchanged and still runs (checked against
the same model's outputs before the export attempt). One process, one rank: a 1-rank gloo process group (a real
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
        pytest.skip(f"a process group of world size {dist.get_world_size()} is already initialized")
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        if own:
            dist.destroy_process_group()


def _model():
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32))


@pytest.mark.parametrize("strict", [False, True], ids=["nonstrict", "strict"])
@pytest.mark.parametrize("order", ["tp_then_quantize", "quantize_then_tp", "tp_then_convert"])
def test_tp_export_raises_naming_fp8tensor(mesh, order, strict):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    m = _model()
    ref = _model()
    ref.load_state_dict(m.state_dict())
    if order == "quantize_then_tp":
        fp8tensor.quantize_weights(m)
        parallelize_module(m, mesh, plan)
    else:
        parallelize_module(m, mesh, plan)
        (fp8tensor.quantize_weights if order == "tp_then_quantize" else fp8tensor.convert_to_fp8)(m)
    (fp8tensor.convert_to_fp8 if order == "tp_then_convert" else fp8tensor.quantize_weights)(ref)
    x = torch.randn(4, 64)
    with torch.no_grad():
        before = m(x)
        assert torch.equal(before, ref(x))  # one rank: the TP model is the single-device fp8 model
    # Converted after parallelize_module (the serving order): fp8tensor's error, first among the Linear's hooks.
    # Converted before: the parallel style's input hook runs first and fails in DTensor.from_local (PyTorch's own
    # error, as for a high-precision TP model).
    match = (r"fp8tensor.*torch\.export of a tensor-parallel fp8 Linear.*Export the model before parallelize_module"
             if order != "quantize_then_tp" else r"DTensorSpec|DTensor|fp8tensor")
    with pytest.raises(Exception, match=match):
        torch.export.export(m, (x,), strict=strict)
    with torch.no_grad():
        assert torch.equal(m(x), before)
    # the remedy the message names: the unsharded model exports
    ep = torch.export.export(ref, (x,), strict=strict)
    with torch.no_grad():
        assert torch.equal(ep.module()(x), ref(x))

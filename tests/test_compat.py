"""``fp8tensor.compat``: each private torch API the package uses exists and behaves as expected on the installed torch
(CI runs this on torch 2.13 and 2.14.1, the GPU tests on 2.11)."""
from __future__ import annotations

import torch
import torch.nn as nn

import fp8tensor
from fp8tensor import compat


def test_torch_version_parsed():
    assert compat.TORCH_VERSION >= (2, 11), torch.__version__
    assert compat._version("2.14.1+cu130") == (2, 14) and compat._version("2.13.0a0+git1234") == (2, 13)


def test_master_weights_get_the_default_foreach_and_fused_optimizer_paths():
    """Optimizers built without foreach= / fused= treat a master like a plain parameter (not a Python loop)."""
    from torch.optim.optimizer import _default_to_fused_or_foreach
    from torch.utils._foreach_utils import _foreach_supported_types

    model = nn.Sequential(nn.Linear(16, 16))
    fp8tensor.convert_to_fp8(model)
    assert type(model[0].weight) is fp8tensor.Fp8MasterWeight
    assert fp8tensor.Fp8MasterWeight in _foreach_supported_types
    params = list(model.parameters())
    plain = list(nn.Linear(16, 16).parameters())
    # The same choice as for the plain model on this device (foreach on CUDA; on CPU PyTorch picks neither).
    assert _default_to_fused_or_foreach(params, False, False) == _default_to_fused_or_foreach(plain, False, False)
    assert _default_to_fused_or_foreach(params, False, True) == _default_to_fused_or_foreach(plain, False, True)


def test_dtensor_accessors():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        local = torch.randn(4, 3)
        d = DTensor.from_local(local, mesh, [Replicate()])
        assert compat.local_tensor(d).data_ptr() == local.data_ptr() and torch.equal(compat.local_tensor(d), local)
        assert tuple(compat.dtensor_spec(d).placements) == (Replicate(),)
        new = torch.randn(4, 3)
        compat.set_local_tensor(d, new)
        assert torch.equal(d.to_local(), new)
    finally:
        if own:
            dist.destroy_process_group()


def test_mode_queries():
    from torch.utils._python_dispatch import TorchDispatchMode

    assert not compat.dispatch_modes_active() and not compat.function_modes_active() and not compat.functorch_active()

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Mode():
        assert compat.dispatch_modes_active()
    with torch.overrides.TorchFunctionMode():
        assert compat.function_modes_active()
    assert torch.func.grad(lambda x: (x * float(compat.functorch_active())).sum())(torch.ones(2)).sum() == 2

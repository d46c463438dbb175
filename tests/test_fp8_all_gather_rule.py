"""``convert_to_fp8(..., fp8_all_gather=None)``: the documented rule that picks FSDP2's weight all-gather dtype
(fp8 with row scales across hosts, ``param_dtype`` within one host over NCCL), the explicit choices, and refusal of
a non-bool."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fp8tensor
from fp8tensor.distributed import fsdp_state
from fp8tensor.master import Fp8MasterWeight


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64, bias=False), nn.Linear(64, 32, bias=False))


def test_no_process_group_keeps_the_fp8_all_gather():
    assert not dist.is_initialized()
    assert fsdp_state.fp8_all_gather_default() is True
    m = fp8tensor.convert_to_fp8(_model())
    assert all(isinstance(lin.weight, Fp8MasterWeight) and lin.fp8_all_gather for lin in m)


@pytest.mark.parametrize("choice", [True, False])
def test_explicit_choice_is_kept(choice):
    m = fp8tensor.convert_to_fp8(_model(), fp8_all_gather=choice)
    for lin in m:
        assert lin.fp8_all_gather is choice
        assert isinstance(lin.weight, Fp8MasterWeight) is choice
        assert isinstance(lin.weight, nn.Parameter)


@pytest.mark.parametrize("bad", ["yes", 1, 0.0])
def test_non_bool_raises_before_any_change(bad):
    m = _model()
    w = m[0].weight
    with pytest.raises(TypeError, match="convert_to_fp8: fp8_all_gather must be None, True or False"):
        fp8tensor.convert_to_fp8(m, fp8_all_gather=bad)
    assert m[0].weight is w and type(w) is nn.Parameter and not hasattr(m[0], "fp8_recipe")


@pytest.mark.parametrize("backend,world,local_env,gpus,expected", [
    ("gloo", 1, "1", 1, True),          # not NCCL: keep fp8 (CPU / gloo jobs)
    ("nccl", 1, "1", 1, False),         # one GPU
    ("nccl", 8, "8", 8, False),         # one host of 8 GPUs (torchrun's LOCAL_WORLD_SIZE)
    ("nccl", 16, "8", 8, True),         # two hosts
    ("nccl", 8, None, 8, False),        # no LOCAL_WORLD_SIZE: the world fits this host's GPUs
    ("nccl", 16, None, 8, True),        # ... or it does not
    ("cpu:gloo,cuda:nccl", 4, "4", 4, False),
])
def test_rule(monkeypatch, backend, world, local_env, gpus, expected):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda *a: backend)
    monkeypatch.setattr(dist, "get_world_size", lambda *a: world)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    if local_env is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local_env)
    assert fsdp_state.fp8_all_gather_default() is expected
    m = fp8tensor.convert_to_fp8(_model())
    assert all(isinstance(lin.weight, Fp8MasterWeight) is expected and lin.fp8_all_gather is expected for lin in m)


def test_reconverting_a_master_keeps_it():
    m = fp8tensor.convert_to_fp8(_model(), fp8_all_gather=True)
    fp8tensor.convert_to_fp8(m, recipe="rowwise_gw_hp", fp8_all_gather=False)
    assert all(isinstance(lin.weight, Fp8MasterWeight) and lin.fp8_all_gather for lin in m)
    assert all(lin.weight.recipe.name == "rowwise_gw_hp" for lin in m)

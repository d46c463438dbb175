"""``convert_to_fp8(..., fp8_all_gather=...)``: True makes each weight a master that FSDP2 all-gathers in fp8; False
keeps plain Parameters (FSDP2 gathers them in its ``param_dtype``); None (default) applies the documented rule (bf16
within one host over NCCL, fp8 across hosts, with other backends or without a process group). The choice is stored
on each Linear, a value that is not None or a bool is refused before anything changes, and both train alike against
float64."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fp8tensor
from fp8tensor.distributed import fsdp_state
from fp8tensor.master import Fp8MasterWeight


def _model():
    torch.manual_seed(torch.initial_seed())  # (the test's seed, set and printed by conftest: same weights twice)
    return nn.Sequential(nn.Linear(32, 64, bias=False), nn.Linear(64, 32, bias=False))


def test_default_without_a_process_group_is_the_fp8_all_gather():
    assert not dist.is_initialized()
    assert fsdp_state.fp8_all_gather_default() is True
    m = fp8tensor.convert_to_fp8(_model())
    assert all(isinstance(lin.weight, Fp8MasterWeight) and lin.fp8_all_gather is True for lin in m)


@pytest.mark.parametrize("backend,world,local_env,gpus,expected", [
    ("gloo", 1, "1", 1, True),          # not NCCL: fp8 (CPU / gloo jobs)
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
    for name in _HINTS:
        monkeypatch.delenv(name, raising=False)
    if local_env is not None:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local_env)
    assert fsdp_state.fp8_all_gather_default() is expected
    m = fp8tensor.convert_to_fp8(_model())
    assert all(isinstance(lin.weight, Fp8MasterWeight) is expected and lin.fp8_all_gather is expected for lin in m)


#: the environment variables the rule reads for the ranks per host / the hosts of the job
_HINTS = ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_STEP_NUM_NODES", "SLURM_NNODES")


@pytest.mark.parametrize("env,world,gpus,expected", [
    ({"SLURM_NNODES": "2"}, 8, 8, True),                        # srun over 2 hosts x 4 GPUs of 8: not one host
    ({"SLURM_NNODES": "2", "SLURM_STEP_NUM_NODES": "1"}, 8, 8, False),  # the step runs on one host of the job
    ({"SLURM_NNODES": "1"}, 8, 1, False),                       # one host, one GPU visible per rank
    ({"OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, 8, 8, True),          # mpirun, 4 ranks on each of 2 hosts
    ({"MPI_LOCALNRANKS": "8"}, 8, 1, False),                    # MPICH, 8 ranks on this host
    ({"LOCAL_WORLD_SIZE": "8", "SLURM_NNODES": "2"}, 8, 8, False),  # torchrun's own count wins
])
def test_rule_reads_the_launchers_host_counts(monkeypatch, env, world, gpus, expected):
    # without torchrun's LOCAL_WORLD_SIZE the GPU-count guess takes 2 hosts x 4 ranks on 8-GPU hosts for one host
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda *a: "nccl")
    monkeypatch.setattr(dist, "get_world_size", lambda *a: world)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    for name in _HINTS:
        monkeypatch.delenv(name, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert fsdp_state.fp8_all_gather_default() is expected


@pytest.mark.parametrize("world,local,ag,warns", [
    ("2", "2", None, True),     # one host under torchrun, converted before init_process_group: the choice would flip
    ("4", "2", None, False),    # two hosts: fp8 before and after init
    ("1", "1", None, False),    # a single process
    ("2", "2", True, False),    # asked explicitly
])
def test_converting_before_init_in_a_one_host_job_warns(monkeypatch, world, local, ag, warns):
    import warnings
    assert not dist.is_initialized()
    monkeypatch.setenv("WORLD_SIZE", world)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # (the job would init NCCL)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        m = fp8tensor.convert_to_fp8(_model(), fp8_all_gather=ag)
    hit = [w for w in rec if "torch.distributed is not initialized yet" in str(w.message)]
    assert bool(hit) is warns, [str(w.message) for w in rec]
    assert all(isinstance(lin.weight, Fp8MasterWeight) for lin in m)  # the choice itself is unchanged


def test_the_rule_never_drops_a_master(monkeypatch):
    # a master converted before keeps its fp8 all-gather when a later default conversion's rule says bf16 (silently:
    # only an explicit False is warned about)
    m = fp8tensor.convert_to_fp8(_model(), fp8_all_gather=True)
    monkeypatch.setattr(fsdp_state, "fp8_all_gather_default", lambda: False)
    monkeypatch.setattr("fp8tensor.conversion.convert.fp8_all_gather_default", lambda: False)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fp8tensor.convert_to_fp8(m, recipe="rowwise_gw_hp")
    assert all(isinstance(lin.weight, Fp8MasterWeight) and lin.fp8_all_gather for lin in m)


@pytest.mark.parametrize("choice", [True, False])
def test_explicit_choice_is_kept_and_trains(choice):
    ref = _model().double()
    m = fp8tensor.convert_to_fp8(_model(), fp8_all_gather=choice)
    for lin in m:
        assert lin.fp8_all_gather is choice
        assert isinstance(lin.weight, Fp8MasterWeight) is choice
        assert isinstance(lin.weight, nn.Parameter)
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(torch.initial_seed()))
    y = m(x)
    y.square().mean().backward()
    yr = ref(x.double())
    yr.square().mean().backward()
    # two chained Linears, 4 e4m3 operands of relative RMS rounding error <= 2^-4/sqrt(3) each, in quadrature
    bound = 2 * 2**-4 / 3**0.5 * 4**0.5
    assert ((y.double() - yr).norm() / yr.norm()).item() < bound, torch.initial_seed()
    for lin, lr in zip(m, ref):
        g, gr = lin.weight.grad.double(), lr.weight.grad
        assert ((g - gr).norm() / gr.norm()).item() < 2 * bound, torch.initial_seed()


@pytest.mark.parametrize("bad", ["yes", 1, 0.0])
def test_non_bool_raises_before_any_change(bad):
    m = _model()
    w = m[0].weight
    with pytest.raises(TypeError, match="convert_to_fp8: fp8_all_gather must be None, True or False"):
        fp8tensor.convert_to_fp8(m, fp8_all_gather=bad)
    assert m[0].weight is w and type(w) is nn.Parameter and not hasattr(m[0], "fp8_recipe")


def test_reconverting_a_master_keeps_it_and_says_so():
    m = fp8tensor.convert_to_fp8(_model(), fp8_all_gather=True)
    with pytest.warns(UserWarning, match="fp8_all_gather=False does not apply .* 0, 1"):
        fp8tensor.convert_to_fp8(m, recipe="rowwise_gw_hp", fp8_all_gather=False)
    assert all(isinstance(lin.weight, Fp8MasterWeight) and lin.fp8_all_gather for lin in m)
    assert all(lin.weight.recipe.name == "rowwise_gw_hp" for lin in m)


def test_quantize_weights_after_a_plain_conversion_updates_the_attribute():
    # the weight becomes a ScaledFp8Tensor, which FSDP2 all-gathers in fp8: the stored choice must say so
    from fp8tensor import ScaledFp8Tensor
    m = fp8tensor.convert_to_fp8(_model(), fp8_all_gather=False)
    assert [lin.fp8_all_gather for lin in m] == [False, False]
    fp8tensor.quantize_weights(m)
    assert all(isinstance(lin.weight, ScaledFp8Tensor) and lin.fp8_all_gather is True for lin in m)


def test_no_warning_before_init_without_cuda(monkeypatch):
    # a CPU job's process group is gloo, where the rule answers True before and after init: nothing to warn about
    import warnings
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m = fp8tensor.convert_to_fp8(_model())
    assert all(isinstance(lin.weight, Fp8MasterWeight) for lin in m)


@pytest.mark.parametrize("asked", [None, False, True])
def test_large_weights_take_the_fp8_all_gather_under_the_rules_bf16(monkeypatch, asked):
    """Where the rule picks the bf16 all-gather (one host), a weight of at least ``fp8_all_gather_min_numel``
    elements is still all-gathered in fp8 (the choice stored per Linear); an explicit True or False applies to every
    Linear. Both Linears then train against float64 within the fp8 bound."""
    from conftest import E4M3_GEMM_BOUND, rel_err

    monkeypatch.setattr(fsdp_state, "fp8_all_gather_default", lambda: False)
    monkeypatch.setattr(fp8tensor.conversion.convert, "fp8_all_gather_default", lambda: False)
    m = _model()  # 32 -> 64 and 64 -> 32: 2048 elements each
    big = nn.Linear(32, 256, bias=False)  # 8192 elements
    m.append(big)
    ref = [lin.weight.detach().double().clone() for lin in m]
    with fp8tensor.config(fp8_all_gather_min_numel=8192):
        fp8tensor.convert_to_fp8(m, fp8_all_gather=asked)
    expected = [asked is True, asked is True, asked is not False]
    assert [isinstance(lin.weight, Fp8MasterWeight) for lin in m] == expected
    assert [lin.fp8_all_gather for lin in m] == expected
    x = torch.randn(16, 32, dtype=torch.float64)
    y = m(x.float())
    out = x
    for w in ref:
        out = out @ w.t()
    assert rel_err(y, out) <= 3 * E4M3_GEMM_BOUND


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "big"])
def test_fp8_all_gather_min_numel_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match="fp8_all_gather_min_numel"):
        with fp8tensor.config(fp8_all_gather_min_numel=bad):
            pass  # pragma: no cover
